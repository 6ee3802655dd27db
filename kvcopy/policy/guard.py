"""The guard on 'auto': what sampled batches show of a path, against what calibration
measured for it, and where a path far below it is left for the other method.

Pure: the engine (kvcopy._engine.guard) times batches with events and keeps the
watches; everything that decides lives here, tested with made-up rates. A path is a
direction, a method ('kernel' or 'batch') and a class of block size (powers of two of
the mean block). A path slow in GUARD_SLOW_SAMPLES samples in a row is avoided for a
hold that doubles at each move (hysteresis: a host that changes under load does not
keep a wrong choice, and a passing dip does not flip it back and forth), and only
where calibration measured the other method faster than what the slow path gave.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping

from kvcopy.errors import KVCopyError
from kvcopy.policy import CopyRequest, DeviceCaps, Decision, Thresholds, choose_method
from kvcopy.policy.defaults import (
    GUARD_GAIN,
    GUARD_HOLD_S,
    GUARD_MAX_HOLD_S,
    GUARD_MIN_BYTES,
    GUARD_SLOW_SAMPLES,
    GUARD_SLOW_SHARE,
)

METHODS = ("kernel", "batch")
Path = tuple[str, str, int]  # (direction, method, size class)


@dataclass(frozen=True)
class Watch:
    """What the samples of one path showed: ``slow`` samples in a row, the last rate
    and what calibration expected (GB/s), and until when (monotonic seconds) the path
    is avoided after its ``moves``-th move."""

    slow: int = 0
    rate: float = 0.0
    expected: float = 0.0
    avoid_until: float = 0.0
    moves: int = 0


def size_class(mean_bytes: float) -> int:
    """The class of a batch's mean block size: its power of two, rounded down."""
    return int(math.log2(mean_bytes)) if mean_bytes >= 1 else 0


def path_of(req: CopyRequest, method: str) -> Path:
    return (req.direction, method, size_class(req.mean_bytes))


def expected_gbps(thresholds: Thresholds, req: CopyRequest, method: str) -> float | None:
    """What calibration measured for ``method`` in ``req``'s direction at the measured
    block size nearest its mean block (by ratio), or None where it measured none."""
    sizes = thresholds.rates.get(req.direction, {})
    measured = [(block, gbps[method]) for block, gbps in sizes.items() if method in gbps]
    if not measured or req.mean_bytes <= 0:
        return None
    block, rate = min(measured, key=lambda entry: abs(math.log2(entry[0] / req.mean_bytes)))
    return rate


def worth_sampling(req: CopyRequest, decision: Decision, requested: str) -> bool:
    """Whether a batch may be timed for the guard: 'auto' asked, a method the guard
    watches, at least GUARD_MIN_BYTES (smaller batches are mostly launch and wait),
    between host and GPU, outside capture."""
    return (
        requested == "auto"
        and decision.method in METHODS
        and req.total_bytes >= GUARD_MIN_BYTES
        and req.direction in ("h2d", "d2h")
        and not req.capturing
    )


def observe(watch: Watch, rate: float, expected: float, now: float) -> Watch:
    """The watch after a sample of ``rate`` GB/s where ``expected`` was measured: a
    slow one counts towards a move, a good one clears the count. The move itself is
    steer()'s (it knows whether the other method would do better)."""
    slow = watch.slow + 1 if rate < GUARD_SLOW_SHARE * expected else 0
    return replace(watch, slow=slow, rate=rate, expected=expected)


def hold_s(moves: int) -> float:
    """How long a path is avoided at its ``moves``-th move (from 1)."""
    return min(GUARD_MAX_HOLD_S, GUARD_HOLD_S * 2 ** max(moves - 1, 0))


def steer(
    req: CopyRequest,
    decision: Decision,
    caps: DeviceCaps,
    thresholds: Thresholds,
    watches: Mapping[Path, Watch],
    now: float,
) -> tuple[Decision, Watch | None]:
    """The decision for ``req`` once the watches are heard: ``decision`` (the policy's)
    where its path is not avoided, else the other method's with the reason. Also the
    watch of the path that is to be avoided from now (its move), or None.

    A path slow GUARD_SLOW_SAMPLES times in a row moves to the other method where
    calibration measured that one above GUARD_GAIN times the slow rate and the
    request allows it; it is avoided for hold_s(moves), then tried again."""
    if decision.method not in METHODS:
        return decision, None
    watch = watches.get(path_of(req, decision.method))
    if watch is None:
        return decision, None
    other = METHODS[1 - METHODS.index(decision.method)]
    try:
        instead = choose_method(req, caps, thresholds, other)
    except (KVCopyError, ValueError):  # (the request rules the other method out)
        return decision, None
    if instead.method != other:  # (asked for, it would fall back to another)
        return decision, None
    moved: Watch | None = None
    if now >= watch.avoid_until:
        if watch.slow < GUARD_SLOW_SAMPLES:
            return decision, None
        better = expected_gbps(thresholds, req, other)
        if better is None or better < GUARD_GAIN * watch.rate:
            return decision, None
        moves = watch.moves + 1
        moved = watch = replace(watch, slow=0, avoid_until=now + hold_s(moves), moves=moves)
    reason = (
        f"guard: {decision.method} moved {watch.rate:.1f} GB/s here, "
        f"{watch.rate / watch.expected:.0%} of the {watch.expected:.1f} GB/s calibration "
        f"measured; {other} for {max(watch.avoid_until - now, 0.0):.0f} s, then {decision.method} "
        "is tried again"
    )
    return Decision(instead.method, reason, instead.variant), moved
