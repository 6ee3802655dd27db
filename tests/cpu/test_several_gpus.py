"""The several-GPU logic that needs no GPU (CPU, faked torch and driver): which
streams are "current" for tensors on two devices, the order in which swap_blocks
joins them, peer copies as a direction, saved thresholds that predate 'p2p', and
the peer-access settings read from the environment."""

from __future__ import annotations

import json
import sys
import types

import pytest

from kvcopy import testing

from kvcopy import blocks
from kvcopy.testing import engine

decide, dispatch = engine.decide, engine.dispatch
device = engine.device
from kvcopy.testing import cuda

kv_classify = cuda.classify
from kvcopy.interop import streams
from kvcopy.config import Config
from kvcopy.policy import DeviceCaps, Thresholds

MiB = 1 << 20


class FakeTensor:
    """Looks like a torch tensor to kvcopy.interop (its type's module is torch's)."""

    def __init__(self, device_index: int | None):
        self.is_cuda = device_index is not None
        self.device = types.SimpleNamespace(index=device_index)

    def get_device(self) -> int:
        return -1 if self.device.index is None else self.device.index


FakeTensor.__module__ = "torch.fake"


@pytest.fixture
def fake_torch(monkeypatch):
    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: False,
        current_device=lambda: 5,
        current_stream=lambda d: types.SimpleNamespace(cuda_stream=0 if d == 1 else 0x100 + d),
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda, _C=types.SimpleNamespace()))
    return cuda


def test_current_streams_read_as_raw_handles_once_torch_has_cuda(fake_torch, monkeypatch):
    # the raw handles must be the ones current_stream() would give, without its objects
    torch = sys.modules["torch"]
    asked = []
    monkeypatch.setattr(
        torch._C, "_cuda_getCurrentRawStream", lambda d: asked.append(d) or 0x200 + d, raising=False
    )
    src, dst = FakeTensor(0), FakeTensor(1)
    assert streams.current_framework_streams(src, dst) == [(0x100, 0), (streams.STREAM_LEGACY, 1)]
    assert asked == []  # (CUDA not initialised by torch: its own Stream objects)
    monkeypatch.setattr(fake_torch, "is_initialized", lambda: True)
    assert streams.current_framework_streams(src, dst) == [(0x200, 0), (0x201, 1)]
    assert asked == [0, 1]


def test_current_streams_of_tensors_on_two_gpus(fake_torch):
    src, dst = FakeTensor(0), FakeTensor(1)
    assert streams.current_framework_streams(src, dst) == [(0x100, 0), (streams.STREAM_LEGACY, 1)]
    assert streams.current_framework_streams(dst, src)[0] == (streams.STREAM_LEGACY, 1)
    assert streams.current_framework_stream(src, dst) == 0x100


def test_current_streams_prefer_the_gpu_tensor_over_a_host_one(fake_torch):
    host, gpu = FakeTensor(None), FakeTensor(3)
    assert streams.current_framework_streams(host, gpu) == [(0x103, 3)]
    assert streams.current_framework_streams(host, FakeTensor(None)) == [(0x105, 5)]


def test_torchs_current_stream_of_its_current_device_as_a_handle(fake_torch, monkeypatch):
    # (vLLM's drop-ins copy there: the same handle as current_stream(), without its object)
    assert streams.torch_current_handle() == 0x105
    monkeypatch.setattr(fake_torch, "is_initialized", lambda: True)
    monkeypatch.setattr(
        sys.modules["torch"]._C, "_cuda_getCurrentRawStream", lambda d: 0x200 + d, raising=False
    )
    assert streams.torch_current_handle() == 0x205
    monkeypatch.setattr(fake_torch, "current_device", lambda: 1)
    assert streams.torch_current_handle() == 0x201


def test_torch_without_cuda_is_asked_once_a_call(fake_torch, monkeypatch):
    asked = []
    monkeypatch.setattr(fake_torch, "is_available", lambda: asked.append(1) or False)
    tensors = [FakeTensor(None) for _ in range(4)]
    assert streams.current_framework_streams(*tensors) == [(streams.STREAM_DEFAULT, -1)]
    assert len(asked) == 1


def test_current_streams_without_a_framework():
    assert streams.current_framework_streams([1, 2], None) == [(streams.STREAM_DEFAULT, -1)]


def test_swap_blocks_between_gpus_joins_streams_like_torch_copy(monkeypatch, seams):
    calls = []
    fake_driver = types.SimpleNamespace(
        init=lambda: None,
        stream_wait_stream=lambda consumer, producer, producer_device, consumer_device: calls.append(
            ("wait", consumer, consumer_device, producer, producer_device)
        ),
    )
    seams.enter_context(testing.fake_cuda(fake_driver, ("driver",)))
    monkeypatch.setattr(
        blocks,
        "execute_blocks",
        lambda plan, handle, method: calls.append(("copy", handle)) or "kernel",
    )
    ran = blocks._between_devices("plan", [(0x100, 0), (0, 1)], "auto")
    legacy = streams.effective_handle(0)
    assert ran == "kernel"
    assert calls == [
        ("wait", 0x100, 0, legacy, 1),  # the copy waits for GPU1's current stream
        ("copy", 0x100),
        ("wait", legacy, 1, 0x100, 0),
    ]  # which then waits for the copy


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        (kv_classify.KIND_DEVICE, kv_classify.KIND_PEER, "p2p"),
        (kv_classify.KIND_PEER_UNMAPPED, kv_classify.KIND_DEVICE, "p2p"),
        (kv_classify.KIND_PEER, kv_classify.KIND_PEER, "p2p"),  # both on other GPUs
        (kv_classify.KIND_DEVICE, kv_classify.KIND_DEVICE, "d2d"),
        (kv_classify.KIND_HOST_MAPPED, kv_classify.KIND_PEER, "h2d"),
        (kv_classify.KIND_PEER, kv_classify.KIND_HOST_MAPPED, "d2h"),
        (kv_classify.KIND_HOST_MAPPED | kv_classify.KIND_PEER, kv_classify.KIND_DEVICE, "mixed"),
    ],
)
def test_directions_with_peer_memory(src, dst, expected):
    assert decide._direction(src, dst) == expected


def test_saved_thresholds_without_p2p_keep_its_default(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(tmp_path))
    info = device.DeviceInfo(0, "Fake GPU", (9, 0), 12080, DeviceCaps())
    device.thresholds_path(info).write_text(json.dumps({"batch_min_bytes": {"h2d": 2 * MiB, "d2h": "inf"}}))
    loaded = device.load_thresholds(info)
    assert loaded.batch_min_bytes == {
        "h2d": 2 * MiB,
        "d2h": float("inf"),
        "p2p": Thresholds().batch_min_bytes["p2p"],
    }


@pytest.mark.parametrize("text, expected", [("0", False), ("1", True), ("", True)])
def test_enable_peer_access_from_the_environment(monkeypatch, text, expected):
    monkeypatch.setenv("KVCOPY_ENABLE_PEER_ACCESS", text)
    assert Config().enable_peer_access is expected


def test_bad_peer_settings_in_the_environment_name_the_variable(monkeypatch):
    monkeypatch.setenv("KVCOPY_ENABLE_PEER_ACCESS", "yes")
    with pytest.raises(ValueError, match="KVCOPY_ENABLE_PEER_ACCESS='yes' is not an integer"):
        Config()
    monkeypatch.setenv("KVCOPY_ENABLE_PEER_ACCESS", "2")
    with pytest.raises(ValueError, match="KVCOPY_ENABLE_PEER_ACCESS=2 is out of range"):
        Config()
    monkeypatch.delenv("KVCOPY_ENABLE_PEER_ACCESS")
    monkeypatch.setenv("KVCOPY_PEER_CTAS", "0")
    with pytest.raises(ValueError, match="KVCOPY_PEER_CTAS=0 is out of range"):
        Config()


def test_queue_between_gpus_waits_for_both_current_streams(fake_torch):
    from kvcopy.queue import TransferQueue

    queue = object.__new__(TransferQueue)
    queue.src, queue.dst = [FakeTensor(0)], [FakeTensor(1)]
    queue._touches_gpu = True
    queue._geometry = types.SimpleNamespace(producer_streams=[0x77])
    legacy = streams.effective_handle(0)
    # the producer's stream (0x77) is waited for by submit, for every job, whatever after says
    assert queue._dependencies(None) == [("stream", 0x100, 0), ("stream", legacy, 1)]
    assert queue._dependencies([0x5500]) == [("stream", 0x5500, -1)]
    queue._touches_gpu = False
    assert queue._dependencies(None) == []


@pytest.mark.parametrize("text, expected", [("0", False), ("1", True), ("", False)])
def test_stores_by_dma_from_the_environment(monkeypatch, text, expected):
    monkeypatch.setenv("KVCOPY_STORES_BY_DMA", text)
    assert Config().stores_by_dma is expected
    monkeypatch.setenv("KVCOPY_STORES_BY_DMA", "2")
    with pytest.raises(ValueError, match="KVCOPY_STORES_BY_DMA=2 is out of range"):
        Config()
    with pytest.raises(TypeError, match="stores_by_dma"):
        Config.__new__(Config).__setattr__("stores_by_dma", "yes")


def test_queue_job_waits_for_producers_once_and_times_only_its_copy(monkeypatch, seams):
    """submit: the job's own waits, then the producers' streams (even with after=[]),
    then the start event, then the copy, which does not wait for them again."""
    import threading
    from collections import deque

    from kvcopy import queue as queue_module
    from kvcopy.queue import TransferQueue

    calls: list[str] = []

    class FakeDriver:
        def push_context(self, ctx):
            calls.append("push")

        def pop_context(self):
            calls.append("pop")

        def event_create(self, timing):
            return 0xE0 + len(calls)

        def event_record(self, event, stream):
            calls.append(f"record on {stream:#x}")

        def stream_wait_stream(self, consumer, producer, device=-1):
            calls.append(f"{consumer:#x} waits for {producer:#x}")

        def stream_wait_event(self, consumer, event):
            calls.append(f"{consumer:#x} waits event")

    def execute_blocks(plan, handle, method, wait_for_producers=True):
        calls.append(f"copy on {handle:#x}, waits for producers: {wait_for_producers}")
        return "kernel"

    seams.enter_context(testing.fake_cuda(FakeDriver(), ("driver",)))
    monkeypatch.setattr(queue_module.blocks, "execute_blocks", execute_blocks)
    queue = object.__new__(TransferQueue)
    queue._lock, queue._closed, queue._pending = threading.Lock(), False, deque()
    queue._ctx, queue._stream, queue.method = 0xC0, 0x5, "auto"
    queue._geometry = types.SimpleNamespace(
        producer_streams=[0x77], with_mapping=lambda mapping: types.SimpleNamespace(total_bytes=4096)
    )
    for after, own in (([0x5500], ["0x5 waits for 0x5500"]), ([], [])):
        calls.clear()
        queue.submit("job", [[0, 0]], after=after)
        assert calls == [
            "push",
            *own,
            "0x5 waits for 0x77",
            "record on 0x5",
            "copy on 0x5, waits for producers: False",
            "record on 0x5",
            "pop",
        ]
