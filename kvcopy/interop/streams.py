"""Anything that names a CUDA stream -> the raw CUstream handle as an int.

Handle values with special meaning in the driver API:
0 is the default stream (legacy, or per-thread when cuda-python runs with
CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1), 1 is CU_STREAM_LEGACY and 2 is
CU_STREAM_PER_THREAD.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from kvcopy.config import per_thread_default_stream
from kvcopy.interop.frameworks import framework_of, type_name
from kvcopy.interop.protocols import cuda_stream_handle

STREAM_DEFAULT = 0
STREAM_LEGACY = 1
STREAM_PER_THREAD = 2
_MAX_HANDLE = 2**64 - 1
# Other handles are addresses of the driver's objects, never inside the first page,
# which no OS maps. A small int is a mistake (torch's stream_id, a device index) that
# the driver would dereference and crash on: refused instead.
_MIN_ADDRESS = 4096


def _from_cuda_stream_protocol(obj: Any) -> int:
    attr = obj.__cuda_stream__
    value = attr() if callable(attr) else attr
    return _from_int(cuda_stream_handle(value, type(obj).__name__), obj)


def interface_stream(value: Any, where: str) -> int:
    """The stream a __cuda_array_interface__ (v3) names for its pending writes, by the
    rules of resolve_stream. The protocol forbids 0; producers that send it mean the
    legacy default stream, and get it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where} has stream {value!r}; expected an int handle")
    try:
        return _from_int(value, value) or STREAM_LEGACY
    except ValueError as exc:
        raise ValueError(f"{where}: {str(exc).removeprefix('stream: ')}") from None


def _from_int(value: Any, origin: Any, what: str = "stream") -> int:
    """A handle given as a Python or NumPy integer (never a float or bool: a
    truncated handle would name some other stream)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{what}: {type(origin).__name__} gave a handle of type {type(value).__name__}, expected an int"
        )
    value = int(value)
    if value < 0 or value > _MAX_HANDLE:
        raise ValueError(f"{what}: handle {value} is not a valid CU{what} value")
    # (a stream's 0-2 are the default streams; an event's 0 is one not created yet)
    if (STREAM_PER_THREAD if what == "stream" else 0) < value < _MIN_ADDRESS:
        special = "0 (default), 1 (legacy), 2 (per-thread) or " if what == "stream" else ""
        raise ValueError(
            f"{what}: handle {value} is not a valid CU{what} value: handles are {special}"
            f"the address of a CU{what}, never below {_MIN_ADDRESS} (a torch stream's "
            "stream_id or a device index is not a handle; pass the stream or event "
            "object itself)"
        )
    return value


def _framework_default(handle: int) -> int:
    """torch and CuPy mean the legacy default stream by handle 0."""
    return STREAM_LEGACY if handle == STREAM_DEFAULT else handle


def resolve_stream(obj: Any) -> int:
    """Return the raw CUstream handle that ``obj`` names.

    Accepts None (the default stream, 0), ints (0, 1 = cudaStreamLegacy,
    2 = cudaStreamPerThread, or any handle), torch.cuda.Stream and
    ExternalStream, CuPy streams, cuda.core Streams, cuda.bindings CUstream and
    any object with ``__cuda_stream__``. torch's and CuPy's default streams
    resolve to 1 (legacy), which is what their handle 0 means.

    Raises:
        TypeError: ``obj`` names no stream kvcopy knows.
        ValueError: the handle is negative, wider than 64 bits, or 3-4095 (no
            stream lives in the first page: a small int is an id or an index).
    """
    if type(obj) is int and (_MIN_ADDRESS <= obj <= _MAX_HANDLE or 0 <= obj <= STREAM_PER_THREAD):
        return obj  # a raw handle, the common case of engines' hot loops: kept cheap
    if obj is None:
        return STREAM_DEFAULT
    if isinstance(obj, (bool, np.bool_)):
        raise TypeError("stream: got a bool; pass a stream object or an integer handle")
    if isinstance(obj, (int, np.integer)):
        return _from_int(obj, obj)
    framework = framework_of(obj)
    if framework == "torch" and hasattr(obj, "cuda_stream"):
        return _framework_default(_from_int(obj.cuda_stream, obj))
    if framework == "cupy" and hasattr(obj, "ptr"):
        return _framework_default(_from_int(obj.ptr, obj))
    if hasattr(obj, "__cuda_stream__"):
        return _from_cuda_stream_protocol(obj)
    if framework == "cuda.bindings" and hasattr(obj, "getPtr"):
        if type(obj).__name__ != "CUstream":
            raise TypeError(f"stream: got a cuda.bindings {type(obj).__name__}, expected a CUstream")
        return _from_int(int(obj), obj)
    raise TypeError(
        f"stream: cannot get a CUDA stream from {type_name(obj)}; "
        "pass None, an int handle, a torch/CuPy/cuda.core stream, a CUstream, or an object "
        "with __cuda_stream__"
    )


def current_framework_streams(*objs: Any) -> list[tuple[int, int]]:
    """(handle, device) of the current stream of each device whose memory the
    framework's arrays hold, the first array's device first; [(0, -1)] when no
    framework says (device -1: the current context's).

    torch gives torch.cuda.current_stream() of each CUDA tensor's device (the
    current device's when every tensor is on the CPU); CuPy gives
    cupy.cuda.get_current_stream().
    """
    torch_without_cuda = False
    for obj in objs:
        framework = framework_of(obj)
        if framework == "torch" and not torch_without_cuda:  # (torch is imported already)
            torch = sys.modules["torch"]
            # (once torch has initialised CUDA it has it: is_available() asks the driver)
            if not (torch.cuda.is_initialized() or torch.cuda.is_available()):
                torch_without_cuda = True
                continue
            # (get_device(): the ordinal, -1 off the GPU, without a torch.device made)
            devices = [
                o.get_device() for o in objs if framework_of(o) == "torch" and getattr(o, "is_cuda", False)
            ]
            if not devices:
                devices = [torch.cuda.current_device()]
            ordered = list(dict.fromkeys(devices))
            return [(_framework_default(_torch_current_stream(torch, d)), d) for d in ordered]
        if framework == "cupy":
            return [(_framework_default(sys.modules["cupy"].cuda.get_current_stream().ptr), -1)]
    return [(STREAM_DEFAULT, -1)]


def _torch_current_stream(torch: Any, device: int) -> int:
    """torch's current stream of ``device`` as a raw handle (0: its default stream).
    Once torch has initialised CUDA, read as the handle itself: torch.cuda.
    current_stream() builds a Stream object at every call, which the steady call of a
    drop-in (one per layer and step) would pay for nothing."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None and torch.cuda.is_initialized():
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


def torch_current_handle() -> int:
    """torch's current stream of its current device as a raw handle (its default stream:
    the legacy one), read without a Stream object once torch has CUDA. Raises as
    torch.cuda.current_device() does where torch has no CUDA."""
    torch = sys.modules["torch"]
    return _framework_default(_torch_current_stream(torch, torch.cuda.current_device()))


def current_framework_stream(*objs: Any) -> int:
    """The current stream of the framework whose arrays were passed, else 0: for
    torch, that of the first CUDA tensor's device (see current_framework_streams)."""
    return current_framework_streams(*objs)[0][0]


def effective_handle(handle: int) -> int:
    """Replace handle 0 by the explicit stream it means in this process."""
    if handle != STREAM_DEFAULT:
        return handle
    return STREAM_PER_THREAD if per_thread_default_stream() else STREAM_LEGACY


def stream_kind(handle: int) -> str:
    """'legacy', 'per_thread' or 'created' for an effective (non-zero) handle."""
    if handle == STREAM_LEGACY:
        return "legacy"
    if handle == STREAM_PER_THREAD:
        return "per_thread"
    return "created"


def resolve_event(obj: Any) -> int | None:
    """The raw CUevent handle that ``obj`` names, or None when it is no event.

    Accepts torch.cuda.Event, CuPy events, cuda.core Events and cuda.bindings
    CUevent objects. Integers are stream handles, never events.

    Raises:
        TypeError: an event object that gives no integer handle.
    """
    framework, name = framework_of(obj), type(obj).__name__
    if framework == "torch" and hasattr(obj, "cuda_event"):
        return _from_int(obj.cuda_event, obj, "event")
    if framework == "cupy" and name == "Event" and hasattr(obj, "ptr"):
        return _from_int(obj.ptr, obj, "event")
    if framework == "cuda.core" and name == "Event" and hasattr(obj, "handle"):
        return _from_int(int(obj.handle), obj, "event")
    if framework == "cuda.bindings" and name == "CUevent":
        return _from_int(int(obj), obj, "event")
    return None
