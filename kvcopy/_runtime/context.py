"""Which CUDA context a call runs in, restored afterwards; and what kvcopy keeps one
of per context."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Generic, Iterator, TypeVar

from kvcopy._cuda import driver
from kvcopy.interop.streams import STREAM_LEGACY, STREAM_PER_THREAD

T = TypeVar("T")


@contextlib.contextmanager
def relaxed_capture() -> Iterator[None]:
    """The calling thread's stream-capture mode relaxed for the block, then its own
    again: for work kvcopy does beside the caller's (a pool's registrations, a
    calibration on a thread of its own), whose calls a CUDA graph another thread
    captures in the default (global) mode would forbid, and be invalidated by (as
    with kvcopy's frees: kvcopy._cuda.memory)."""
    previous = driver.exchange_capture_mode(driver.CAPTURE_MODE_RELAXED)
    try:
        yield
    finally:
        driver.exchange_capture_mode(previous)


@contextlib.contextmanager
def on_device(ordinal: int) -> Iterator[None]:
    """Device ``ordinal``'s primary context current for the block, the caller's back
    after it (the context torch and the default streams use on that device)."""
    driver.push_context(driver.primary_context(ordinal))
    try:
        yield
    finally:
        driver.pop_context()


class ContextScope:
    """Makes the context a copy must run in current, and restores the caller's after.

    A created stream runs in its own context. The default streams (legacy and
    per-thread) run where the batch's device memory lives: in the caller's
    current context when that is on the memory's device, else in the primary
    context of the memory's device (device 0 until the memory is known, and for
    batches with no device memory or with device memory of several devices).
    """

    def __init__(self, handle: int = STREAM_LEGACY) -> None:
        self.handle = handle
        self.pushed = False
        # only the default streams follow the batch's memory to its device
        self.on_default_stream = handle in (STREAM_LEGACY, STREAM_PER_THREAD)

    def __enter__(self) -> "ContextScope":
        driver.init()
        if not self.on_default_stream:
            ctx = driver.stream_context(self.handle)
            if ctx != driver.current_context():
                self._push(ctx)
        elif driver.current_context() == 0:
            self._push(driver.primary_context(0))
        return self

    def _push(self, ctx: int) -> None:
        driver.push_context(ctx)
        self.pushed = True

    def follow_memory(self, ordinal: int) -> bool:
        """On a default stream, move to device ``ordinal`` if the current context is
        elsewhere. Returns True when it switched context."""
        if not self.on_default_stream or ordinal < 0:
            return False
        if driver.context_device() == ordinal:
            return False
        if self.pushed:
            driver.pop_context()
            self.pushed = False
        self._push(driver.primary_context(ordinal))
        return True

    def __exit__(self, *exc: Any) -> None:
        if self.pushed:
            driver.pop_context()
            self.pushed = False


class PerContext(Generic[T]):
    """One ``create()`` per CUDA context, made on first use in that context and kept
    for the process (descriptor rings, kvcopy's side stream). A context destroyed
    and made again (a primary context reset) is a new one, even under its old
    handle: what was made for the old one went with it. Threads racing on a
    first use get the same one, and nothing is created twice (a duplicate would
    hold driver resources no one frees)."""

    def __init__(self, create: Callable[[], T]) -> None:
        self._create = create
        self._items: dict[int, T] = {}
        self._lock = threading.Lock()

    def current(self) -> T:
        """The one for the calling thread's current context."""
        ctx = driver.current_context_key()  # (not the handle: a reset reuses it)
        item = self._items.get(ctx)  # entries are only ever added: found without the lock
        if item is None:
            with self._lock:
                item = self._items.get(ctx)
                if item is None:
                    item = self._items[ctx] = self._create()
        return item
