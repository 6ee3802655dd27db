"""When each device last copied each way between host and GPU memory.

A serving engine stores evicted blocks and loads prefix hits in the same step, each
as a copy_batch call on a stream of its own. copy_both_ways sees both sides and
sends blocks of 128 KiB and more to the copy engines, which move both directions at
the link's limit; two copy_batch calls each see one side and give both to the copy
kernel, whose reads of host memory share the link badly with the other direction's
writes. H200, 128 and 256 KiB blocks, the benchmark's 'bidirectional' scenario in
the four quick runs of 1 December (bench/results/h200-quick-pipelined-staging,
-descs-b, -memcpy-each and -staging-8mib .json): the kernel both ways 0.59-0.67 of
the contiguous pair in GPU time and 0.60-0.63 in wall; batched DMA on the same two
streams 0.87-1.02 and 0.59-0.87. So copy_batch and swap_blocks note here when
each direction last issued a copy, and a batch whose other direction issued one
within config.traffic_window_ms is decided as one side of a copy both ways
(policy.choose_method). Times only: no driver call, nothing on any stream.
"""
from __future__ import annotations

import time

_OTHER = {"h2d": "d2h", "d2h": "h2d"}
_last: dict[tuple[int, str], float] = {}   # (device, direction) -> _clock()
_clock = time.monotonic


def note(device: int, direction: str) -> None:
    """Record that ``device`` issued a copy in ``direction`` now (others are ignored)."""
    if direction in _OTHER:
        _last[(device, direction)] = _clock()


def other_way_recent(device: int, direction: str, window_s: float) -> bool:
    """Whether ``device`` issued a copy the other way from ``direction`` ('h2d' or
    'd2h') within the last ``window_s`` seconds; False for other directions."""
    other = _OTHER.get(direction)
    if other is None or window_s <= 0:
        return False
    last = _last.get((device, other))
    return last is not None and _clock() - last < window_s


def forget() -> None:
    """Drop every record (tests; a process that changes its pattern of work)."""
    _last.clear()
