"""copy_batch calls one way beside calls the other way (config.traffic_window_ms): the
record of when each device last copied each way (kvcopy._engine.traffic_window), the policy's rule
for such a batch, and the engine's use of both (CPU, faked driver and clock)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

import kvcopy
from kvcopy import testing
from kvcopy.testing import engine

decide, dispatch, traffic_window = engine.decide, engine.dispatch, engine.traffic_window
from kvcopy.testing import cuda

kv_classify = cuda.classify
DescribedBatch = cuda.describe.DescribedBatch
from kvcopy.policy import CopyRequest, DeviceCaps, Thresholds, choose_method
from helpers.cpu_fakes import FakeCaptureDriver, FakeClassify, FakeScope

KiB, MiB = 1 << 10, 1 << 20
H200 = DeviceCaps(bulk_copy=True)
HOST, GPU = kv_classify.KIND_HOST_MAPPED, kv_classify.KIND_DEVICE
FOUND = {
    "h2d": decide.MemoryClasses(HOST, -1, GPU, 0),
    "d2h": decide.MemoryClasses(GPU, 0, HOST, -1),
    "d2d": decide.MemoryClasses(GPU, 0, GPU, 0),
}


class Clock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(seams):
    return seams.enter_context(testing.fake_clock(Clock()))


def req(
    direction="h2d", block=256 * KiB, recent=True, stream="created", capturing=False, batch_allowed=True
) -> CopyRequest:
    count = 256
    return CopyRequest(
        direction, count, count * block, True, stream, capturing, batch_allowed, other_way_recent=recent
    )


# ------------------------------------------------------------------ kvcopy._engine.traffic_window


def test_a_copy_one_way_is_recent_to_the_other_way_for_the_window_only(clock):
    traffic_window.note(0, "d2h")
    assert traffic_window.other_way_recent(0, "h2d", 0.05)
    assert not traffic_window.other_way_recent(0, "d2h", 0.05)  # its own direction is not "other"
    clock.now += 0.049
    assert traffic_window.other_way_recent(0, "h2d", 0.05)
    clock.now += 0.002
    assert not traffic_window.other_way_recent(0, "h2d", 0.05)
    traffic_window.note(0, "h2d")
    assert traffic_window.other_way_recent(0, "d2h", 0.05)


def test_the_same_stream_is_not_the_other_way_but_shared_handles_are(clock):
    traffic_window.note(0, "d2h", 9)
    assert not traffic_window.other_way_recent(0, "h2d", 0.05, 9)
    assert traffic_window.other_way_recent(0, "h2d", 0.05, 10)
    traffic_window.note(0, "d2h", 2)
    assert traffic_window.other_way_recent(0, "h2d", 0.05, 2)


def test_a_batch_the_other_way_counts_from_a_quarter_of_this_ones_bytes(clock):
    traffic_window.note(0, "d2h", 9, 16 * MiB)
    assert traffic_window.other_way_recent(0, "h2d", 0.05, 10, 64 * MiB)  # a quarter
    assert not traffic_window.other_way_recent(0, "h2d", 0.05, 10, 64 * MiB + 4)
    assert traffic_window.other_way_recent(0, "h2d", 0.05, 10, 1 * MiB)  # larger than this one


def test_devices_and_directions_other_than_host_and_gpu_are_kept_apart(clock):
    traffic_window.note(1, "d2h")
    assert not traffic_window.other_way_recent(0, "h2d", 1.0)  # another GPU, another link
    assert traffic_window.other_way_recent(1, "h2d", 1.0)
    for direction in ("d2d", "p2p", "h2h", "mixed"):
        traffic_window.note(0, direction)
        assert not traffic_window.other_way_recent(0, direction, 1.0)
    assert traffic_window._last.keys() == {(1, "d2h")}


def test_no_window_means_never_recent_and_forget_drops_everything(clock):
    traffic_window.note(0, "d2h")
    assert not traffic_window.other_way_recent(0, "h2d", 0)
    traffic_window.forget()
    assert not traffic_window.other_way_recent(0, "h2d", 1.0)


# ------------------------------------------------------------------ the policy's rule


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("block", [128 * KiB, 256 * KiB, 512 * KiB])
def test_blocks_from_the_both_ways_threshold_go_to_the_copy_engines_beside_the_other_way(direction, block):
    decision = choose_method(req(direction, block), H200)
    assert decision.method == "batch"
    assert "other way" in decision.reason and "traffic_window_ms" in decision.reason
    # alone, the same batch keeps the kernel
    assert choose_method(req(direction, block, recent=False), H200).method == "kernel"


@pytest.mark.parametrize("block", [4 * KiB, 16 * KiB, 64 * KiB, 127 * KiB])
def test_smaller_blocks_keep_the_kernel_beside_the_other_way(block):
    # (the copy engines' CPU cost per copy decides their wall time there)
    assert choose_method(req("h2d", block), H200).method == "kernel"


def test_the_calibrated_both_ways_threshold_moves_the_rule():
    low = Thresholds(both_ways_batch_min_bytes=64 * KiB)
    high = Thresholds(both_ways_batch_min_bytes=512 * KiB)
    assert choose_method(req("d2h", 64 * KiB), H200, low).method == "batch"
    assert choose_method(req("d2h", 256 * KiB), H200, high).method == "kernel"


@pytest.mark.parametrize("change", [{"stream": "legacy"}, {"capturing": True}, {"batch_allowed": False}])
def test_where_batched_dma_cannot_run_the_kernel_stays(change):
    assert choose_method(req("h2d", **change), H200).method == "kernel"


def test_inside_the_gpu_and_explicit_methods_ignore_the_other_way():
    assert choose_method(req("d2d"), H200).method == "kernel"
    assert choose_method(req("h2d"), H200, requested="kernel").method == "kernel"
    assert choose_method(req("h2d"), H200, requested="loop").method == "loop"


def test_a_request_is_alone_unless_said_otherwise():
    plain = CopyRequest("h2d", 256, 256 * 256 * KiB, True, "created")
    assert not plain.other_way_recent
    assert choose_method(plain, H200).method == "kernel"
    assert choose_method(dataclasses.replace(plain, other_way_recent=True), H200).method == "batch"


# ------------------------------------------------------------------ the engine


@pytest.fixture
def engine_state(seams, clock):
    """Fresh engine and device state, a faked driver and clock, a 50 ms window."""
    fake = seams.enter_context(testing.fake_cuda(FakeCaptureDriver(), ("driver",)))
    seams.enter_context(testing.fake_runtime(caps=H200))
    kvcopy.config.traffic_window_ms = 50
    return fake


STREAMS = {"h2d": 8, "d2h": 7}  # loads and stores each on a stream of their own, as engines issue them


def decide_for(
    direction: str, block: int = 256 * KiB, stream: int | None = None, count: int = 256, **kwargs
) -> str:
    kwargs.setdefault("note_traffic", True)
    handle = STREAMS[direction] if stream is None else stream
    return decide.decide(handle, "auto", count, count * block, FOUND[direction], **kwargs).decision.method


def test_a_load_right_after_a_store_goes_to_the_copy_engines_and_so_does_the_next_store(engine_state, clock):
    assert decide_for("d2h") == "kernel"  # nothing the other way yet
    assert decide_for("h2d") == "batch"  # the store just now
    assert decide_for("d2h") == "batch"  # the load just now
    assert decide_for("h2d", 16 * KiB) == "kernel"  # small blocks keep the kernel
    clock.now += 0.051  # past the window: each alone again
    assert decide_for("h2d") == "kernel"
    assert decide.last_decision().method == "kernel"


def test_the_remembered_answer_follows_the_other_way(engine_state, clock):
    assert decide_for("h2d") == "kernel"
    assert decide_for("d2h") == "batch"
    clock.now += 1.0
    assert decide_for("d2h") == "kernel"  # the same question, alone: asked again
    assert decide_for("h2d") == "batch"  # beside the store just now


def test_the_other_way_on_the_same_stream_does_not_count(engine_state, clock):
    assert decide_for("d2h", stream=9) == "kernel"
    assert decide_for("h2d", stream=9) == "kernel"  # queued behind the store: never both at once
    assert decide_for("d2h", stream=9) == "kernel"
    assert decide_for("h2d") == "batch"  # another stream: both at once


def test_a_small_batch_the_other_way_leaves_a_large_one_on_the_kernel(engine_state, clock):
    assert decide_for("d2h", count=16) == "kernel"  # 4 MiB of 256 KiB blocks
    assert decide_for("h2d") == "kernel"  # 64 MiB: the store is long over
    assert decide_for("d2h", count=64) == "batch"  # 16 MiB beside the 64 MiB load just now


def test_the_per_thread_default_stream_is_another_stream_in_each_thread(engine_state, clock):
    # (the legacy stream 0x1 never gets batched DMA; 0x2 is each thread's own stream)
    assert decide_for("d2h", stream=2) == "kernel"
    assert decide_for("h2d", stream=2) == "batch"


def test_the_window_is_on_by_default_and_the_environment_sets_it(monkeypatch):
    from kvcopy.config import Config

    monkeypatch.delenv("KVCOPY_TRAFFIC_WINDOW_MS", raising=False)
    assert Config().traffic_window_ms == 50
    monkeypatch.setenv("KVCOPY_TRAFFIC_WINDOW_MS", "0")
    assert Config().traffic_window_ms == 0


def test_explicit_methods_note_their_traffic_but_do_not_look(engine_state, clock):
    traffic_window.note(0, "d2h")
    target = decide.decide(STREAMS["h2d"], "kernel", 256, 256 * 256 * KiB, FOUND["h2d"], note_traffic=True)
    assert target.decision.method == "kernel" and not target.request.other_way_recent
    assert decide_for("d2h") == "batch"  # the explicit load was noted


def test_copy_both_ways_and_a_window_of_0_neither_note_nor_look(engine_state, clock):
    assert decide_for("d2h", note_traffic=False) == "kernel"
    assert traffic_window._last == {}
    kvcopy.config.traffic_window_ms = 0
    assert decide_for("d2h") == "kernel"
    assert decide_for("h2d") == "kernel"
    assert traffic_window._last == {}


def test_capture_neither_notes_nor_looks(engine_state, clock):
    traffic_window.note(0, "d2h")
    engine_state.capturing = 1
    assert decide_for("h2d") == "kernel"  # (batched DMA would be left out of the graph)
    assert traffic_window._last.keys() == {(0, "d2h")}


def test_the_setting_is_checked():
    saved = kvcopy.config.traffic_window_ms
    try:
        with pytest.raises(ValueError, match="traffic_window_ms"):
            kvcopy.config.traffic_window_ms = -1
        with pytest.raises(TypeError):
            kvcopy.config.traffic_window_ms = "50ms"
    finally:
        kvcopy.config.traffic_window_ms = saved
    assert kvcopy.config.traffic_window_ms == saved


class Asked(Exception):
    """Raised by the spy in place of deciding: the call is over once it asked."""


class DescribingDriver(FakeCaptureDriver):
    """The driver and the describe pass of a one-copy batch from GPU to host."""

    DESCRIPTOR_BYTES = 32

    def describe_copies(self, *args) -> DescribedBatch:
        return DescribedBatch(1, 4096, 1, *FOUND["d2h"])


def test_copy_batch_and_swap_blocks_ask_with_their_traffic_noted(monkeypatch, seams):
    asked = []

    def spy(*args, **kwargs):
        asked.append(kwargs.get("note_traffic"))
        raise Asked

    monkeypatch.setattr(dispatch, "decide", spy)
    monkeypatch.setattr(engine.blocks, "decide", spy)
    seams.enter_context(testing.fake_cuda(DescribingDriver(), ("driver", "describe")))
    seams.enter_context(testing.fake_runtime(scope=FakeScope))
    one = np.ones(1, dtype=np.uint64)
    with pytest.raises(Asked):
        dispatch.execute_arrays(one, one, one * 4096, 7)
    seams.enter_context(testing.fake_cuda(FakeClassify([FOUND["d2h"]]), ("classify",)))
    zeros = np.zeros(1, dtype=np.uint64)
    blocks = types.SimpleNamespace(
        num_pairs=1,
        num_copies=1,
        total_bytes=4096,
        geometry=types.SimpleNamespace(
            src_base=zeros, dst_base=zeros, src_extent=zeros, dst_extent=zeros, key=None
        ),
        owners=(),
        memory=None,
    )
    with pytest.raises(Asked):
        engine.blocks.execute_blocks(blocks, 7)
    assert asked == [True, True]
