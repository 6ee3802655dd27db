"""kvcopy._engine.replay and kvcopy._cuda.repeat without a GPU: what makes a record stale,
what is refused, and how many are kept. (The replays themselves: test_gpu_repeat.py.)"""
from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import _testing
from kvcopy._engine import replay
from kvcopy._cuda import repeat
from kvcopy.policy import Decision

KEY = dict(stream=1, epoch=5, method=1, src_kinds=2, src_device=-1, dst_kinds=1, dst_device=0,
           count=16, total_bytes=16 * 16384)
LAUNCH = dict(function=0x1234, per_launch=31, ctas=4, threads=512)


@pytest.fixture(autouse=True)
def no_records():
    repeat.forget()
    yield
    repeat.forget()


def test_the_epoch_moves_with_every_setting_assigned(monkeypatch):
    before = replay.epoch()
    monkeypatch.setattr(kvcopy.config, "host_ctas", 3)
    after = replay.epoch()
    assert after != before
    kvcopy.config.host_ctas = 3              # the same value again still counts
    assert replay.epoch() != after


def test_the_epoch_moves_when_device_facts_change():
    before = replay.epoch()
    with _testing.capabilities(batch_available=False):
        inside = replay.epoch()
    assert len({before, inside, replay.epoch()}) == 3


def test_records_are_kept_up_to_kept_and_the_oldest_gives_way():
    decision = Decision("kernel", "test")
    for k in range(repeat.KEPT + 5):
        repeat.remember(0x1000 + k, **KEY, **LAUNCH, decision=decision, note=None)
    assert repeat.remembered() == repeat.KEPT
    # the same key again replaces its record instead of taking another slot
    repeat.remember(0x1000 + repeat.KEPT + 4, **KEY, **LAUNCH, decision=decision, note=None)
    assert repeat.remembered() == repeat.KEPT
    repeat.forget()
    assert repeat.remembered() == 0


@pytest.mark.parametrize("change, match", [
    (dict(ctx=0), "not a launch by value"),
    (dict(count=0), "not a launch by value"),
    (dict(count=repeat.MAX_COPIES + 1), "not a launch by value"),
    (dict(threads=100), "not a launch by value"),
    (dict(ctas=0), "not a launch by value"),
])
def test_remember_refuses_what_is_not_a_small_launch_by_value(change, match):
    args = dict(ctx=0x1000, **KEY, **LAUNCH, decision=None, note=None)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        repeat.remember(**args)
    assert repeat.remembered() == 0


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

    class Found:
        src_kinds, src_device, dst_kinds, dst_device = 2, -1, 1, 0

    recorded = replay.record(Target, Found, "kernel", 16, 16 * 16384, (0xBAD, 31, 4, 512))
    assert recorded is False
    assert repeat.remembered() == 0


def test_without_records_nothing_is_launched():
    src = np.arange(1, 17, dtype=np.uint64) * np.uint64(4096)
    sizes = np.full(16, 4096, np.uint64)
    before = replay.replayed()          # (counted for the whole process)
    assert replay.launch_again(src, src + np.uint64(1 << 30), sizes, 1, "auto") is None
    assert replay.launch_again(src, src, sizes, 1, "batch") is None   # never recorded
    assert replay.replayed() == before
