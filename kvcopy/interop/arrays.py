"""Pointer, size and block-id arguments -> validated NumPy arrays."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from kvcopy.interop.frameworks import framework_of
from kvcopy.interop.tensors import torch_integers_refusal

_U64_MAX = 2**64 - 1
_ID_MAX = 2**63 - 1


def torch_integers(obj: Any, name: str, *, host_only: bool) -> np.ndarray:
    """A torch tensor of integers as a NumPy array of its values. Raises TypeError
    naming ``name`` for a tensor whose elements are not plain integers (meta, sparse,
    nested, masked, quantized, negative or conjugate views, other dtypes) or, with
    ``host_only``, one not on the CPU."""
    refusal = torch_integers_refusal(obj)
    if refusal:
        raise TypeError(f"{name}: {refusal}")
    if host_only and obj.device.type != "cpu":
        raise TypeError(
            f"{name}: a torch tensor of pointers or sizes must be on the CPU, got one on {obj.device}"
        )
    return obj.detach().cpu().contiguous().numpy()


def plain_int64(t: Any) -> bool:
    """Whether ``t`` (a torch object) is a plain int64 tensor: a torch.Tensor itself,
    strided, not nested, no negative view. torch_integers' checks all pass for such a
    tensor (a meta tensor is neither on the CPU nor on a GPU, which callers ask), so
    the engines' block ids and row indices, read at every call, skip them."""
    torch = sys.modules["torch"]
    return (
        type(t) is torch.Tensor
        and t.dtype is torch.int64
        and t.layout is torch.strided
        and not t.is_nested
        and not t.is_neg()
    )


def plain_host_int64(t: Any, ndim: int) -> np.ndarray | None:
    """A plain int64 CPU torch tensor (plain_int64) of ``ndim`` dimensions as a
    C-contiguous NumPy array of its values (no copy where it is contiguous); None for
    anything else, which is read and checked in full."""
    if not (plain_int64(t) and t.is_cpu and t.dim() == ndim):
        return None
    return np.ascontiguousarray(t.numpy())  # (an integer tensor never requires grad)


def _from_sequence(obj: Any, name: str) -> np.ndarray:
    for index, item in enumerate(obj):
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)):
            raise TypeError(
                f"{name}[{index}] is {type(item).__name__} ({item!r}); pointers and sizes must be integers"
            )
        if int(item) < 0:
            raise ValueError(f"{name}[{index}] = {item} is negative")
        if int(item) > _U64_MAX:
            raise ValueError(f"{name}[{index}] = {item} does not fit in 64 bits")
    if any(int(item) > 2**63 - 1 for item in obj):
        return np.array([int(item) for item in obj], dtype=np.uint64)
    return np.asarray(obj, dtype=np.int64)


_U64 = np.dtype(np.uint64)
# The most copies one batch may name: 2**31 descriptors are 64 GiB of pointer arrays
# alone, past any real batch; a longer sequence is a mistake, refused before it is read.
MAX_BATCH = 2**31 - 1


def _refuse_absurd_length(obj: Any, name: str) -> None:
    try:
        length = len(obj)
    except OverflowError:
        raise ValueError(f"{name}: a sequence too long to count is no batch") from None
    except TypeError:
        return  # no length: let the array conversion decide
    if length > MAX_BATCH:
        raise ValueError(f"{name}: {length} entries, more than the {MAX_BATCH} a batch may hold")


def as_u64_array(obj: Any, name: str) -> np.ndarray:
    """Return ``obj`` as a C-contiguous 1-D uint64 array, or raise.

    Accepts sequences of ints, NumPy integer arrays, CPU torch tensors and
    objects with the buffer protocol.

    Raises:
        TypeError: not integers (floats, bools, strings, None, objects).
        ValueError: not one-dimensional, or negative values.
    """
    if type(obj) is np.ndarray and obj.dtype == _U64 and obj.ndim == 1 and obj.flags.c_contiguous:
        return obj  # already what the planner takes: the common case, kept cheap
    if obj is None or isinstance(obj, (str, bytes, bytearray, int, float)):
        raise TypeError(f"{name}: expected a sequence or array of integers, got {type(obj).__name__}")
    if framework_of(obj) == "torch":
        arr = torch_integers(obj, name, host_only=True)
    elif isinstance(obj, np.ndarray):
        arr = obj
    elif isinstance(obj, (list, tuple)):
        _refuse_absurd_length(obj, name)
        arr = _from_sequence(obj, name)
    else:
        _refuse_absurd_length(obj, name)
        try:
            arr = np.asarray(memoryview(obj))
        except TypeError:
            try:
                arr = np.asarray(obj)
            except (OverflowError, MemoryError, ValueError) as exc:
                raise ValueError(
                    f"{name}: cannot be read as an array of integers ({type(exc).__name__}: {exc})"
                ) from None
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer dtype, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {tuple(arr.shape)}")
    if arr.dtype.kind == "i" and arr.size and arr.min() < 0:
        index = int(np.argmax(arr < 0))
        raise ValueError(f"{name}[{index}] = {int(arr[index])} is negative")
    return np.ascontiguousarray(arr, dtype=np.uint64)


def as_list(obj: Any) -> list:
    """A list or tuple as a list; anything else as a list of one."""
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def as_block_mapping(block_mapping: Any) -> np.ndarray:
    """An (n, 2) int64 array of [source block, destination block] pairs. The engines'
    own (an int64 NumPy array of that shape, a plain int64 CPU tensor) are taken as
    they are: every check below passes for them."""
    if (
        type(block_mapping) is np.ndarray
        and block_mapping.dtype == np.int64
        and block_mapping.ndim == 2
        and block_mapping.shape[1] == 2
    ):
        return block_mapping
    framework = framework_of(block_mapping)
    if framework == "torch":
        plain = plain_host_int64(block_mapping, 2)
        if plain is not None and plain.shape[1] == 2:
            return plain
        block_mapping = torch_integers(block_mapping, "block_mapping", host_only=False)
    elif framework == "cupy":
        block_mapping = block_mapping.get()
    elif isinstance(block_mapping, (list, tuple)):
        for i, pair in enumerate(block_mapping):
            if (
                not isinstance(pair, (list, tuple, np.ndarray))
                or len(pair) != 2
                or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in pair)
            ):
                raise TypeError(f"block_mapping[{i}] must be a pair of ints, got {pair!r}")
            for column, v in enumerate(pair):
                if not -_ID_MAX - 1 <= int(v) <= _ID_MAX:
                    side = "source" if column == 0 else "destination"
                    raise ValueError(
                        f"block_mapping[{i}]: {side} block {int(v)} is out of range "
                        "(block ids must be below 2**63)"
                    )
    if isinstance(block_mapping, (list, tuple)) and not block_mapping:
        return np.empty((0, 2), dtype=np.int64)  # [] names no pairs, whatever its dtype reads
    arr = np.asarray(block_mapping)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"block_mapping: expected integer block ids, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"block_mapping: expected shape (n, 2), got {arr.shape}")
    if arr.size == 0:
        return np.empty((0, 2), dtype=np.int64)
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _ID_MAX:
        pair, column = (int(i) for i in np.argwhere(arr > _ID_MAX)[0])
        side = "source" if column == 0 else "destination"
        raise ValueError(
            f"block_mapping[{pair}]: {side} block {int(arr[pair, column])} is out of "
            "range (block ids must be below 2**63)"
        )
    return arr.astype(np.int64, copy=False)
