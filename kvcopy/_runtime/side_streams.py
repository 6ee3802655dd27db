"""Streams of kvcopy's own beside each caller's stream, for work that runs apart from
the caller's stream and joins it again (copy_both_ways' second side, staged copies'
copy-engine work)."""

from __future__ import annotations

import threading

from kvcopy._cuda import driver
from kvcopy._runtime.context import PerContext
from kvcopy.policy import MAX_SIDE_STREAMS


class SideStreams:
    """kvcopy's side streams for each stream it is called on, in one context: up to a
    few per caller (``index``: which of them). With side streams shared by all
    callers, a caller on one stream (one thread of an engine) would wait for the
    side work of callers on other streams. Created on first use and never
    destroyed; past MAX_SIDE_STREAMS, a caller shares one, chosen by its handle."""

    def __init__(self) -> None:
        self._by_caller: dict[tuple[int, int], int] = {}
        self._created: list[int] = []
        self._lock = threading.Lock()

    def for_caller(self, handle: int, index: int = 0) -> int:
        key = (handle, index)
        side = self._by_caller.get(key)  # entries are only ever added
        if side is not None:
            return side
        with self._lock:
            side = self._by_caller.get(key)
            if side is None:
                if len(self._created) < MAX_SIDE_STREAMS:
                    side = driver.stream_create(non_blocking=True)
                    self._created.append(side)
                    self._by_caller[key] = side
                else:  # handles are aligned pointers: hash them, not their low bits;
                    # a caller's shared side streams are distinct from each other, so
                    # its staged copies and kernels still overlap
                    side = self._created[(hash((handle,)) + index) % MAX_SIDE_STREAMS]
            return side


_side_streams = PerContext(SideStreams)


def for_caller(handle: int, index: int = 0) -> int:
    """Side stream ``index`` of the caller's stream ``handle`` in the current context."""
    return _side_streams.current().for_caller(handle, index)
