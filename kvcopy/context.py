"""Which CUDA context a call runs in, restored afterwards."""
from __future__ import annotations

from typing import Any

from kvcopy import _driver
from kvcopy.streams import STREAM_LEGACY, STREAM_PER_THREAD


class ContextScope:
    """Makes the context a copy must run in current, and restores the caller's after.

    A created stream runs in its own context. The default streams run in the
    caller's current context, or, when the thread has none, in the primary
    context of the device that owns the batch's device memory (device 0 until
    that is known).
    """

    def __init__(self, handle: int = STREAM_LEGACY) -> None:
        self.handle = handle
        self.pushed = False

    def __enter__(self) -> "ContextScope":
        _driver.init()
        if self.handle not in (STREAM_LEGACY, STREAM_PER_THREAD):
            ctx = _driver.stream_context(self.handle)
            if ctx != _driver.current_context():
                self._push(ctx)
        elif _driver.current_context() == 0:
            self._push(_driver.primary_context(0))
        return self

    def _push(self, ctx: int) -> None:
        _driver.push_context(ctx)
        self.pushed = True

    def follow_memory(self, ordinal: int) -> None:
        """On a default stream with no caller context, use the memory's device."""
        if self.pushed and self.handle in (STREAM_LEGACY, STREAM_PER_THREAD) and ordinal >= 0:
            _driver.pop_context()
            _driver.push_context(_driver.primary_context(ordinal))

    def __exit__(self, *exc: Any) -> None:
        if self.pushed:
            _driver.pop_context()
            self.pushed = False
