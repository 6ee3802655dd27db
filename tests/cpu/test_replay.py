"""The replay (kvcopy._engine.replay and its records, kvcopy._cuda.replay_records) without a
GPU: what makes a record stale, what is refused, and how many are kept. (The replays
themselves: test_gpu_replay.py.)"""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import testing
from kvcopy.testing import engine

replay = engine.replay
from kvcopy.testing import cuda

replay_records = cuda.replay_records
DescribedBatch = cuda.describe.DescribedBatch
from kvcopy.policy import Decision

KEY = dict(stream=1, epoch=5, method=1)
BATCH = dict(
    count=16,
    total_bytes=16 * 16384,
    tiles=16,
    src_kinds=2,
    src_device=-1,
    dst_kinds=1,
    dst_device=0,
    compact_size=0,
)
LAUNCH = dict(function=0x1234, per_launch=31, ctas=4, threads=512)


def record(ctx: int, decision=None, **change) -> None:
    """replay_records.record of a batch of BATCH launched as LAUNCH, either changed by
    ``change``."""
    batch = {**BATCH, **{k: v for k, v in change.items() if k in BATCH}}
    launched = {**LAUNCH, **{k: v for k, v in change.items() if k in LAUNCH}}
    replay_records.record(
        ctx,
        **KEY,
        batch=DescribedBatch(**batch),
        launched=tuple(launched.values()),
        decision=decision,
        note=None,
    )


@pytest.fixture(autouse=True)
def no_records():
    replay_records.forget()
    yield
    replay_records.forget()


def test_the_epoch_moves_with_every_setting_assigned(monkeypatch):
    before = replay.epoch()
    kvcopy.config.host_ctas = 3
    after = replay.epoch()
    assert after != before
    kvcopy.config.host_ctas = 3  # the same value again still counts
    assert replay.epoch() != after


def test_the_epoch_moves_when_device_facts_change():
    before = replay.epoch()
    with testing.capabilities(batch_available=False):
        inside = replay.epoch()
    assert len({before, inside, replay.epoch()}) == 3


def test_records_are_kept_up_to_kept_and_the_oldest_gives_way():
    decision = Decision("kernel", "test")
    for k in range(replay_records.KEPT + 5):
        record(0x1000 + k, decision)
    assert replay_records.records() == replay_records.KEPT
    # the same key again replaces its record instead of taking another slot
    record(0x1000 + replay_records.KEPT + 4, decision)
    assert replay_records.records() == replay_records.KEPT
    replay_records.forget()
    assert replay_records.records() == 0


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(ctx=0), "not a launch by value"),
        (dict(count=0), "not a launch by value"),
        (dict(count=replay_records.MAX_COPIES + 1), "not a launch by value"),
        (dict(threads=100), "not a launch by value"),
        (dict(ctas=0), "not a launch by value"),
        (dict(compact_size=4096), "not a launch by value"),  # pairs are never passed by value
    ],
)
def test_remember_refuses_what_is_not_a_small_launch_by_value(change, match):
    change = dict(change)
    ctx = change.pop("ctx", 0x1000)
    with pytest.raises(ValueError, match=match):
        record(ctx, **change)
    assert replay_records.records() == 0


def test_a_function_kvcopy_did_not_load_is_never_recorded():
    """The full path records only entry points of the kernel loaded in the current
    context: a launch by a fake or foreign function (a test's, or none loaded) is not."""

    class Target:
        handle = 1

        class request:
            capturing = False
            direction = "h2d"
            other_way_recent = False

        decision = Decision("kernel", "test")
        traffic_free = True

    recorded = replay.record(Target, DescribedBatch(**BATCH), "kernel", (0xBAD, 31, 4, 512))
    assert recorded is False
    assert replay_records.records() == 0


def test_without_records_nothing_is_launched():
    src = np.arange(1, 17, dtype=np.uint64) * np.uint64(4096)
    sizes = np.full(16, 4096, np.uint64)
    before = replay.replays()  # (counted for the whole process)
    scratch = np.empty(16 * 4, np.uint64)
    assert replay.replay(src, src + np.uint64(1 << 30), sizes, 1, "auto", scratch.ctypes.data) is None
    assert replay.replay(src, src, sizes, 1, "batch", scratch.ctypes.data) is None
    assert replay.replays() == before


@pytest.mark.parametrize("count, kept", [(1, 1), (127, 1), (0, 0), (128, 0)])
def test_a_copy_engine_record_is_kept_for_small_batches_only(count, kept):
    batch = DescribedBatch(**{**BATCH, "count": count})
    if kept:
        replay_records.record_copies(0x1000, **KEY, batch=batch, decision=Decision("loop", "test"), note=None)
    else:
        with pytest.raises(ValueError, match="not a small batch"):
            replay_records.record_copies(0x1000, **KEY, batch=batch, decision=None, note=None)
    assert replay_records.records() == kept


def test_a_copy_engine_record_and_a_launch_of_the_same_shape_share_one_place():
    """The record is the batch's key: the decision made last for that shape is the one
    kept, whether a launch or the copy engines."""
    record(0x1000)
    replay_records.record_copies(0x1000, **KEY, batch=DescribedBatch(**BATCH), decision=None, note=None)
    assert replay_records.records() == 1
