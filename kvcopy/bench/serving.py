"""Copies beside compute, as in a serving step: a full-GPU bf16 matmul loop measured
alone and beside continuous 16 KiB block copies, in alternating pairs (clocks drift by
more than the effect between repeats, so only per-pair ratios mean anything), and a
step with a store (GPU to host) and a load (host to GPU) beside the matmul.

Every window is gated: a sleep kernel holds the GPU while the CPU enqueues all of the
window's work (batched DMA takes milliseconds of CPU per call), then copies and matmuls
start together."""
from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

import kvcopy
from kvcopy.bench.scenarios import Pools, scattered_offsets
from kvcopy.policy import RequestedMethod

KiB, MiB = 1 << 10, 1 << 20
_CYCLES_PER_MS = 2_000_000   # upper bound of the SM clock (H200: 1.98 GHz)


def _pointers(pools: Pools, block: int, count: int, seed: int) -> tuple:
    src_off, dst_off = scattered_offsets(count, block, np.random.default_rng(seed))
    return (np.uint64(pools.src.data_ptr()) + src_off.astype(np.uint64),
            np.uint64(pools.dst.data_ptr()) + dst_off.astype(np.uint64),
            np.full(count, block, dtype=np.uint64))


class _Window:
    """One gated window: ``reps`` matmuls on the compute stream and, beside them, each
    copy stream's calls; returns the GPU ms of the matmuls and of each copy stream."""

    def __init__(self, n: int = 8192, reps: int = 20) -> None:
        import torch

        self.torch = torch
        self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.compute = torch.cuda.Stream()
        self.gate_stream = torch.cuda.Stream()
        self.reps = reps
        self.gate_ms = 20.0

    def run(self, copies: Sequence[tuple[Any, Callable[[], object], int]] = ()) -> tuple[float, list[float]]:
        """copies: (stream, call, calls per window). Returns (matmul ms, [copy ms])."""
        torch = self.torch
        torch.cuda.synchronize()
        event = functools.partial(torch.cuda.Event, enable_timing=True)
        with torch.cuda.stream(self.gate_stream):
            torch.cuda._sleep(int(self.gate_ms * _CYCLES_PER_MS))
        gate = torch.cuda.Event()
        gate.record(self.gate_stream)
        t0 = time.perf_counter()
        marks = []
        for stream, call, calls in copies:
            stream.wait_event(gate)
            start, end = event(), event()
            start.record(stream)
            for _ in range(calls):
                call()
            end.record(stream)
            marks.append((start, end))
        self.compute.wait_event(gate)
        start, end = event(), event()
        with torch.cuda.stream(self.compute):
            start.record()
            for _ in range(self.reps):
                torch.matmul(self.a, self.b)
            end.record()
        enqueue_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        if enqueue_ms > 0.8 * self.gate_ms:   # the gate opened too early: longer next time
            self.gate_ms = 2 * enqueue_ms
        return start.elapsed_time(end), [s.elapsed_time(e) for s, e in marks]


def _spread(ratios: list[float]) -> dict:
    return {"slowdown_median": statistics.median(ratios), "slowdown_min": min(ratios),
            "slowdown_max": max(ratios), "pairs": len(ratios)}


def compute_slowdown(block: int = 16 * KiB, batch_bytes: int = 64 * MiB, pairs: int = 10,
                     footprints: Sequence[int | None] = (None, 8, 4)) -> Iterator[dict]:
    """Matmul slowdown beside continuous host-to-GPU copies of ``block`` bytes: batched
    DMA and the kernel at its default and smaller CTA counts (median of per-pair ratios
    over ``pairs`` alternations, with the spread)."""
    import torch

    window = _Window()
    pools = Pools("h2d", batch_bytes, "torch")
    ptrs = _pointers(pools, block, batch_bytes // block, 3)
    stream = torch.cuda.Stream()
    alone_ms, _ = window.run()
    window.run()
    variants: list[tuple[str, RequestedMethod, int | None]] = [("batch", "batch", None)]
    variants += [(f"kernel {ctas or 'default'} CTAs", "kernel", ctas) for ctas in footprints]
    for label, method, ctas in variants:
        call = functools.partial(kvcopy.copy_batch, *ptrs, stream=stream, method=method,
                                 max_ctas=ctas)
        call()
        torch.cuda.synchronize()
        # enough calls to outlast the matmuls (at ~50 GB/s; DMA's CPU cost is gated)
        calls = max(4, int(1.3 * alone_ms / (batch_bytes / 50e6)))
        window.run([(stream, call, calls)])   # sizes the gate to this variant's CPU cost
        ratios, copy_gbps = [], []
        for _ in range(pairs):
            alone, _ = window.run()
            beside, (copy_ms,) = window.run([(stream, call, calls)])
            ratios.append(beside / alone - 1)
            copy_gbps.append(calls * batch_bytes / copy_ms / 1e6)
        yield {"scenario": "compute_slowdown", "method": label, "block_bytes": block,
               "matmul_alone_ms": alone, "copy_gbps": statistics.median(copy_gbps),
               **_spread(ratios)}


def serving_step(block: int = 16 * KiB, blocks_per_call: int = 1024, pairs: int = 5,
                 methods: Sequence[RequestedMethod] = ("auto", "kernel", "batch")) -> Iterator[dict]:
    """A matmul loop on one stream while a store (GPU to host) and a load (host to GPU)
    of ``block``-byte blocks run on two others: each copy's GB/s (GPU time of its
    stream) and the matmul's slowdown against windows without copies."""
    import torch

    window = _Window()
    nbytes = blocks_per_call * block
    store_pools, load_pools = Pools("d2h", nbytes, "torch"), Pools("h2d", nbytes, "torch")
    store_ptrs = _pointers(store_pools, block, blocks_per_call, 5)
    load_ptrs = _pointers(load_pools, block, blocks_per_call, 6)
    store_stream, load_stream = torch.cuda.Stream(), torch.cuda.Stream()
    alone_ms, _ = window.run()
    calls = max(4, int(1.3 * alone_ms / (nbytes / 45e6)))
    for method in methods:
        store = functools.partial(kvcopy.copy_batch, *store_ptrs, stream=store_stream, method=method)
        load = functools.partial(kvcopy.copy_batch, *load_ptrs, stream=load_stream, method=method)
        chose = (store(), load())
        torch.cuda.synchronize()
        window.run([(store_stream, store, calls), (load_stream, load, calls)])   # sizes the gate
        ratios, store_gbps, load_gbps = [], [], []
        for _ in range(pairs):
            alone, _ = window.run()
            beside, (store_ms, load_ms) = window.run([(store_stream, store, calls),
                                                      (load_stream, load, calls)])
            ratios.append(beside / alone - 1)
            store_gbps.append(calls * nbytes / store_ms / 1e6)
            load_gbps.append(calls * nbytes / load_ms / 1e6)
        yield {"scenario": "serving_step", "method": method, "chose": "/".join(chose),
               "block_bytes": block, "blocks_per_call": blocks_per_call,
               "store_gbps": statistics.median(store_gbps),
               "load_gbps": statistics.median(load_gbps), **_spread(ratios)}
