"""CUDA IPC stood in for by host memory, for kvcopy.nixl.same_host on a CPU.

``HostIpc`` answers what the same-host leg asks of kvcopy._cuda.driver and
kvcopy._cuda.ipc (installed with ``testing.fake_cuda(fake, ("driver", "ipc"))``):
its "device memory" is the allocations it was given (``allocate``: a named
``multiprocessing.shared_memory`` segment, so that another process can map it), a
handle names the segment, opening one maps the segment into the opening process,
and events are counters. Every call is logged in ``calls``.
"""

from __future__ import annotations

import itertools
from multiprocessing import shared_memory

import numpy as np

HANDLE_BYTES = 64
# Segments are never closed while a test may hold a view of them (closing one with a
# view alive raises): unlinked when released, kept here until the process exits.
_KEPT: list[shared_memory.SharedMemory] = []


class HostIpc:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        # base -> (segment, view)
        self.segments: dict[int, tuple[shared_memory.SharedMemory, np.ndarray]] = {}
        self.refuse_handles = False
        self.fail_open_after: int | None = None
        self._events = itertools.count(100)
        self._opened = 0

    # ---------------------------------------------------------------- memory

    def allocate(self, nbytes: int) -> np.ndarray:
        """A fresh segment of ``nbytes`` zeros, as "device memory" of device 0."""
        segment = shared_memory.SharedMemory(create=True, size=nbytes)
        view = np.frombuffer(segment.buf, np.uint8, nbytes)
        view[:] = 0
        self.segments[view.ctypes.data] = (segment, view)
        return view

    def release(self) -> None:
        """Unlink every segment this process made (mapped ones stay until exit where a
        view of them is still held)."""
        segments = [segment for segment, _ in self.segments.values()]
        self.segments.clear()
        for segment in segments:
            _KEPT.append(segment)
            try:
                segment.unlink()
            except FileNotFoundError:
                pass  # (another process's, or unlinked already)

    def _segment_of(self, ptr: int) -> tuple[int, int] | None:
        for base, (_, view) in self.segments.items():
            if base <= ptr < base + view.nbytes:
                return base, view.nbytes
        return None

    # ---------------------------------------------------------------- kvcopy._cuda.driver

    def init(self) -> None:
        pass

    def primary_context(self, ordinal: int) -> int:
        return 0x1000 + ordinal

    def push_context(self, ctx: int) -> None:
        self.calls.append(("push_context", ctx))

    def pop_context(self) -> None:
        self.calls.append(("pop_context",))

    def event_record(self, event: int, stream: int) -> None:
        self.calls.append(("event_record", event, stream))

    def event_destroy(self, event: int) -> None:
        self.calls.append(("event_destroy", event))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self.calls.append(("stream_wait_event", stream, event))

    def stream_synchronize(self, stream: int) -> None:
        self.calls.append(("stream_synchronize", stream))

    # ---------------------------------------------------------------- kvcopy._cuda.ipc

    def device_ordinal(self, ptr: int) -> int:
        return 0 if self._segment_of(ptr) else -1

    def allocation_of(self, ptr: int) -> tuple[int, int]:
        found = self._segment_of(ptr)
        assert found is not None, "allocation_of: not an allocation"
        return found

    def mem_handle(self, base: int) -> bytes:
        if self.refuse_handles:
            raise RuntimeError("CUDA_ERROR_INVALID_VALUE")
        name = self.segments[base][0].name.encode()
        return name.ljust(HANDLE_BYTES, b"\0")

    def open_mem_handle(self, handle: bytes) -> int:
        if self.fail_open_after is not None and self._opened >= self.fail_open_after:
            raise RuntimeError("CUDA_ERROR_MAP_FAILED")
        self._opened += 1
        segment = shared_memory.SharedMemory(name=handle.rstrip(b"\0").decode())
        view = np.frombuffer(segment.buf, np.uint8)
        self.segments[view.ctypes.data] = (segment, view)
        self.calls.append(("open_mem_handle", view.ctypes.data))
        return view.ctypes.data

    def close_mem_handle(self, ptr: int) -> None:
        self.calls.append(("close_mem_handle", ptr))
        _KEPT.append(self.segments.pop(ptr)[0])

    def event_create_shared(self) -> int:
        return next(self._events)

    def event_handle(self, event: int) -> bytes:
        return f"event {event}".encode().ljust(HANDLE_BYTES, b"\0")

    def open_event_handle(self, handle: bytes) -> int:
        return 200 + int(handle.rstrip(b"\0").split()[1])

    def pci_bus_id(self, ordinal: int) -> str:
        return f"0000:00:0{ordinal}.0"

    def device_of_bus_id(self, bus_id: str) -> int:
        if not bus_id.startswith("0000:00:0"):
            raise RuntimeError("CUDA_ERROR_INVALID_DEVICE")
        return int(bus_id[9])
