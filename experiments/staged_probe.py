"""Experiment: loads from and stores to contiguous host memory through a GPU staging
buffer, both directions at once.

Why: scripts/link_budget.py found that SM copies both ways stop near 0.8 of the
contiguous pair because the SMs' 128-byte reads of host memory queue behind the
other direction's stores, while the copy engines reach 1.00 both ways and 0.94 with
the load on the engines beside a 4-CTA kernel store. The engines cost CPU per copy,
which rules them out for scattered small blocks. But where the host side of a batch
is one contiguous span (LMCache's chunks; a host pool whose blocks were handed out
in order), the engines need one copy per chunk: the host span is copied whole to a
GPU staging buffer and the GPU's scattered blocks are written from there by the copy
kernel inside the GPU (or gathered into it first, for a store), at HBM speed.

Measured here for 4, 16 and 64 KiB blocks, 64 MiB each way, GPU blocks scattered in a
pool twice that size, host side contiguous: GPU time (from a common start to the end
of both directions) and wall (call to completion), as fractions of the contiguous
pair's (and one way of the contiguous copy's), for
  copy_both_ways, and copy_batch on two streams: what kvcopy does now;
  staged load + kernel store, kernel load + staged store, both staged;
  one way: staged against the kernel.
Staging: STAGES buffers of CHUNK bytes per direction, copy engines on a stream of their
own, events between the two. Every staged case checks its bytes once.

Run on a GPU: python3 experiments/staged_probe.py [chunk MiB ...]
"""

from __future__ import annotations

import sys
from typing import Callable

import numpy as np
import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.timing import call_to_completion_us

from serving_probe import TOTAL, KiB, MiB, per_stream_ms  # scripts/

STAGES = 2


class Direction:
    """One direction's caller stream, copy-engine stream, staging buffers and events."""

    def __init__(self, chunk: int) -> None:
        self.main, self.dma = torch.cuda.Stream(), torch.cuda.Stream()
        self.chunk = chunk
        self.staging = [torch.empty(chunk, dtype=torch.uint8, device="cuda") for _ in range(STAGES)]
        self.filled = [torch.cuda.Event() for _ in range(STAGES)]
        self.freed = [torch.cuda.Event() for _ in range(STAGES)]


class Layout:
    """A paged GPU cache per direction and a contiguous pinned host span per direction:
    the load writes host_in's blocks, in order, to GPU blocks ``load_ids`` of
    gpu_load; the store reads GPU blocks ``store_ids`` of gpu_store into host_out."""

    def __init__(self, block: int, chunk: int) -> None:
        self.block, self.n = block, TOTAL // block
        rng = np.random.default_rng(block)
        self.host_in = torch.randint(0, 255, (TOTAL,), dtype=torch.uint8).pin_memory()
        self.host_out = torch.zeros(TOTAL, dtype=torch.uint8).pin_memory()
        self.gpu_load = torch.zeros(2 * TOTAL, dtype=torch.uint8, device="cuda")
        self.gpu_store = torch.randint(0, 255, (2 * TOTAL,), dtype=torch.uint8, device="cuda")
        self.load_ids = rng.permutation(2 * self.n)[: self.n]
        self.store_ids = rng.permutation(2 * self.n)[: self.n]
        self.load, self.store = Direction(chunk), Direction(chunk)
        sizes = np.full(self.n, block, np.uint64)
        self.sizes = sizes
        self.host_in_ptrs = (self.host_in.data_ptr() + np.arange(self.n) * block).astype(np.uint64)
        self.host_out_ptrs = (self.host_out.data_ptr() + np.arange(self.n) * block).astype(np.uint64)
        self.gpu_load_ptrs = (self.gpu_load.data_ptr() + self.load_ids * block).astype(np.uint64)
        self.gpu_store_ptrs = (self.gpu_store.data_ptr() + self.store_ids * block).astype(np.uint64)
        per_chunk = chunk // block
        # per chunk: the range of copies, and the staging buffer's block addresses
        self.chunks = [(start, min(start + per_chunk, self.n)) for start in range(0, self.n, per_chunk)]
        self.staging_ptrs = [
            [
                (d.staging[k].data_ptr() + np.arange(per_chunk) * block).astype(np.uint64)
                for k in range(STAGES)
            ]
            for d in (self.load, self.store)
        ]

    # ---- what kvcopy does now
    def load_triple(self):
        return self.host_in_ptrs, self.gpu_load_ptrs, self.sizes

    def store_triple(self):
        return self.gpu_store_ptrs, self.host_out_ptrs, self.sizes

    def kernel_load(self) -> None:
        kvcopy.copy_batch(*self.load_triple(), stream=self.load.main)

    def kernel_store(self) -> None:
        kvcopy.copy_batch(*self.store_triple(), stream=self.store.main)

    def copy_both_ways(self) -> None:
        kvcopy.copy_both_ways(self.store_triple(), self.load_triple(), stream=self.load.main)

    # ---- staged
    def staged_load(self) -> None:
        d, block = self.load, self.block
        d.dma.wait_stream(d.main)  # after the work queued before (and the start)
        for k, (start, stop) in enumerate(self.chunks):
            slot, count = k % STAGES, stop - start
            if k >= STAGES:
                d.dma.wait_event(d.freed[slot])
            with torch.cuda.stream(d.dma):
                d.staging[slot][: count * block].copy_(
                    self.host_in[start * block : stop * block], non_blocking=True
                )
            d.filled[slot].record(d.dma)
            d.main.wait_event(d.filled[slot])
            kvcopy.copy_batch(
                self.staging_ptrs[0][slot][:count],
                self.gpu_load_ptrs[start:stop],
                self.sizes[start:stop],
                stream=d.main,
                method="kernel",
            )
            d.freed[slot].record(d.main)

    def staged_store(self) -> None:
        d, block = self.store, self.block
        for k, (start, stop) in enumerate(self.chunks):
            slot, count = k % STAGES, stop - start
            if k >= STAGES:
                d.main.wait_event(d.freed[slot])
            kvcopy.copy_batch(
                self.gpu_store_ptrs[start:stop],
                self.staging_ptrs[1][slot][:count],
                self.sizes[start:stop],
                stream=d.main,
                method="kernel",
            )
            d.filled[slot].record(d.main)
            d.dma.wait_event(d.filled[slot])
            with torch.cuda.stream(d.dma):
                self.host_out[start * block : stop * block].copy_(
                    d.staging[slot][: count * block], non_blocking=True
                )
            d.freed[slot].record(d.dma)
        d.main.wait_stream(d.dma)  # the store is done when its last chunk has landed

    def contiguous_pair(self) -> None:
        with torch.cuda.stream(self.load.main):
            self.gpu_load[:TOTAL].copy_(self.host_in, non_blocking=True)
        with torch.cuda.stream(self.store.main):
            self.host_out.copy_(self.gpu_store[:TOTAL], non_blocking=True)

    def contiguous_load(self) -> None:
        with torch.cuda.stream(self.load.main):
            self.gpu_load[:TOTAL].copy_(self.host_in, non_blocking=True)

    # ---- checks
    def check(self, load: bool, store: bool) -> str:
        torch.cuda.synchronize()
        block, bad = self.block, []
        if load:
            got = self.gpu_load.view(-1, block)[torch.from_numpy(self.load_ids).cuda()]
            if not torch.equal(got.cpu(), self.host_in.view(-1, block)):
                bad.append("load")
        if store:
            want = self.gpu_store.view(-1, block)[torch.from_numpy(self.store_ids).cuda()]
            if not torch.equal(self.host_out.view(-1, block), want.cpu()):
                bad.append("store")
        self.gpu_load.zero_()
        self.host_out.zero_()
        torch.cuda.synchronize()
        return "bytes ok" if not bad else "BYTES WRONG: " + ", ".join(bad)

    def sync(self) -> None:
        for d in (self.load, self.store):
            d.main.synchronize()
            d.dma.synchronize()


def span_ms(layout: Layout, fn: Callable[[], object]) -> float:
    """GPU time from a common start to the end of both caller streams (the staged paths
    join their copy-engine streams into them)."""
    return max(per_stream_ms(fn, layout.load.main, layout.store.main))


def load_ms(layout: Layout, fn: Callable[[], object]) -> float:
    return per_stream_ms(fn, layout.load.main, layout.store.main)[0]


def main(chunks_mib: list[int]) -> None:
    print(
        f"# staged_probe on {torch.cuda.get_device_name()}: host side contiguous, GPU blocks "
        f"scattered; {TOTAL // MiB} MiB each way; {STAGES} staging buffers per direction. "
        "gpu: GPU time, wall: call to completion, as fractions of the contiguous pair's "
        "(one way: of the contiguous copy's)",
        flush=True,
    )
    for chunk in (c * MiB for c in chunks_mib):
        for block in (4 * KiB, 16 * KiB, 64 * KiB):
            measure(Layout(block, chunk))
            torch.cuda.empty_cache()


def timed_cells(
    layout: Layout,
    cases: dict,
    reference_ms: float,
    reference_us: float,
    ms: Callable[[Layout, Callable[[], object]], float],
) -> list[str]:
    """Each case run once and its bytes checked, then its GPU time and wall as fractions
    of the reference's."""
    cells = []
    for name, (fn, load, store) in cases.items():
        try:
            fn()
            verdict = layout.check(load, store)
            gpu = reference_ms / ms(layout, fn)
            wall = reference_us / call_to_completion_us(fn, layout.sync, repeats=30)
            cells.append(f"{name}: gpu {gpu:.3f} wall {wall:.3f} ({verdict})")
        except Exception as exc:  # one case's failure leaves the others measured
            cells.append(f"{name}: FAILED {type(exc).__name__}: {exc}")
    return cells


def measure(layout: Layout) -> None:
    chunk, block = layout.load.chunk, layout.block
    both_cases = {
        "copy_both_ways": (layout.copy_both_ways, True, True),
        "copy_batch x2": (lambda: (layout.kernel_load(), layout.kernel_store()), True, True),
        "staged load + kernel store": (lambda: (layout.staged_load(), layout.kernel_store()), True, True),
        "kernel load + staged store": (lambda: (layout.kernel_load(), layout.staged_store()), True, True),
        "both staged": (lambda: (layout.staged_load(), layout.staged_store()), True, True),
    }
    pair_gpu = span_ms(layout, layout.contiguous_pair)
    pair_wall = call_to_completion_us(layout.contiguous_pair, layout.sync, repeats=30)
    cells = [f"pair {2 * TOTAL / pair_gpu / 1e6:.1f} GB/s"]
    cells += timed_cells(layout, both_cases, pair_gpu, pair_wall, span_ms)
    print(f"both {chunk // MiB} MiB chunks {block // KiB:>2} KiB  " + "  ".join(cells), flush=True)
    one_gpu = load_ms(layout, layout.contiguous_load)
    one_wall = call_to_completion_us(layout.contiguous_load, layout.sync, repeats=30)
    load_cases = {"kernel": (layout.kernel_load, True, False), "staged": (layout.staged_load, True, False)}
    cells = [f"h2d {TOTAL / one_gpu / 1e6:.1f} GB/s"]
    cells += timed_cells(layout, load_cases, one_gpu, one_wall, load_ms)
    print(f"load {chunk // MiB} MiB chunks {block // KiB:>2} KiB  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    torch.cuda.init()
    main([int(a) for a in sys.argv[1:]] or [4])
