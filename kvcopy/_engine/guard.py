"""The guard on 'auto' at run time: sampled batches timed with two events, what they
show kept per device and path, and the policy's answer (kvcopy.policy.guard) applied
to each decision.

A batch is sampled only where decide() says so (config.guard, 'auto', large enough,
between host and GPU, outside capture, its method's rate calibrated, no other sample
of the device outstanding, GUARD_SAMPLE_EVERY_S since the last): the issue path
records a start event before it and an end event after it on the batch's stream. The
sample is read at a later decide() of the device, only once its end event has
completed (cuEventQuery: nothing waits), so a sample costs two event records and one
query. Its rate includes whatever shares the link or the SMs meanwhile: that is what
the guard is for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Protocol, TypeVar

from kvcopy._cuda import driver
from kvcopy._engine import replay
from kvcopy._runtime import device
from kvcopy.config import config
from kvcopy.errors import CudaError
from kvcopy.policy import guard as policy_guard
from kvcopy.policy.defaults import GUARD_SAMPLE_EVERY_S
from kvcopy.policy.guard import Path, Watch

_clock = time.monotonic


class Decided(replay.Decided, Protocol):
    """What the guard reads of decide.Target (a frozen dataclass)."""

    @property
    def sample(self) -> float | None: ...


Target = TypeVar("Target", bound=Decided)


@dataclasses.dataclass(frozen=True)
class Sample:
    """One timed batch of a device: its events, path, bytes and expected GB/s."""

    start: int
    end: int
    path: Path
    nbytes: int
    expected: float


_watches: dict[int, dict[Path, Watch]] = {}  # device -> path -> what its samples showed
_pending: dict[int, Sample] = {}  # device -> its sample outstanding
_last_sample: dict[int, float] = {}
_heard_under: dict[int, int] = {}  # device -> device.generation its watches were kept under
_lock = threading.Lock()


def watches(ordinal: int) -> dict[Path, Watch]:
    """What the samples of ``ordinal``'s paths showed (a copy; for tests and tools)."""
    return dict(_watches.get(ordinal, {}))


def heard(target: Target, requested: str) -> Target:
    """``target`` with the guard's say: the decision moved off a path the guard avoids
    (the reason says why and for how long), and ``sample`` (the GB/s expected) set
    where this batch is to be timed. ``target`` itself where config.guard is off or
    nothing applies."""
    if not config.guard or requested != "auto":
        return target
    ordinal, now = target.info.ordinal, _clock()
    collect(ordinal)
    thresholds = device.thresholds(ordinal)
    with _lock:
        if _heard_under.get(ordinal) != device.generation:
            # (calibrated again, or capabilities changed: what was held to the old
            # rates says nothing of the new ones)
            _watches.pop(ordinal, None)
            _heard_under[ordinal] = device.generation
        paths = _watches.setdefault(ordinal, {})
        decision, moved = policy_guard.steer(
            target.request, target.decision, target.info.caps, thresholds, paths, now
        )
        if moved is not None:
            paths[policy_guard.path_of(target.request, target.decision.method)] = moved
        due = (
            ordinal not in _pending and now - _last_sample.get(ordinal, float("-inf")) >= GUARD_SAMPLE_EVERY_S
        )
    expected = (
        policy_guard.expected_gbps(thresholds, target.request, decision.method)
        if due and policy_guard.worth_sampling(target.request, decision, requested)
        else None
    )
    if decision is target.decision:
        return target if expected is None else dataclasses.replace(target, sample=expected)  # type: ignore[type-var]
    # (a moved decision holds for a while only: no small-batch replay records it)
    return dataclasses.replace(target, decision=decision, sample=expected, traffic_free=None)  # type: ignore[type-var]


_UNTIMED = contextlib.nullcontext()  # (most batches: entering it costs next to nothing)


def timed(target: Decided) -> contextlib.AbstractContextManager:
    """What times the batch issued inside it on ``target``'s stream where decide() asked
    for a sample (an event before, one after, read later by collect()); else a context
    that does nothing. Of two threads sampling one device at once, the first to end
    keeps its sample."""
    return _UNTIMED if target.sample is None else _Timing(target)


class _Timing:
    def __init__(self, target: Decided) -> None:
        self.target, self.start, self.end = target, 0, 0

    def __enter__(self) -> None:
        try:
            self.start = driver.event_create(timing=True)
            self.end = driver.event_create(timing=True)
            driver.event_record(self.start, self.target.handle)
        except BaseException:
            _destroy(self.start, self.end)
            raise

    def __exit__(self, kind: object, *rest: object) -> None:
        target = self.target
        if kind is None:
            try:
                driver.event_record(self.end, target.handle)
            except BaseException:
                _destroy(self.start, self.end)
                raise
        else:  # (the issue failed: nothing to time)
            _destroy(self.start, self.end)
            return
        ordinal = target.info.ordinal
        path = policy_guard.path_of(target.request, target.decision.method)
        assert target.sample is not None  # (timed() makes one only then)
        with _lock:
            kept = ordinal not in _pending
            if kept:
                _pending[ordinal] = Sample(
                    self.start, self.end, path, target.request.total_bytes, target.sample
                )
                _last_sample[ordinal] = _clock()
        if not kept:
            _destroy(self.start, self.end)


def collect(ordinal: int) -> None:
    """Read ``ordinal``'s outstanding sample where its batch has ended (nothing waits)
    and note its rate against its path's watch. Call in the device's context."""
    sample = _pending.get(ordinal)
    if sample is None:
        return
    try:
        if not driver.event_query(sample.end):
            return
        ms = driver.event_elapsed_ms(sample.start, sample.end)
    except CudaError:  # (its context was reset, say: the sample is lost, not the copy)
        ms = 0.0
    with _lock:
        if _pending.get(ordinal) is not sample:
            return  # (another thread read it)
        del _pending[ordinal]
        if ms > 0:
            paths = _watches.setdefault(ordinal, {})
            watch = paths.get(sample.path, Watch())
            paths[sample.path] = policy_guard.observe(
                watch, sample.nbytes / ms / 1e6, sample.expected, _clock()
            )
    _destroy(sample.start, sample.end)


def _destroy(*events: int) -> None:
    for event in events:
        if event:
            try:
                driver.event_destroy(event)
            except CudaError:
                pass


def forget() -> None:
    """Drop every watch and sample (tests; a recalibration)."""
    with _lock:
        _watches.clear()
        _pending.clear()
        _last_sample.clear()
        _heard_under.clear()
