"""Staged copies on a real GPU (kvcopy._engine.staged): batches whose host side is a few long
spans, as LMCache keeps its chunks, go through GPU staging buffers. Every block is
checked against torch's gather; ordering against work queued before and after on the
caller's stream, graph capture, the legacy default stream, threads sharing the
buffers, and the cases that stay with the kernel. Skipped without a GPU."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvcopy
from kvcopy.policy import STAGING_MIN_BYTES

KiB, MiB = 1 << 10, 1 << 20
BLOCKS = STAGING_MIN_BYTES // (16 * KiB)  # the smallest batch of 16 KiB blocks staged


class Spans:
    """``count`` GPU blocks at random slots of a pool twice their size, and a pinned
    host buffer holding them in order in ``spans`` runs, one block of gap between runs
    (the gaps must stay untouched)."""

    def __init__(self, torch, block: int, count: int, spans: int = 1, seed: int = 0) -> None:
        self.torch, self.block, self.count = torch, block, count
        per_span = -(-count // spans)
        self.host_ids = np.arange(count) + np.arange(count) // per_span
        host_blocks = int(self.host_ids[-1]) + 1
        rng = np.random.default_rng(seed)
        self.gpu_ids = rng.permutation(2 * count)[:count]
        gen = torch.Generator().manual_seed(seed)
        self.host = torch.randint(
            0, 256, (host_blocks * block,), dtype=torch.uint8, generator=gen
        ).pin_memory()
        self.gpu = torch.randint(0, 256, (2 * count * block,), dtype=torch.uint8, generator=gen).cuda()
        self.host_before = self.host.clone()

    def pointers(self, tensor, ids: np.ndarray) -> np.ndarray:
        return np.uint64(tensor.data_ptr()) + (ids * self.block).astype(np.uint64)

    def sizes(self) -> np.ndarray:
        return np.full(self.count, self.block, dtype=np.uint64)

    def load(self) -> tuple:
        return self.pointers(self.host, self.host_ids), self.pointers(self.gpu, self.gpu_ids), self.sizes()

    def store(self) -> tuple:
        return self.pointers(self.gpu, self.gpu_ids), self.pointers(self.host, self.host_ids), self.sizes()

    def host_blocks(self):
        self.torch.cuda.synchronize()
        return self.host.view(-1, self.block)[self.torch.from_numpy(self.host_ids)]

    def gpu_blocks(self):
        ids = self.torch.from_numpy(self.gpu_ids).cuda()
        return self.gpu.view(-1, self.block)[ids].cpu()

    def check(self) -> None:
        """The host blocks equal the GPU blocks, and the gaps are as they were."""
        assert self.torch.equal(self.host_blocks(), self.gpu_blocks())
        gaps = np.setdiff1d(np.arange(self.host.numel() // self.block), self.host_ids)
        if len(gaps):
            index = self.torch.from_numpy(gaps)
            assert self.torch.equal(
                self.host.view(-1, self.block)[index], self.host_before.view(-1, self.block)[index]
            )


@pytest.fixture
def staging_bytes():
    """Restores config.staging_bytes after a test that changes it."""
    saved = kvcopy.config.staging_bytes
    yield
    kvcopy.config.staging_bytes = saved


@pytest.mark.parametrize(
    "direction, block, spans",
    [
        ("h2d", 4 * KiB, 1),
        ("h2d", 64 * KiB, 8),
        ("h2d", 16 * KiB, 4),
        ("d2h", 16 * KiB, 1),
        ("d2h", 64 * KiB, 8),
        ("d2h", 4 * KiB, 4),
    ],
)
def test_one_way_batches_of_long_host_spans_are_staged(torch_cuda, direction, block, spans):
    torch = torch_cuda
    s = Spans(torch, block, STAGING_MIN_BYTES // block, spans, seed=block + spans)
    stream = torch.cuda.Stream()
    batch = s.load() if direction == "h2d" else s.store()
    assert kvcopy.copy_batch(*batch, stream=stream) == "staged"
    decision = kvcopy.last_decision()
    assert decision is not None and decision.method == "staged"
    assert f"{spans} span(s)" in decision.reason
    stream.synchronize()
    s.check()


def test_small_chunks_reuse_each_buffer_many_times_in_one_call_and_across_calls(torch_cuda, staging_bytes):
    """16 KiB blocks in chunks of 4 (64 KiB + 4 KiB of buffer), the smallest batch
    staged: a store out to the host
    and, queued right behind it on the same stream, a load of those host blocks into
    other GPU blocks, three rounds without waiting: every round's bytes right."""
    torch = torch_cuda
    kvcopy.config.staging_bytes = 68 * KiB
    stream = torch.cuda.Stream()
    rounds = []
    for seed in range(3):
        out = Spans(torch, 16 * KiB, STAGING_MIN_BYTES // (16 * KiB), seed=seed)
        back = torch.zeros_like(out.gpu)
        host, gpu, sizes = out.store()[1], out.store()[0], out.sizes()
        perm = np.random.default_rng(seed).permutation(len(sizes))
        again = np.uint64(back.data_ptr()) + (perm * 16 * KiB).astype(np.uint64)
        assert kvcopy.copy_batch(gpu, host, sizes, stream=stream) == "staged"
        assert kvcopy.copy_batch(host, again, sizes, stream=stream) == "staged"
        rounds.append((out, back, perm))
    stream.synchronize()
    for out, back, perm in rounds:
        out.check()
        assert torch.equal(back.view(-1, 16 * KiB)[torch.from_numpy(perm).cuda()].cpu(), out.gpu_blocks())


def test_both_ways_are_staged_and_ordered_between_the_work_before_and_after(torch_cuda):
    torch = torch_cuda
    out, into = Spans(torch, 16 * KiB, BLOCKS, seed=1), Spans(torch, 16 * KiB, BLOCKS, seed=2)
    want_loaded = into.host_blocks().clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out.gpu.add_(1)  # queued before: the store sees it
        ran = kvcopy.copy_both_ways(out.store(), into.load(), stream=stream)
        ids = torch.from_numpy(into.gpu_ids).cuda()
        after = into.gpu.view(-1, 16 * KiB)[ids].clone()  # queued after: sees the load
    assert ran == ("staged", "staged")
    stream.synchronize()
    out.check()
    assert torch.equal(after.cpu(), want_loaded)


def test_both_ways_a_side_planned_whole_beside_one_planned_chunk_by_chunk(torch_cuda):
    """A store of 64 KiB blocks (several tiles each: planned whole, its descriptors
    uploaded) beside a load of 4 KiB blocks (planned chunk by chunk, read in place)."""
    torch = torch_cuda
    out = Spans(torch, 64 * KiB, STAGING_MIN_BYTES // (64 * KiB), spans=2, seed=11)
    into = Spans(torch, 4 * KiB, STAGING_MIN_BYTES // (4 * KiB), spans=3, seed=12)
    want_loaded = into.host_blocks().clone()
    stream = torch.cuda.Stream()
    assert kvcopy.copy_both_ways(out.store(), into.load(), stream=stream) == ("staged", "staged")
    stream.synchronize()
    out.check()
    assert torch.equal(into.gpu_blocks(), want_loaded)


def test_both_ways_with_one_side_scattered_stay_with_the_kernel_pair(torch_cuda):
    torch = torch_cuda
    out, into = Spans(torch, 16 * KiB, BLOCKS, seed=3), Spans(torch, 16 * KiB, BLOCKS, seed=4)
    scattered = np.random.default_rng(5).permutation(len(into.host_ids))
    into.host_ids = into.host_ids[scattered]
    ran = kvcopy.copy_both_ways(out.store(), into.load(), stream=torch.cuda.Stream())
    assert ran == ("kernel", "kernel")
    torch.cuda.synchronize()
    out.check()
    into.check()


def test_captured_after_a_staged_warm_up_call_the_graph_copies_by_the_kernel(torch_cuda):
    """Engines warm up eagerly, then capture: the eager call stages, the capture must
    not (the staging buffers are shared), and a replay moves the bytes written to the
    host after the capture."""
    torch = torch_cuda
    s = Spans(torch, 16 * KiB, BLOCKS, seed=6)
    stream = torch.cuda.Stream()
    assert kvcopy.copy_batch(*s.load(), stream=stream) == "staged"
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        ran = kvcopy.copy_batch(*s.load(), stream=torch.cuda.current_stream())
    assert ran == "kernel"
    s.host.copy_(torch.randint(0, 256, s.host.shape, dtype=torch.uint8))
    graph.replay()
    torch.cuda.synchronize()
    s.check()


def test_the_legacy_default_stream_is_ordered_with_torchs_default_stream(torch_cuda):
    torch = torch_cuda
    s = Spans(torch, 16 * KiB, BLOCKS, seed=7)
    s.gpu.add_(3)  # torch's default stream: the legacy one
    assert kvcopy.copy_batch(*s.store(), stream=0) == "staged"
    s.check()  # (synchronizes the device)


def test_threads_on_streams_of_their_own_share_the_buffers_safely(torch_cuda):
    torch = torch_cuda
    sides = [Spans(torch, 16 * KiB, BLOCKS, seed=10 + k) for k in range(4)]
    errors: list[BaseException] = []

    def work(s: Spans) -> None:
        try:
            stream = torch.cuda.Stream()
            for _ in range(5):
                assert kvcopy.copy_batch(*s.load(), stream=stream) == "staged"
                assert kvcopy.copy_batch(*s.store(), stream=stream) == "staged"
            stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in sides]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for s in sides:
        s.check()


@pytest.mark.parametrize("why", ["staging off", "explicit kernel", "too small", "scattered"])
def test_what_is_not_staged_goes_to_the_kernel(torch_cuda, staging_bytes, why):
    torch = torch_cuda
    s = Spans(torch, 16 * KiB, BLOCKS - 1 if why == "too small" else BLOCKS, seed=20)
    method = "kernel" if why == "explicit kernel" else "auto"
    if why == "staging off":
        kvcopy.config.staging_bytes = 0
    if why == "scattered":
        s.host_ids = np.random.default_rng(21).permutation(s.host_ids)
    assert kvcopy.copy_batch(*s.load(), stream=torch.cuda.Stream(), method=method) == "kernel"
    torch.cuda.synchronize()
    s.check()
