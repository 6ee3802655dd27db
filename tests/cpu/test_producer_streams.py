"""DLPack producers of GPU memory are handed the copy's stream, so that they order
their pending writes before it, and while that stream captures a graph a side stream
of kvcopy's instead: a graph waits for nothing outside it. Host producers are asked
for no ordering, and the copy's stream is not even looked up for them. The driver is
faked."""

from __future__ import annotations

import numpy as np
import pytest

from kvcopy import testing
from kvcopy.errors import CudaError
from kvcopy.interop.tensors import block_layout
from kvcopy.testing import engine
from helpers.cpu_fakes import FakeCaptureDriver, FakeScope

HANDLE = 0x7F0000001000


def producer(device_type: int, asked: list):
    arr = np.arange(64, dtype=np.float32).reshape(4, 16)

    class Producer:
        def __dlpack__(self, **kw):
            asked.append(kw.get("stream"))
            return arr.__dlpack__()

        def __dlpack_device__(self):
            return (device_type, 0)

    return Producer()


@pytest.mark.parametrize(
    "stream, handed", [(HANDLE, HANDLE), (lambda: HANDLE, HANDLE), (lambda: None, -1), (None, -1)]
)
def test_a_gpu_producer_is_handed_the_copys_stream_or_none(stream, handed):
    asked: list = []
    layout = block_layout(producer(2, asked), "src", stream)
    assert asked == [handed]
    assert (layout.num_blocks, layout.block_bytes) == (4, 64)


def test_the_copys_stream_is_not_looked_up_for_a_host_producer():
    asked: list = []

    def stream() -> int:
        raise AssertionError("looked up for host memory")

    block_layout(producer(1, asked), "src", stream)
    assert asked in ([-1], [None])  # (no ordering, as cuda.core hands it to a host producer)


def test_a_failure_to_find_the_stream_is_not_taken_for_a_bad_array():
    def stream() -> int:
        raise CudaError(400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle")

    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_HANDLE"):
        block_layout(producer(2, []), "src", stream)


class Driver(FakeCaptureDriver):
    def __init__(self) -> None:
        self.asked: list[int] = []

    def stream_capture_status(self, handle: int) -> int:
        self.asked.append(handle)
        if self.capturing < 0:
            raise CudaError(201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context")
        return self.capturing


@pytest.fixture
def driver(seams):
    fake = Driver()
    seams.enter_context(testing.fake_cuda(fake, ("driver",)))
    seams.enter_context(testing.fake_runtime(scope=FakeScope))
    return fake


SIDE = 0x5100


def test_producers_are_handed_the_stream_or_under_capture_a_side_stream(driver, seams):
    sides: list = []

    def side_stream(handle: int, index: int = 0) -> int:
        sides.append((handle, index))
        return SIDE + index

    seams.enter_context(testing.fake_runtime(scope=FakeScope, side_stream=side_stream))
    producer_stream = engine.dispatch.producer_stream
    assert producer_stream(HANDLE) == HANDLE
    driver.capturing = 1  # (JAX refuses -1: a stream that does not)
    assert producer_stream(HANDLE) == SIDE + engine.dispatch._PRODUCERS
    assert producer_stream(2) == SIDE + engine.dispatch._PRODUCERS  # per-thread captures too
    assert producer_stream(1) == 1  # the legacy stream never does
    assert driver.asked == [HANDLE, HANDLE, 2]
    assert sides == [(HANDLE, engine.dispatch._PRODUCERS), (2, engine.dispatch._PRODUCERS)]
    driver.capturing = -1  # the copy will name the stream's fault
    assert producer_stream(HANDLE) == HANDLE


def test_a_calls_producers_share_one_answer(driver, seams):
    """Every DLPack producer of one call (a layer's arrays) is handed the stream found
    for the first: the driver is asked once a call, and not before a producer asks."""
    stream = engine.dispatch.producer_stream_once(HANDLE)
    assert driver.asked == []
    handed: list = []
    for _ in range(8):
        block_layout(producer(2, handed), "src", stream)
    assert handed == [HANDLE] * 8
    assert driver.asked == [HANDLE]
    seams.enter_context(testing.fake_runtime(scope=FakeScope, side_stream=lambda handle, index=0: SIDE))
    driver.capturing = 1  # (a new call asks again)
    assert engine.dispatch.producer_stream_once(HANDLE)() == SIDE
    assert driver.asked == [HANDLE, HANDLE]
