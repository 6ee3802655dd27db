"""Pointer and size arguments -> validated 1-D uint64 NumPy arrays."""
from __future__ import annotations

from typing import Any

import numpy as np

_U64_MAX = 2**64 - 1


def _from_torch(obj: Any, name: str) -> np.ndarray:
    if obj.device.type != "cpu":
        raise TypeError(f"{name}: a torch tensor of pointers or sizes must be on the CPU, "
                        f"got one on {obj.device}")
    return obj.detach().contiguous().numpy()


def _from_sequence(obj: Any, name: str) -> np.ndarray:
    for index, item in enumerate(obj):
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)):
            raise TypeError(f"{name}[{index}] is {type(item).__name__} ({item!r}); "
                            "pointers and sizes must be integers")
        if not (-(2**63) <= int(item) <= _U64_MAX):
            raise ValueError(f"{name}[{index}] = {item} does not fit in 64 bits")
    if any(int(item) > 2**63 - 1 for item in obj):
        return np.array([int(item) for item in obj], dtype=np.uint64)
    return np.asarray(obj, dtype=np.int64)


_U64 = np.dtype(np.uint64)


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
    module = type(obj).__module__ or ""
    if module.startswith("torch"):
        arr = _from_torch(obj, name)
    elif isinstance(obj, np.ndarray):
        arr = obj
    elif isinstance(obj, (list, tuple)):
        arr = _from_sequence(obj, name)
    else:
        try:
            arr = np.asarray(memoryview(obj))
        except TypeError:
            arr = np.asarray(obj)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer dtype, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {tuple(arr.shape)}")
    if arr.dtype.kind == "i" and arr.size and arr.min() < 0:
        index = int(np.argmax(arr < 0))
        raise ValueError(f"{name}[{index}] = {int(arr[index])} is negative")
    return np.ascontiguousarray(arr, dtype=np.uint64)
