"""Pinned host memory: new buffers, and page-locking of memory that exists already."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from kvcopy._cuda import memory
from kvcopy.arguments import require_int
from kvcopy._runtime import kept_memory
from kvcopy._runtime.context import ContextScope
from kvcopy.errors import KVCopyError

DEFAULT_CHUNK_BYTES = 16 << 30
MAX_PINNED_BYTES = 2**63 - 1


def _free_pinned(ptr: int) -> None:
    try:
        with ContextScope():
            memory.host_free(ptr)
    except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
        pass


class _PinnedAllocation(kept_memory.HeldMemory):
    """Owns one cuMemHostAlloc block; NumPy arrays over it keep it alive via .base."""

    __slots__ = ("ptr", "device_ptr", "nbytes", "__array_interface__")

    def __init__(self, nbytes: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
        with ContextScope():
            self.ptr = memory.host_alloc(max(nbytes, 1))
            self.device_ptr = memory.host_device_pointer(self.ptr)
        super().__init__(self.ptr, nbytes)
        self.nbytes = nbytes
        self.__array_interface__ = {
            "shape": shape,
            "typestr": dtype.str,
            "data": (self.ptr, False),
            "version": 3,
        }
        if dtype.fields is not None:  # structured: typestr alone would say raw void
            self.__array_interface__["descr"] = dtype.descr
        weakref.finalize(self, _free_pinned, self.ptr)


def pinned_empty(shape: int | tuple[int, ...], dtype: Any = np.uint8) -> np.ndarray:
    """A new NumPy array in pinned, device-mapped host memory, freed with its last view.

    The device pointer of the memory is ``kvcopy.device_pointer(array)`` (equal
    to the host pointer on systems with unified addressing). A sub-array dtype
    gives what ``numpy.empty`` gives: its dimensions join the shape and its base
    type is the dtype.
    """
    shape = _shape_tuple(shape)
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"pinned_empty: dtype {dtype} holds Python objects")
    if dtype.subdtype is not None:
        dtype, inner = dtype.subdtype
        shape = shape + tuple(inner)
    nbytes = dtype.itemsize
    for extent in shape:
        nbytes *= extent
    if nbytes > MAX_PINNED_BYTES:
        raise ValueError(
            f"pinned_empty: shape {shape} of {dtype} needs {nbytes} bytes, more than "
            f"the {MAX_PINNED_BYTES} one allocation can hold"
        )
    return np.asarray(_PinnedAllocation(nbytes, shape, dtype))


def _shape_tuple(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints: an int, or a sequence of ints."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
        items: tuple = (shape,)
    elif isinstance(shape, (tuple, list)):
        items = tuple(shape)
    else:
        raise TypeError(
            f"pinned_empty: shape must be an int or a tuple of ints, got {type(shape).__name__} ({shape!r})"
        )
    out = tuple(require_int(extent, f"pinned_empty: shape[{i}]") for i, extent in enumerate(items))
    if any(extent < 0 for extent in out):
        raise ValueError(f"pinned_empty: negative dimension in shape {out}")
    return out


def _host_range(obj: Any, caller: str = "register") -> tuple[int, int, bool]:
    """(pointer, nbytes, readonly) of a C-contiguous host buffer; errors name ``caller``."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"{caller}: the array must be C-contiguous")
        return obj.ctypes.data, obj.nbytes, not obj.flags.writeable
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{caller}: {type(obj).__name__} does not expose a buffer "
            "(NumPy arrays, mmap, bytearray and shared memory do)"
        ) from None
    if not view.c_contiguous:
        raise ValueError(f"{caller}: the buffer must be C-contiguous")
    arr = np.frombuffer(view.cast("B"), dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
    return (arr.ctypes.data if view.nbytes else 0), view.nbytes, view.readonly


def device_pointer(obj: Any) -> int:
    """The address the current device uses for pinned host memory ``obj`` (array or int).

    Raises:
        TypeError: ``obj`` is neither an int address nor a buffer.
        ValueError: an address that is not positive or wider than 64 bits, or an
            empty buffer.
        CudaError: the memory is not pinned host memory the driver knows.
    """
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, (bool, np.bool_)):
        ptr = int(obj)
        if not 0 < ptr < 2**64:
            raise ValueError(f"device_pointer: address must be positive and below 2**64, got {ptr}")
    else:
        ptr, nbytes, _ = _host_range(obj, "device_pointer")
        if nbytes == 0:
            raise ValueError("device_pointer: an empty buffer has no address")
    with ContextScope():
        return memory.host_device_pointer(ptr)


class register:
    """Page-lock existing host memory for the duration of a ``with`` block.

    The memory is registered in chunks of ``chunk_bytes`` (single registrations
    of hundreds of GiB fail), portable and mapped for every device. The copy
    kernel takes back-to-back chunks the device sees at one offset (as with
    unified addressing) as one range, and kvcopy joins them as a batch meets
    them; the driver's DMA engines refuse a copy across two registrations, so
    make ``chunk_bytes`` a multiple of your block size to keep every block in
    one chunk. Unregisters on exit or :meth:`close`.

    Attributes:
        ptr, nbytes: the registered range.
        device_ptr: the address the device uses for ``ptr``.
    """

    def __init__(self, obj: Any, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        chunk_bytes = require_int(chunk_bytes, "register: chunk_bytes", minimum=1)
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
                    memory.host_register(self.ptr + start, size, self.readonly)
                    self._chunks.append(self.ptr + start)
                self.device_ptr = memory.host_device_pointer(self.ptr)
            except KVCopyError:
                self.close()
                raise
        kept_memory.forget()  # (an array over this memory, kept as pageable, is pinned now)
        return self

    def close(self) -> None:
        if not self._chunks:
            return
        with ContextScope():
            while self._chunks:
                memory.host_unregister(self._chunks.pop())
        kept_memory.forget()  # (a tensor over this memory is pageable again)

    def __exit__(self, *exc: Any) -> None:
        self.close()
