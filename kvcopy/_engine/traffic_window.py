"""When each device last copied each way between host and GPU memory.

A serving engine stores evicted blocks and loads prefix hits in the same step, each
as a copy_batch call on a stream of its own. copy_both_ways sees both sides and
sends blocks of 128 KiB and more to the copy engines, which move both directions at
the link's limit; two copy_batch calls each see one side and would give both to the
copy kernel, whose reads of host memory share the link badly with the other
direction's writes. So copy_batch and swap_blocks note here when each direction last
issued a copy, and a batch whose other direction issued one within
config.traffic_window_ms is decided as one side of a copy both ways
(policy.choose_method). A copy the other way on the same stream does not count: a
stream runs its copies one after another, never both at once. Nor does one of less
than a quarter of the batch's bytes (policy.OTHER_WAY_MIN_SHARE). Times, byte counts and
stream handles only: no driver call, nothing on any stream.
"""

from __future__ import annotations

import time

from kvcopy import policy

_OTHER = {"h2d": "d2h", "d2h": "h2d"}
# The per-thread default stream (0x2) is a different stream in each thread, and the
# legacy one (0, 0x1) never runs batched DMA; only other handles name one stream.
_SHARED_HANDLES = (0, 1, 2)
# (device, direction) -> (_clock(), stream handle, bytes) of the last batch noted
_last: dict[tuple[int, str], tuple[float, int, int]] = {}
_clock = time.monotonic


def note(device: int, direction: str, stream: int = 0, nbytes: int = 0) -> None:
    """Record that ``device`` issued a batch of ``nbytes`` in ``direction`` on
    ``stream`` (a handle) now; directions other than 'h2d' and 'd2h' are ignored."""
    if direction in _OTHER:
        _last[(device, direction)] = (_clock(), stream, nbytes)


def other_way_recent(device: int, direction: str, window_s: float, stream: int = 0, nbytes: int = 0) -> bool:
    """Whether ``device`` issued a batch the other way from ``direction`` ('h2d' or
    'd2h') within the last ``window_s`` seconds, on a stream other than ``stream``,
    of at least policy.OTHER_WAY_MIN_SHARE of ``nbytes`` (this batch's bytes); False for
    other directions."""
    other = _OTHER.get(direction)
    if other is None or window_s <= 0:
        return False
    last = _last.get((device, other))
    if last is None:
        return False
    when, on, other_bytes = last
    if on == stream and stream not in _SHARED_HANDLES:
        return False  # queued behind it on the same stream: not both at once
    if other_bytes < policy.OTHER_WAY_MIN_SHARE * nbytes:
        return False  # over long before this batch is
    return _clock() - when < window_s


def idle_s(device: int) -> float:
    """Seconds since ``device`` last issued a batch between host and GPU (either
    way); infinity where it has issued none."""
    times = [noted[0] for (on, _), noted in list(_last.items()) if on == device]
    return _clock() - max(times) if times else float("inf")


def forget() -> None:
    """Drop every record (tests; a process that changes its pattern of work)."""
    _last.clear()
