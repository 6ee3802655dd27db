"""The engine remembers the policy's answers per question (CPU, faked driver): the
same batch shape asks the policy once, and anything the answer depends on
(sizes, capture, stream, memory, a calibration) asks again."""

from __future__ import annotations

import pytest

from kvcopy.testing import cuda

kv_classify = cuda.classify
from kvcopy import policy, testing
from kvcopy.testing import engine

decide = engine.decide
device = engine.device
from kvcopy.interop.streams import STREAM_LEGACY
from kvcopy.policy import DeviceCaps, Thresholds
from helpers.cpu_fakes import FakeCaptureDriver

MiB = 1 << 20
H2D = decide.MemoryClasses(kv_classify.KIND_HOST_MAPPED, -1, kv_classify.KIND_DEVICE, 0)
PAGEABLE = decide.MemoryClasses(kv_classify.KIND_HOST_UNMAPPED, -1, kv_classify.KIND_DEVICE, 0)


class Questions(list):
    """The requests the policy was asked, and the faked driver."""

    driver: "FakeCaptureDriver"


@pytest.fixture
def asked(monkeypatch, seams):
    """Fresh engine and device state; returns the list of questions the policy got."""
    questions = Questions()
    real = policy.choose_method

    def counting(request, caps, thresholds=None, requested="auto"):
        questions.append(request)
        return real(request, caps, thresholds, requested)

    fake = seams.enter_context(testing.fake_cuda(FakeCaptureDriver(), ("driver",)))
    monkeypatch.setattr(decide, "choose_method", counting)
    monkeypatch.setattr(policy, "choose_method", counting)  # (depends_on_other_way's question)
    seams.enter_context(testing.fake_runtime())
    questions.driver = fake
    return questions


def test_the_same_question_asks_the_policy_once_and_still_reports_the_decision(asked):
    first = decide.decide(7, "auto", 8192, 8192 * 16384, H2D)
    decide._last.decision = None
    second = decide.decide(7, "auto", 8192, 8192 * 16384, H2D)
    assert len(asked) == 1
    assert second is first and first.decision.method == "kernel"
    assert decide.last_decision() is first.decision


@pytest.mark.parametrize("change", ["sizes", "count", "stream", "method", "memory"])
def test_a_different_question_asks_again(asked, change):
    decide.decide(7, "auto", 64, 64 * 2 * MiB, H2D)
    args = {"handle": 7, "method": "auto", "count": 64, "total_bytes": 64 * 2 * MiB, "found": H2D}
    args.update(
        {
            "sizes": {"total_bytes": 64 * 16384},
            "count": {"count": 1},
            "stream": {"handle": STREAM_LEGACY},
            "method": {"method": "loop"},
            "memory": {"found": PAGEABLE},
        }[change]
    )
    target = decide.decide(args["handle"], args["method"], args["count"], args["total_bytes"], args["found"])
    assert len(asked) == 2
    expected = {"sizes": "kernel", "count": "loop", "stream": "kernel", "method": "loop", "memory": "batch"}[
        change
    ]
    assert target.decision.method == expected


def test_capture_is_asked_every_call(asked):
    assert decide.decide(7, "auto", 64, 64 * 2 * MiB, H2D).decision.method == "batch"
    asked.driver.capturing = 1
    assert decide.decide(7, "auto", 64, 64 * 2 * MiB, H2D).decision.method == "kernel"
    assert len(asked) == 2


def test_new_thresholds_are_heeded_at_once(asked):
    assert decide.decide(7, "auto", 64, 64 * 2 * MiB, H2D).decision.method == "batch"
    device.set_thresholds(0, Thresholds(batch_min_bytes={"h2d": 4 * MiB, "d2h": 4 * MiB}))
    assert decide.decide(7, "auto", 64, 64 * 2 * MiB, H2D).decision.method == "kernel"
    assert len(asked) == 2


def test_the_memory_kept_is_bounded(asked):
    for count in range(2, decide._TARGETS_KEPT + 50):
        decide.decide(7, "auto", count, count * 16384, H2D)
    assert len(decide._targets) <= decide._TARGETS_KEPT


def test_memory_of_another_gpu_is_a_peer_copy(asked):
    peer = decide.MemoryClasses(kv_classify.KIND_DEVICE, 0, kv_classify.KIND_PEER, 1)
    target = decide.decide(7, "auto", 64, 64 * 16384, peer, capturing=False)
    assert target.request.direction == "p2p" and target.request.devices == (0, 1)
    assert target.request.device_accessible and target.decision.method == "kernel"


def test_unreachable_peer_memory_goes_by_dma_and_says_why(asked, monkeypatch):
    from kvcopy.testing import engine

    peers = engine.peers

    monkeypatch.setattr(peers, "why_unreachable", lambda here, found: f"peers {found} from {here}")
    peer = decide.MemoryClasses(kv_classify.KIND_PEER_UNMAPPED, 1, kv_classify.KIND_DEVICE, 0)
    target = decide.decide(7, "auto", 64, 64 * 16384, peer, capturing=False)
    assert target.request.direction == "p2p" and not target.request.device_accessible
    assert target.decision.method == "batch"
    assert target.request.unreachable == "peers [1] from 0"


def test_peer_copies_get_their_own_cta_budget(asked, monkeypatch):
    from kvcopy.config import config

    peer = decide.MemoryClasses(kv_classify.KIND_DEVICE, 0, kv_classify.KIND_PEER, 1)
    target = decide.decide(7, "auto", 64, 64 * 16384, peer, capturing=False)
    assert target.ctas(None) == min(policy.PEER_CTAS, DeviceCaps().sm_count)
    config.peer_ctas = 12
    assert target.ctas(None) == 12 and target.ctas(3) == 3


def test_stores_by_dma_is_heeded_at_once(asked, monkeypatch):
    from kvcopy.config import config

    store = decide.MemoryClasses(kv_classify.KIND_DEVICE, 0, kv_classify.KIND_HOST_MAPPED, -1)
    assert decide.decide(7, "auto", 64, 64 * 16384, store).decision.method == "kernel"
    config.stores_by_dma = True
    assert decide.decide(7, "auto", 64, 64 * 16384, store).decision.method == "batch"
    assert asked[-1].stores_by_dma and asked[-1].direction == "d2h"
    config.stores_by_dma = False
    assert decide.decide(7, "auto", 64, 64 * 16384, store).decision.method == "kernel"
    assert len(asked) == 2  # the first answer was remembered


@pytest.mark.parametrize(
    "block, method, free",
    [
        (256 << 10, "auto", False),  # the copy engines while the other way copies, else the kernel
        (16 << 10, "auto", True),  # the kernel either way
        (256 << 10, "kernel", True),  # asked for: traffic is not part of the question
    ],
)
def test_a_target_says_whether_traffic_could_change_it(asked, monkeypatch, block, method, free):
    """kvcopy._engine.replay replays only launches whose decision the other direction's
    traffic cannot change (Target.traffic_free), asked once per question."""
    from kvcopy import config
    from kvcopy.testing import engine

    traffic_window = engine.traffic_window

    config.traffic_window_ms = 50
    traffic_window.forget()
    target = decide.decide(7, method, 16, 16 * block, H2D, note_traffic=True)
    again = decide.decide(7, method, 16, 16 * block, H2D, note_traffic=True)
    traffic_window.forget()
    assert target.decision.method == "kernel" and again is target
    assert target.traffic_free is free
    assert len(asked) == (1 if method != "auto" else 2)  # the other answer asked on a miss only


def test_a_batch_too_large_to_replay_asks_the_policy_once(asked, monkeypatch):
    """Whether traffic could change the answer matters only to replays, so a batch
    larger than any record is asked once, and says it was not asked."""
    from kvcopy import config
    from kvcopy.testing import engine

    replay, traffic_window = engine.replay, engine.traffic_window

    config.traffic_window_ms = 50
    traffic_window.forget()
    count = replay.MAX_COPIES + 1
    target = decide.decide(7, "auto", count, count * 16384, H2D, note_traffic=True)
    traffic_window.forget()
    assert target.decision.method == "kernel" and target.traffic_free is None
    assert len(asked) == 1
