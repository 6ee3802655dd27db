"""The guard on 'auto': the pure policy with made-up rates, and the engine's sampling
with the driver's events faked (CPU)."""

from __future__ import annotations

import dataclasses

import pytest

from kvcopy.policy import CopyRequest, Decision, DeviceCaps, Thresholds, choose_method
from kvcopy.policy import guard
from kvcopy.policy.defaults import GUARD_HOLD_S, GUARD_MAX_HOLD_S, GUARD_MIN_BYTES, GUARD_SLOW_SAMPLES
from helpers.cpu_fakes import FakeScope
from helpers.described import described_like_the_pass
import numpy as np

import kvcopy
from kvcopy import testing
from kvcopy.testing import cuda, engine, settings

KiB, MiB = 1 << 10, 1 << 20
CAPS = DeviceCaps(bulk_copy=True)
# One H100 host whose SMs read host memory at about 33 GB/s, where the copy engines
# reach 49 at 16 KiB and 54 from 64 KiB; calibration there measured the kernel at 50 the
# day before (a host of the same kind) -- here made-up rates of that shape.
MEASURED = Thresholds(
    rates={
        "h2d": {16 * KiB: {"kernel": 50.0, "batch": 49.0}, 64 * KiB: {"kernel": 50.0, "batch": 54.0}},
        "d2h": {16 * KiB: {"kernel": 51.0, "batch": 48.0}},
    }
)


HOST_TO_GPU = (cuda.classify.KIND_HOST_MAPPED, -1, cuda.classify.KIND_DEVICE, 0)


def request(direction="h2d", block=16 * KiB, count=2048, stream="created", capturing=False) -> CopyRequest:
    return CopyRequest(direction, count, count * block, True, stream, capturing)


def slow(watch: guard.Watch, rate: float, times: int, now: float = 0.0) -> guard.Watch:
    for _ in range(times):
        watch = guard.observe(watch, rate, 50.0, now)
    return watch


def test_paths_are_directions_methods_and_powers_of_two_of_the_mean_block():
    assert guard.size_class(16 * KiB) == guard.size_class(31 * KiB) == 14
    assert guard.size_class(0) == 0
    assert guard.path_of(request(block=24 * KiB), "kernel") == ("h2d", "kernel", 14)


def test_the_expected_rate_is_the_nearest_block_measured_and_none_unmeasured():
    assert guard.expected_gbps(MEASURED, request(block=20 * KiB), "kernel") == 50.0
    assert guard.expected_gbps(MEASURED, request(block=48 * KiB), "batch") == 54.0  # (nearer 64 KiB)
    assert guard.expected_gbps(MEASURED, request("d2h"), "batch") == 48.0
    assert guard.expected_gbps(Thresholds(), request(), "kernel") is None
    assert guard.expected_gbps(MEASURED, request("d2d"), "kernel") is None


def test_slow_samples_count_in_a_row_and_a_good_one_clears_them():
    watch = slow(guard.Watch(), 33.0, 2)
    assert watch.slow == 2 and watch.rate == 33.0 and watch.expected == 50.0
    assert guard.observe(watch, 34.0, 50.0, 0.0).slow == 3  # (below 0.7 x 50: slow)
    assert guard.observe(watch, 49.0, 50.0, 0.0).slow == 0


def test_a_slow_kernel_moves_to_the_copy_engines_for_a_hold_then_is_tried_again():
    req, caps = request(), CAPS
    decision = choose_method(req, caps, MEASURED)
    assert decision.method == "kernel"
    path = guard.path_of(req, "kernel")
    # fewer slow samples than it takes: no move
    watches = {path: slow(guard.Watch(), 33.0, GUARD_SLOW_SAMPLES - 1)}
    assert guard.steer(req, decision, caps, MEASURED, watches, 100.0) == (decision, None)
    watches = {path: slow(guard.Watch(), 33.0, GUARD_SLOW_SAMPLES)}
    moved_decision, moved = guard.steer(req, decision, caps, MEASURED, watches, 100.0)
    assert moved_decision.method == "batch"
    assert moved is not None and moved.avoid_until == 100.0 + GUARD_HOLD_S and moved.moves == 1
    assert moved_decision.reason == (
        "guard: kernel moved 33.0 GB/s here, 66% of the 50.0 GB/s calibration measured; "
        "batch for 10 s, then kernel is tried again"
    )
    # during the hold every decision moves, without a new move; after it, the kernel again
    watches[path] = moved
    during, again = guard.steer(req, decision, caps, MEASURED, watches, 105.0)
    assert during.method == "batch" and again is None and "for 5 s" in during.reason
    assert guard.steer(req, decision, caps, MEASURED, watches, 100.0 + GUARD_HOLD_S) == (decision, None)


def test_each_move_of_a_path_holds_twice_as_long_up_to_a_bound():
    assert [guard.hold_s(m) for m in (1, 2, 3)] == [GUARD_HOLD_S, 2 * GUARD_HOLD_S, 4 * GUARD_HOLD_S]
    assert guard.hold_s(30) == GUARD_MAX_HOLD_S
    req = request()
    path = guard.path_of(req, "kernel")
    watch = dataclasses.replace(slow(guard.Watch(), 33.0, GUARD_SLOW_SAMPLES), moves=2)
    decision = choose_method(req, CAPS, MEASURED)
    _, moved = guard.steer(req, decision, CAPS, MEASURED, {path: watch}, 0.0)
    assert moved is not None and moved.moves == 3 and moved.avoid_until == 4 * GUARD_HOLD_S


def test_no_move_where_the_other_method_was_measured_no_faster_or_not_at_all():
    req = request("d2h")  # the engines measured 48 GB/s here
    decision = choose_method(req, CAPS, MEASURED)
    path = guard.path_of(req, "kernel")
    watches = {path: slow(guard.Watch(), 45.0 * 0.99, GUARD_SLOW_SAMPLES)}  # 44.6 x 1.1 > 48
    watches[path] = dataclasses.replace(watches[path], expected=51.0)
    assert guard.steer(req, decision, CAPS, MEASURED, watches, 0.0) == (decision, None)
    only_kernel = Thresholds(rates={"h2d": {16 * KiB: {"kernel": 50.0}}})
    req = request()
    watches = {guard.path_of(req, "kernel"): slow(guard.Watch(), 20.0, GUARD_SLOW_SAMPLES)}
    assert guard.steer(req, choose_method(req, CAPS, only_kernel), CAPS, only_kernel, watches, 0.0)[1] is None


@pytest.mark.parametrize(
    "req", [request(stream="legacy"), request(capturing=True)], ids=["legacy", "capture"]
)
def test_no_move_where_the_request_rules_the_copy_engines_out(req):
    decision = choose_method(req, CAPS, MEASURED)
    assert decision.method == "kernel"
    watches = {guard.path_of(req, "kernel"): slow(guard.Watch(), 20.0, GUARD_SLOW_SAMPLES)}
    assert guard.steer(req, decision, CAPS, MEASURED, watches, 0.0) == (decision, None)


def test_a_fast_host_keeps_the_kernel():
    req = request()
    decision = choose_method(req, CAPS, MEASURED)
    watch = guard.Watch()
    for _ in range(10):
        watch = guard.observe(watch, 49.0, 50.0, 0.0)
    assert guard.steer(req, decision, CAPS, MEASURED, {guard.path_of(req, "kernel"): watch}, 0.0) == (
        decision,
        None,
    )


def test_only_auto_batches_between_host_and_gpu_large_enough_and_uncaptured_are_sampled():
    kernel = Decision("kernel", "")
    assert guard.worth_sampling(request(), kernel, "auto")
    assert not guard.worth_sampling(request(), kernel, "kernel")
    assert not guard.worth_sampling(request(count=1, block=GUARD_MIN_BYTES - 1), kernel, "auto")
    assert not guard.worth_sampling(request("d2d"), kernel, "auto")
    assert not guard.worth_sampling(request(capturing=True), kernel, "auto")
    assert not guard.worth_sampling(request(), Decision("loop", ""), "auto")


class Events:
    """The driver's events as the guard uses them: each batch takes ``ms``."""

    def __init__(self, ms: float) -> None:
        self.ms, self.next, self.live, self.done = ms, 1000, set(), True
        self.recorded: list[int] = []

    def event_create(self, timing: bool = False) -> int:
        self.next += 1
        self.live.add(self.next)
        return self.next

    def event_record(self, event: int, stream: int) -> None:
        self.recorded.append(event)  # (the ring's fences too, where the issue path runs)

    def event_query(self, event: int) -> bool:
        return self.done

    def event_elapsed_ms(self, start: int, end: int) -> float:
        return self.ms

    def event_destroy(self, event: int) -> None:
        self.live.remove(event)


@dataclasses.dataclass(frozen=True)
class Info:
    ordinal: int = 0
    caps: DeviceCaps = CAPS


@dataclasses.dataclass(frozen=True)
class Target:
    handle: int
    info: Info
    request: CopyRequest
    decision: Decision
    traffic_free: bool | None = True
    sample: float | None = None


@pytest.fixture
def engine_guard(monkeypatch):
    """kvcopy._engine.guard over faked events, a calibrated device 0 and a clock the test
    moves; the guard on."""
    events = Events(ms=1.0)
    clock = [1000.0]
    monkeypatch.setattr(engine.guard, "driver", events)
    monkeypatch.setattr(engine.guard, "_clock", lambda: clock[0])
    monkeypatch.setattr(engine.guard.device, "thresholds", lambda ordinal: MEASURED)
    engine.guard.forget()
    with settings(guard=True):
        yield events, clock
    engine.guard.forget()


def _batch(events, clock, req, decision):
    target = engine.guard.heard(Target(0x10, Info(), req, decision), "auto")
    with engine.guard.timed(target):
        pass
    clock[0] += 0.1
    return target


def test_the_engine_times_samples_and_moves_a_slow_path_visibly(engine_guard):
    events, clock = engine_guard
    req = request()  # 32 MiB of 16 KiB blocks
    decision = choose_method(req, CAPS, MEASURED)
    events.ms = req.total_bytes / 33.0 / 1e6  # the kernel moves 33 GB/s
    seen = [_batch(events, clock, req, decision) for _ in range(GUARD_SLOW_SAMPLES + 1)]
    assert all(t.sample == 50.0 for t in seen[:GUARD_SLOW_SAMPLES])  # each one timed
    assert [t.decision.method for t in seen] == ["kernel"] * GUARD_SLOW_SAMPLES + ["batch"]
    assert seen[-1].decision.reason.startswith("guard: kernel moved 33.0 GB/s here, 66%")
    assert seen[-1].traffic_free is None  # (no replay records a moved decision)
    watch = engine.guard.watches(0)[guard.path_of(req, "kernel")]
    assert watch.moves == 1 and watch.avoid_until == pytest.approx(clock[0] - 0.1 + GUARD_HOLD_S)
    assert len(events.live) == 2  # the last sample's events only: the others destroyed
    # after the hold the kernel is tried again
    clock[0] += GUARD_HOLD_S
    assert _batch(events, clock, req, decision).decision is decision


def test_an_unfinished_sample_is_not_waited_for_and_nothing_is_sampled_beside_it(engine_guard):
    events, clock = engine_guard
    events.done = False
    req = request()
    decision = choose_method(req, CAPS, MEASURED)
    first = _batch(events, clock, req, decision)
    second = _batch(events, clock, req, decision)
    assert first.sample is not None and second.sample is None and len(events.live) == 2
    events.done = True
    assert _batch(events, clock, req, decision).sample is not None


def test_the_guard_off_or_an_explicit_method_leaves_the_target_as_it_is(engine_guard):
    events, clock = engine_guard
    req = request()
    target = Target(0x10, Info(), req, choose_method(req, CAPS, MEASURED))
    assert engine.guard.heard(target, "kernel") is target
    with settings(guard=False):
        assert engine.guard.heard(target, "auto") is target
    assert not events.live


def test_a_failed_issue_leaves_no_sample_and_no_events(engine_guard):
    events, clock = engine_guard
    req = request()
    target = engine.guard.heard(Target(0x10, Info(), req, choose_method(req, CAPS, MEASURED)), "auto")
    with pytest.raises(RuntimeError, match="launch failed"):
        with engine.guard.timed(target):
            raise RuntimeError("launch failed")
    assert not events.live
    clock[0] += 1
    assert engine.guard.heard(target, "auto").sample is not None  # (free to sample again)


class IssuingDriver(Events):
    """The driver layer one copy_batch-sized batch reaches on its kernel and DMA paths,
    events included; records the paths taken."""

    DESCRIPTOR_BYTES = cuda.describe.DESCRIPTOR_BYTES
    COMPACT_BYTES = cuda.describe.COMPACT_BYTES
    INLINE_MAX = cuda.launch.INLINE_MAX
    INLINE_MAX_SMALL = cuda.launch.INLINE_MAX_SMALL
    INLINE_MAX_TINY = cuda.launch.INLINE_MAX_TINY
    BULK_THREADS = cuda.launch.BULK_THREADS

    def __init__(self, ms: float) -> None:
        super().__init__(ms)
        self.paths: list[str] = []

    def stream_capture_status(self, handle: int) -> int:
        return 0

    def context_device(self) -> int:
        return 0

    def describe_compact(self, src, dst, sizes, out, merge):
        return described_like_the_pass(src, dst, sizes, HOST_TO_GPU, out, 1, 4096)

    def launch_compact(self, *args, **kwargs):
        self.paths.append("kernel")
        return 1

    def plan_dma(self, src, dst, sizes, merge):
        return src, dst, sizes, np.arange(len(sizes), dtype=np.int64)

    def memcpy_batch(self, dst, src, sizes, stream, access_any, chunk):
        self.paths.append("batch")


def test_copy_batch_sized_batches_are_timed_and_move_off_a_slow_kernel(seams, monkeypatch):
    count, size = 2048, 4096  # 8 MiB; thresholds measured at 4 KiB
    rates = Thresholds(rates={"h2d": {size: {"kernel": 50.0, "batch": 40.0}}})
    fake = IssuingDriver(ms=count * size / 20.0 / 1e6)  # the kernel moves 20 GB/s
    seams.enter_context(testing.fake_cuda(fake, ("driver", "describe", "launch", "dma")))
    kernel = engine.kernels.CopyKernel(1, 2, 3, 4, 5, 6, 7, 8, 9, cuda.launch.INLINE_MAX, None)
    slot = engine.ring.Slot(capacity=1 << 24, host=0x1000, mapped=0x2000, device=0x3000, event=0x77)
    seams.enter_context(
        testing.fake_runtime(thresholds=rates, copy_kernel=kernel, slot=slot, scope=FakeScope)
    )
    clock = [0.0]
    monkeypatch.setattr(engine.guard, "_clock", lambda: clock[0])
    seams.enter_context(settings(guard=True, launch_bytes=0))
    src = np.arange(count, dtype=np.uint64) * np.uint64(2 * size) + np.uint64(0x10000)
    sizes = np.full(count, size, dtype=np.uint64)
    used = []
    for _ in range(GUARD_SLOW_SAMPLES + 1):
        used.append(
            engine.dispatch.execute_copies(
                FakeScope(), 0x1234, src, src + np.uint64(0x7F0000000000), sizes, "auto", True, False, None
            )
        )
        clock[0] += 1.0
    assert used == fake.paths == ["kernel"] * GUARD_SLOW_SAMPLES + ["batch"]
    assert kvcopy.last_decision().reason.startswith("guard: kernel moved 20.0 GB/s here, 40% of the 50.0")
    # the moved batch was timed too, against the engines' 40 GB/s; its events are the only ones left
    assert len(fake.live) == 2


def test_watches_kept_under_an_older_calibration_are_dropped(engine_guard, monkeypatch):
    events, clock = engine_guard
    req = request()
    decision = choose_method(req, CAPS, MEASURED)
    events.ms = req.total_bytes / 33.0 / 1e6
    for _ in range(GUARD_SLOW_SAMPLES):
        _batch(events, clock, req, decision)
    assert engine.guard.watches(0)[guard.path_of(req, "kernel")].slow == GUARD_SLOW_SAMPLES - 1
    monkeypatch.setattr(engine.guard.device, "generation", engine.guard.device.generation + 1)
    assert _batch(events, clock, req, decision).decision is decision  # (no move: counted anew)
    assert engine.guard.watches(0) == {}
    _batch(events, clock, req, decision)
    assert engine.guard.watches(0)[guard.path_of(req, "kernel")].slow == 1
