"""Memory kvcopy frees while a CUDA graph is being captured (a pinned array's last
reference dropped, or the collector running, on the capturing thread or beside it)
leaves that capture valid: the graph ends, replays and moves every byte."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import numpy as np
import pytest

import kvcopy
from kvcopy.testing import cuda


class _Cycle:
    """Holds a pinned array in a reference cycle: only the collector frees it."""

    def __init__(self, nbytes: int) -> None:
        self.me = self
        self.array = kvcopy.pinned_empty(nbytes)


def _capture_a_copy_while(torch, free) -> None:
    """Capture a device-to-device copy in torch's default (global) capture mode, call
    ``free`` in the middle of the capture, then replay and check the bytes."""
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    ptrs = np.arange(0, 1 << 20, 1 << 16)
    sizes = np.full(len(ptrs), 1 << 15)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kvcopy.copy_batch(src.data_ptr() + ptrs, dst.data_ptr() + ptrs, sizes, stream=stream)
        free()
    assert dst.sum().item() == 0  # nothing ran during capture
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst.view(16, -1)[:, : 1 << 15], src.view(16, -1)[:, : 1 << 15])


@contextlib.contextmanager
def _collector_held():
    """Garbage earlier tests left may make calls that a global-mode capture forbids
    when collected (a torch CUDAGraph does: docs/usage.md, Graph capture), invalidating
    the capture: collect it first, then keep the collector from running on its own, so
    that a capture sees kvcopy's frees and no other."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def test_a_pinned_array_collected_during_a_capture_leaves_it_valid(torch_cuda):
    with _collector_held():
        garbage = _Cycle(1 << 20)
        alive = weakref.ref(garbage)
        del garbage

        def collect() -> None:
            assert alive() is not None
            gc.collect()
            assert alive() is None

        _capture_a_copy_while(torch_cuda, collect)


def test_a_pinned_array_dropped_on_another_thread_during_a_capture_leaves_it_valid(torch_cuda):
    held = [kvcopy.pinned_empty(1 << 20)]

    def drop_on_another_thread() -> None:
        worker = threading.Thread(target=held.clear)
        worker.start()
        worker.join()

    with _collector_held():
        _capture_a_copy_while(torch_cuda, drop_on_another_thread)
    assert held == []


@pytest.mark.parametrize("free", ["host", "device"])
def test_a_free_leaves_the_threads_capture_mode_as_it_was(torch_cuda, free):
    from cuda.bindings import driver

    modes = driver.CUstreamCaptureMode
    torch_cuda.zeros(1, device="cuda")
    ptr = cuda.memory.host_alloc(4096) if free == "host" else cuda.memory.mem_alloc(4096)
    err, previous = driver.cuThreadExchangeStreamCaptureMode(modes.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    assert err == driver.CUresult.CUDA_SUCCESS
    try:
        (cuda.memory.host_free if free == "host" else cuda.memory.mem_free)(ptr)
    finally:
        err, during = driver.cuThreadExchangeStreamCaptureMode(previous)
    assert during == modes.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
