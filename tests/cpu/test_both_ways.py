"""copy_both_ways' ordering and validation, with the driver faked (CPU): under capture
both sides stay on the capturing stream; otherwise a side that does not share the
kernel launch runs on kvcopy's side stream, forked from the caller's stream before
anything is issued and joined back after; a bad side stops both before either runs."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import policy, testing
from kvcopy.testing import engine

both_ways = engine.both_ways
side_streams = engine.side_streams
from kvcopy.errors import CudaError
from kvcopy.policy import Decision, Thresholds
from helpers.cpu_fakes import FakeScope

HANDLE, SIDE = 0x1234, 0x5678


class Recorder:
    """The driver calls and issues both_ways makes, in order."""

    def __init__(
        self, capturing: int = 0, fused=None, bad: str | None = None, fail_at: tuple[int, int] | None = None
    ) -> None:
        self.calls: list[str] = []
        self.capturing, self.fused, self.bad, self.fail_at = capturing, fused, bad, fail_at

    # kvcopy._cuda.driver
    def stream_capture_status(self, handle: int) -> int:
        return self.capturing

    def stream_wait_stream(self, consumer: int, producer: int) -> None:
        self.calls.append(f"{consumer:#x} waits for {producer:#x}")

    # kvcopy._cuda.dma
    def plan_dma(self, src, dst, sizes, merge):
        self.calls.append(f"check {len(sizes)}")
        if self.bad is not None and len(sizes) == 3:
            raise ValueError(self.bad)
        # as if the caller's copy 0 were empty and dropped: planned copy k is caller's k + 1
        return src[1:], dst[1:], sizes[1:], np.arange(1, len(sizes), dtype=np.int64)

    def memcpy_batch(self, dst, src, sizes, stream, access_any, chunk):
        first = int(src[0] - 0x10000)  # the caller's index of the chunk's first copy
        self.calls.append(f"batch {first}+{len(sizes)} on {stream:#x}")
        if self.fail_at and self.fail_at[0] == stream and first <= self.fail_at[1] < first + len(sizes):
            raise CudaError(1, "CUDA_ERROR_INVALID_VALUE", "invalid argument", self.fail_at[1] - first)

    # kvcopy._engine.dispatch
    def execute_copies(self, scope, handle, src, dst, sizes, method, merge, access_any, ctas):
        self.calls.append(f"issue {len(sizes)} on {handle:#x}")
        return "batch"


@pytest.fixture
def record(monkeypatch, seams):
    def install(**kw) -> Recorder:
        rec = Recorder(**kw)
        seams.enter_context(testing.fake_cuda(rec, ("driver", "dma")))
        seams.enter_context(testing.fake_runtime(scope=FakeScope, side_stream=lambda handle, index=0: SIDE))
        # each side apart, and the fused launch's answer, as the test sets them
        monkeypatch.setattr(both_ways.dispatch, "execute_copies", rec.execute_copies)
        monkeypatch.setattr(both_ways, "_fused", lambda *a: rec.fused)
        return rec

    return install


def batch(n: int) -> tuple:
    return (
        np.arange(n, dtype=np.uint64) + 0x10000,
        np.arange(n, dtype=np.uint64) + 0x7F0000000,
        np.full(n, 8, dtype=np.uint64),
    )


def test_apart_the_second_side_runs_on_a_forked_and_joined_stream(record):
    rec = record()
    assert both_ways.execute_both(batch(2), batch(3), HANDLE) == ("batch", "batch")
    assert rec.calls == [
        "check 2",
        "check 3",
        f"{SIDE:#x} waits for {HANDLE:#x}",
        f"issue 2 on {HANDLE:#x}",
        f"issue 3 on {SIDE:#x}",
        f"{HANDLE:#x} waits for {SIDE:#x}",
    ]


def test_one_launch_when_both_go_to_the_kernel(record):
    rec = record(fused=("kernel", "kernel"))
    assert both_ways.execute_both(batch(2), batch(3), HANDLE) == ("kernel", "kernel")
    assert rec.calls == []


@pytest.mark.parametrize("given", [None, Thresholds(both_ways_batch_min_bytes=0)])
def test_the_joint_choice_takes_the_thresholds_passed_else_the_devices(record, monkeypatch, given):
    record(fused=("kernel", "kernel"))
    passed = []
    monkeypatch.setattr(both_ways, "_fused", lambda *a: passed.append(a[-1]) or ("kernel", "kernel"))
    both_ways.execute_both(batch(2), batch(3), HANDLE, thresholds=given)
    assert passed == [given]  # None: _fused asks device.thresholds for the device's own


def test_under_capture_both_stay_on_the_capturing_stream(record):
    rec = record(capturing=1)
    both_ways.execute_both(batch(2), batch(3), HANDLE, "auto")
    assert rec.calls == ["check 2", "check 3", f"issue 2 on {HANDLE:#x}", f"issue 3 on {HANDLE:#x}"]


def test_a_bad_second_side_stops_both_before_either_runs(record):
    rec = record(bad="src_ptrs[1] = 0x2a: not readable")
    with pytest.raises(ValueError, match=r"^load: src_ptrs\[1\] = 0x2a"):
        both_ways.execute_both(batch(2), batch(3), HANDLE, names=("store", "load"))
    assert not any(call.startswith(("issue", "0x")) for call in rec.calls)


JOINT = Decision("batch", "both ways at once, blocks of 64 KiB and more")


def test_large_blocks_both_ways_go_to_the_copy_engines_in_alternating_chunks(record):
    rec = record(fused=JOINT)
    assert both_ways.execute_both(batch(151), batch(71), HANDLE) == ("batch", "batch")
    chunk = policy.BOTH_WAYS_DMA_CHUNK
    assert chunk == 64
    assert rec.calls == [
        "check 151",
        "check 71",
        f"{SIDE:#x} waits for {HANDLE:#x}",
        f"batch 1+64 on {HANDLE:#x}",
        f"batch 1+64 on {SIDE:#x}",
        f"batch 65+64 on {HANDLE:#x}",
        f"batch 65+6 on {SIDE:#x}",
        f"batch 129+22 on {HANDLE:#x}",
        f"{HANDLE:#x} waits for {SIDE:#x}",
    ]
    assert kvcopy.last_decision() == JOINT


def test_a_failing_chunk_names_its_side_and_the_callers_index_and_still_joins(record):
    rec = record(fused=JOINT, fail_at=(SIDE, 70))
    with pytest.raises(CudaError, match=r"CUDA_ERROR_INVALID_VALUE: load: invalid argument") as info:
        both_ways.execute_both(batch(151), batch(71), HANDLE, names=("store", "load"))
    assert info.value.index == 70
    assert rec.calls[-2:] == [f"batch 65+6 on {SIDE:#x}", f"{HANDLE:#x} waits for {SIDE:#x}"]


def test_each_callers_stream_has_a_side_stream_of_its_own(seams):
    """Callers on different streams (threads of an engine) never share a side stream,
    so none waits for another's side work; past the limit they share by handle,
    and no stream is created twice for one caller."""
    created = iter(range(0x9000, 0x9100))
    made: list[int] = []

    class FakeDriver:
        @staticmethod
        def stream_create(non_blocking: bool) -> int:
            assert non_blocking
            made.append(next(created))
            return made[-1]

    seams.enter_context(testing.fake_cuda(FakeDriver, ("driver",)))
    sides = side_streams.SideStreams()
    first, second = sides.for_caller(0x10), sides.for_caller(0x20)
    assert first != second
    assert sides.for_caller(0x10) == first and sides.for_caller(0x20) == second
    callers = [0x100 + k for k in range(policy.MAX_SIDE_STREAMS + 5)]
    got = [sides.for_caller(h) for h in callers]
    assert len(made) == policy.MAX_SIDE_STREAMS  # never more streams than the limit
    assert len(set(got[: policy.MAX_SIDE_STREAMS - 2])) == policy.MAX_SIDE_STREAMS - 2
    assert set(got) <= set(made)
    assert [sides.for_caller(h) for h in callers] == got  # the same one every time
    # a caller that comes past the limit gets distinct shared streams for its indices
    # (staged copies use three; where they meet another's, the work only serializes)
    for h in range(0x5000, 0x5010):
        assert len({sides.for_caller(h, index) for index in range(3)}) == 3
    assert len(made) == policy.MAX_SIDE_STREAMS


def test_one_tile_batches_past_launch_bytes_go_as_slices_of_both_in_step(seams):
    """Each launch takes slice k of each batch where it was described (the fused kernel
    takes the second batch's own address): the table is left as it is."""
    from kvcopy.testing import engine

    ring = engine.ring
    from kvcopy.testing import cuda

    describe = cuda.describe

    count_a, count_b = 10, 7
    table = np.zeros((count_a + count_b, 4), dtype=np.uint64)
    table[:, 0] = np.arange(count_a + count_b)  # src names the descriptor
    before = table.copy()
    slot = ring.Slot(capacity=1 << 20, host=table.ctypes.data, mapped=0x2000, device=0x3000, event=0x77)
    launches = []

    class FakeLaunch:
        @staticmethod
        def launch_both(
            function, descs, n_a, tiles_a, ctas_a, n_b, tiles_b, ctas_b, threads, stream, upload_from, descs_b
        ):
            launches.append((descs, n_a, tiles_a, ctas_a, descs_b, n_b, tiles_b, ctas_b, upload_from))

    seams.enter_context(testing.fake_cuda(FakeLaunch, ("launch",)))
    both_ways._launch_in_slices(9, slot, count_a, count_b, (8, 1), 3, HANDLE)
    entry = describe.DESCRIPTOR_BYTES
    # slices of 4, 4, 2 (A, from descriptor 0) and 3, 3, 1 (B, from descriptor 10)
    assert launches == [
        (0x2000, 4, 4, 8, 0x2000 + 10 * entry, 3, 3, 1, 0),
        (0x2000 + 4 * entry, 4, 4, 8, 0x2000 + 13 * entry, 3, 3, 1, 0),
        (0x2000 + 8 * entry, 2, 2, 8, 0x2000 + 16 * entry, 1, 1, 1, 0),
    ]
    np.testing.assert_array_equal(table, before)


def test_a_side_shorter_than_the_launches_leaves_the_last_ones_empty(seams):
    from kvcopy.testing import engine

    ring = engine.ring
    from kvcopy.testing import cuda

    describe = cuda.describe

    slot = ring.Slot(capacity=1 << 20, host=0x9000, mapped=0x2000, device=0x3000, event=0x77)
    launches = []

    class FakeLaunch:
        @staticmethod
        def launch_both(*args):
            launches.append(args)

    seams.enter_context(testing.fake_cuda(FakeLaunch, ("launch",)))
    both_ways._launch_in_slices(9, slot, 9, 2, (8, 1), 3, HANDLE)
    entry = describe.DESCRIPTOR_BYTES
    assert [(call[1], call[2], call[5], call[11]) for call in launches] == [
        (0x2000, 3, 1, 0x2000 + 9 * entry),
        (0x2000 + 3 * entry, 3, 1, 0x2000 + 10 * entry),
        (0x2000 + 6 * entry, 3, 0, 0x2000 + 11 * entry),
    ]


@pytest.mark.parametrize(
    "store, load, limit, expected",
    [
        (64 << 20, 64 << 20, 16 << 20, 4),
        (8 << 20, 8 << 20, 16 << 20, 1),
        (10 << 20, 7 << 20, 16 << 20, 1),
        (7 << 20, 20 << 20, 16 << 20, 2),
        (64 << 20, 1, 16 << 20, 4),
        ((16 << 20) + 1, 0, 16 << 20, 2),
        (64 << 20, 64 << 20, 0, 1),
    ],
)
def test_both_ways_launches(store, load, limit, expected):
    from kvcopy.policy import both_ways_launches

    assert both_ways_launches(store, load, limit) == expected
