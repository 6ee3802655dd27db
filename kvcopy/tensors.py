"""Tensors and arrays of any framework -> where their blocks are in memory.

Dimension 0 indexes blocks; every block (dimensions 1 and up) must be
contiguous. Reads torch, NumPy and CuPy attributes directly (cheap), any
``__cuda_array_interface__``/``__array_interface__`` dict, and everything else
(JAX, DLPack producers) through cuda.core's StridedMemoryView.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


class BlockLayout(NamedTuple):
    """Where a tensor's blocks are (a NamedTuple: built on every call, so cheap)."""

    ptr: int
    num_blocks: int
    block_stride: int   # bytes from one block to the next
    block_bytes: int
    readonly: bool


def _raw(obj: Any, name: str) -> tuple[int, tuple, tuple, int, bool]:
    """(pointer, shape, byte strides, itemsize, readonly)."""
    module = type(obj).__module__ or ""
    if module.startswith("torch"):
        size = obj.element_size()
        return obj.data_ptr(), tuple(obj.shape), tuple(s * size for s in obj.stride()), size, False
    if isinstance(obj, np.ndarray):
        return obj.ctypes.data, obj.shape, obj.strides, obj.itemsize, not obj.flags.writeable
    if module.startswith("cupy"):
        return obj.data.ptr, obj.shape, obj.strides, obj.itemsize, False
    for attr in ("__cuda_array_interface__", "__array_interface__"):
        face = getattr(obj, attr, None)
        if isinstance(face, dict):
            itemsize = np.dtype(face["typestr"]).itemsize
            shape = tuple(face["shape"])
            strides = face.get("strides") or _c_strides(shape, itemsize)
            ptr, readonly = face["data"]
            return int(ptr), shape, tuple(strides), itemsize, bool(readonly)
    try:
        from cuda.core.utils import StridedMemoryView

        view = StridedMemoryView(obj, stream_ptr=-1)
    except Exception:  # noqa: BLE001 - anything that is not an array
        raise TypeError(f"{name}: {type(obj).__module__}.{type(obj).__qualname__} is not a tensor "
                        "or array kvcopy can read (torch, NumPy, CuPy, JAX, DLPack, array "
                        "interface)") from None
    itemsize = np.dtype(view.dtype).itemsize
    strides = (tuple(s * itemsize for s in view.strides) if view.strides is not None
               else _c_strides(tuple(view.shape), itemsize))
    return int(view.ptr), tuple(view.shape), strides, itemsize, bool(view.readonly)


def _prod(extents) -> int:
    out = 1
    for e in extents:
        out *= e
    return out


def _c_strides(shape: tuple, itemsize: int) -> tuple:
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def _torch_layout(t: Any) -> BlockLayout | None:
    """Fast path for torch tensors whose blocks are contiguous (the usual case)."""
    shape = t.shape
    if not shape:
        return None
    if t.is_contiguous():
        size = t.element_size()
        block = size * (t.numel() // shape[0] if shape[0] else _prod(shape[1:]))
        return BlockLayout(t.data_ptr(), shape[0], block, block, False)
    strides = t.stride()
    step = 1
    for k in range(len(shape) - 1, 0, -1):
        if shape[k] != 1 and strides[k] != step:
            return None
        step *= shape[k]
    size = t.element_size()
    if shape[0] > 1 and strides[0] < step:
        return None
    return BlockLayout(t.data_ptr(), shape[0], strides[0] * size, step * size, False)


def block_layout(obj: Any, name: str) -> BlockLayout:
    """Where ``obj``'s blocks are. Raises TypeError/ValueError naming ``name``."""
    if (type(obj).__module__ or "").startswith("torch"):
        fast = _torch_layout(obj)
        if fast is not None:
            return fast
    ptr, shape, strides, itemsize, readonly = _raw(obj, name)
    if len(shape) == 0:
        raise ValueError(f"{name}: a 0-d array has no block dimension")
    expected = itemsize
    for extent, stride in zip(reversed(shape[1:]), reversed(strides[1:])):
        if extent != 1 and stride != expected:
            raise ValueError(f"{name}: each block (dimensions 1 and up) must be contiguous in "
                             f"memory; shape {tuple(shape)} has strides {tuple(strides)} bytes")
        expected *= extent
    if shape[0] > 1 and strides[0] < expected:
        raise ValueError(f"{name}: blocks overlap or run backwards (stride {strides[0]} bytes "
                         f"for blocks of {expected} bytes)")
    return BlockLayout(ptr, int(shape[0]), int(strides[0]), int(expected), readonly)
