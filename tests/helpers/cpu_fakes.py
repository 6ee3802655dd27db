"""Fakes shared by the CPU tests that run kvcopy's issue paths with the driver faked
(through kvcopy.testing's seams: fake_cuda, fake_runtime)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from kvcopy import testing


class FakeScope:
    """A context scope that stays put: entering it changes no context, and the memory
    of a batch never asks for another device's context."""

    on_default_stream = False

    def __init__(self, handle: int = 0) -> None:
        self.handle = handle

    def __enter__(self) -> "FakeScope":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def follow_memory(self, ordinal: int) -> bool:
        return False


class FakeCaptureDriver:
    """The driver calls of deciding a batch: device 0's context, and a stream that is
    capturing when ``capturing`` is set."""

    capturing = 0

    def context_device(self) -> int:
        return 0

    def stream_capture_status(self, handle: int) -> int:
        return self.capturing

    def enter_for_repeat(self, handle: int, owner: int, key: int) -> int:
        """As the driver's: -1 where the current context's key (current_context_key,
        where this fake has one) is not ``key`` or the stream captures, else 0 (the
        current context serves: nothing pushed)."""
        current = self.current_context_key() if hasattr(self, "current_context_key") else key
        return 0 if current == key and self.stream_capture_status(handle) == 0 else -1


class FakeClassify:
    """kvcopy._cuda.classify as swap_blocks uses it (through kvcopy.testing.fake_cuda's
    "classify" layer): each tensor's base is the device's view of itself, and a plan's
    memory is the next of ``classes`` (MemoryClasses, or their 4 fields): its source
    side asked first, then its destination side. Everything else is the real module's."""

    def __init__(self, classes: Iterable[tuple[int, int, int, int]]) -> None:
        self._classes: Iterator[tuple[int, int, int, int]] = iter(classes)
        self._dst: tuple[int, int] | None = None

    def classify_pointers(self, ptrs, sizes, device_view) -> tuple[int, int]:
        device_view[:] = ptrs
        if self._dst is not None:
            side, self._dst = self._dst, None
            return side
        src_kinds, src_device, dst_kinds, dst_device = next(self._classes)
        self._dst = (dst_kinds, dst_device)
        return src_kinds, src_device

    def __getattr__(self, name: str) -> Any:
        return getattr(testing.cuda.classify, name)
