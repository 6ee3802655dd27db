"""Pinned host memory: new buffers, and page-locking of memory that exists already."""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from kvcopy import _driver
from kvcopy.context import ContextScope
from kvcopy.errors import KVCopyError

DEFAULT_CHUNK_BYTES = 16 << 30


def _free_pinned(ptr: int) -> None:
    try:
        with ContextScope():
            _driver.host_free(ptr)
    except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
        pass


class _PinnedAllocation:
    """Owns one cuMemHostAlloc block; NumPy arrays over it keep it alive via .base."""

    def __init__(self, nbytes: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
        with ContextScope():
            self.ptr = _driver.host_alloc(max(nbytes, 1))
            self.device_ptr = _driver.host_device_pointer(self.ptr)
        self.nbytes = nbytes
        self.__array_interface__ = {"shape": shape, "typestr": dtype.str,
                                    "data": (self.ptr, False), "version": 3}
        weakref.finalize(self, _free_pinned, self.ptr)


def pinned_empty(shape: int | tuple[int, ...], dtype: Any = np.uint8) -> np.ndarray:
    """A new NumPy array in pinned, device-mapped host memory, freed with its last view.

    The device pointer of the memory is ``kvcopy.device_pointer(array)`` (equal
    to the host pointer on systems with unified addressing).
    """
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"pinned_empty: negative dimension in shape {shape}")
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"pinned_empty: dtype {dtype} holds Python objects")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return np.asarray(_PinnedAllocation(nbytes, shape, dtype))


def _host_range(obj: Any) -> tuple[int, int, bool]:
    """(pointer, nbytes, readonly) of a C-contiguous host buffer."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("register: the array must be C-contiguous")
        return obj.ctypes.data, obj.nbytes, not obj.flags.writeable
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"register: {type(obj).__name__} does not expose a buffer "
                        "(NumPy arrays, mmap, bytearray and shared memory do)") from None
    if not view.c_contiguous:
        raise ValueError("register: the buffer must be C-contiguous")
    arr = np.frombuffer(view.cast("B"), dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
    return (arr.ctypes.data if view.nbytes else 0), view.nbytes, view.readonly


def device_pointer(obj: Any) -> int:
    """The address the current device uses for pinned host memory ``obj`` (array or int)."""
    ptr = obj if isinstance(obj, int) else _host_range(obj)[0]
    with ContextScope():
        return _driver.host_device_pointer(ptr)


class register:
    """Page-lock existing host memory for the duration of a ``with`` block.

    The memory is registered in chunks of ``chunk_bytes`` (single registrations
    of hundreds of GiB fail), portable and mapped for every device. A copy
    that spans two chunks still works, by DMA instead of the copy kernel: make
    ``chunk_bytes`` a multiple of your block size to keep every block in one
    chunk. Unregisters on exit or :meth:`close`.

    Attributes:
        ptr, nbytes: the registered range.
        device_ptr: the address the device uses for ``ptr``.
    """

    def __init__(self, obj: Any, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"register: chunk_bytes must be a positive int, got {chunk_bytes!r}")
        self.obj = obj
        self.ptr, self.nbytes, self.readonly = _host_range(obj)
        if self.nbytes == 0:
            raise ValueError("register: the buffer is empty")
        self.chunk_bytes = chunk_bytes
        self.device_ptr = 0
        self._chunks: list[int] = []

    def __enter__(self) -> "register":
        with ContextScope():
            try:
                for start in range(0, self.nbytes, self.chunk_bytes):
                    size = min(self.chunk_bytes, self.nbytes - start)
                    _driver.host_register(self.ptr + start, size, self.readonly)
                    self._chunks.append(self.ptr + start)
                self.device_ptr = _driver.host_device_pointer(self.ptr)
            except KVCopyError:
                self.close()
                raise
        return self

    def close(self) -> None:
        if not self._chunks:
            return
        with ContextScope():
            while self._chunks:
                _driver.host_unregister(self._chunks.pop())

    def __exit__(self, *exc: Any) -> None:
        self.close()
