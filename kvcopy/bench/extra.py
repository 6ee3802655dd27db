"""Scenarios beyond the block sweep: both directions at once, the cost to compute
running beside the copy, and swap_blocks on a realistic paged KV cache."""
from __future__ import annotations

import statistics
import time
import functools
from typing import Any, Callable, Iterator, cast

import numpy as np

import kvcopy
from kvcopy.config import config
from kvcopy.bench.scenarios import Pools, scattered_offsets
from kvcopy.bench.timing import measure, span_ms
from kvcopy.bench.workloads import layered_caches
from kvcopy.policy import RequestedMethod

KiB, MiB = 1 << 10, 1 << 20


def _pointers(pools: Pools, block: int, count: int, seed: int):
    src_off, dst_off = scattered_offsets(count, block, np.random.default_rng(seed))
    return (np.uint64(pools.src.data_ptr()) + src_off.astype(np.uint64),
            np.uint64(pools.dst.data_ptr()) + dst_off.astype(np.uint64),
            np.full(count, block, dtype=np.uint64))


def _both_ways(a: tuple, b: tuple, s1: Any, s2: Any, method: RequestedMethod) -> Callable[[], None]:
    """One call that copies batch a on stream s1 and batch b on stream s2."""
    def run() -> None:
        kvcopy.copy_batch(*a, stream=s1, method=method)
        kvcopy.copy_batch(*b, stream=s2, method=method)
    return run


def bidirectional(block: int = 16 * KiB, total: int = 64 * MiB, repeats: int = 5) -> Iterator[dict]:
    """Host-to-GPU and GPU-to-host at the same time, on two streams: GPU time spanning
    both streams and wall time (call to completion), against two contiguous copies."""
    import torch

    count = total // block
    h2d, d2h = Pools("h2d", total, "torch"), Pools("d2h", total, "torch")
    a, b = _pointers(h2d, block, count, 1), _pointers(d2h, block, count, 2)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def contiguous() -> None:
        with torch.cuda.stream(s1):
            h2d.dst[:total].copy_(h2d.src[:total], non_blocking=True)
        with torch.cuda.stream(s2):
            d2h.dst[:total].copy_(d2h.src[:total], non_blocking=True)
    cases: dict[str, Callable[[], object]] = {"contiguous": contiguous}
    for method in ("auto", "kernel", "batch"):
        cases[method] = _both_ways(a, b, s1, s2, method)
    pair_ms = None
    for name, fn in cases.items():
        times = []
        for i in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        gpu_ms = span_ms(fn, s1, s2, repeats=repeats)
        pair_ms = pair_ms or gpu_ms
        yield {"scenario": "bidirectional", "block_bytes": block, "count": count, "method": name,
               "total_gbps": 2 * total / gpu_ms / 1e6, "of_contiguous_pair": pair_ms / gpu_ms,
               "wall_gbps": 2 * total / seconds / 1e9}


def compute_slowdown(block: int = 16 * KiB, total: int = 256 * MiB, n: int = 8192) -> Iterator[dict]:
    """How much a full-GPU matmul slows while copies run beside it (kernel against DMA)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    compute, copy = torch.cuda.Stream(), torch.cuda.Stream()
    pools = Pools("h2d", total, "torch")
    ptrs = _pointers(pools, block, total // block, 3)

    def matmuls(reps: int = 20) -> tuple[Any, Any]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(compute):
            start.record()
            for _ in range(reps):
                torch.matmul(a, b)
            end.record()
        return start, end

    matmuls(3)
    torch.cuda.synchronize()
    # (label, method, CTAs, threads per CTA): the default kernel and smaller footprints
    variants = [("alone", None, None, None), ("batch", "batch", None, None),
                ("kernel", "kernel", None, None), ("kernel 16x256", "kernel", 16, 256),
                ("kernel 8x512", "kernel", 8, 512)]
    for label, method, ctas, threads in variants:
        saved = config.threads_per_cta
        config.threads_per_cta = threads or saved
        try:
            samples = []
            for _ in range(3):
                start, end = matmuls()
                if method is not None:
                    for _ in range(4):
                        kvcopy.copy_batch(*ptrs, stream=copy, method=cast(RequestedMethod, method),
                                          max_ctas=ctas)
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
        finally:
            config.threads_per_cta = saved
        yield {"scenario": "compute_slowdown", "method": label, "block_bytes": block,
               "matmul_ms": statistics.median(samples)}


def swap_blocks_cache(block_counts=(16, 64, 256, 1024, 4096), repeats: int = 5,
                      batch_max_copies: int | None = None) -> Iterator[dict]:
    """swap_blocks on 32 layers x (K, V), 16-token blocks, 8 heads of 128, bf16 (32 KiB blocks).

    Batched DMA is measured beside auto up to ``batch_max_copies`` block copies
    (it costs ~2 us of CPU per copy: 4096 blocks x 64 tensors take half a second)."""
    import torch

    layers, blocks = 32, max(block_counts)   # each call moves up to every block of the cache
    gpu, host = layered_caches(blocks, layers)
    stream = torch.cuda.Stream()
    block_bytes = 16 * 8 * 128 * 2
    rng = np.random.default_rng(4)
    for n in block_counts:
        mapping = np.stack([rng.choice(blocks, n, replace=False),
                            rng.choice(blocks, n, replace=False)], axis=1)
        nbytes = n * block_bytes * 2 * layers
        for direction, (src, dst) in {"d2h": (gpu, host), "h2d": (host, gpu)}.items():
            for method in ("auto", "batch"):
                if method == "batch" and batch_max_copies and n * 2 * layers > batch_max_copies:
                    continue
                chose = kvcopy.swap_blocks(src, dst, mapping, stream=stream, method=method)
                t = measure(functools.partial(kvcopy.swap_blocks, src, dst, mapping, stream=stream,
                                              method=method), stream, repeats=repeats)
                yield {"scenario": "swap_blocks", "direction": direction, "blocks": n,
                       "tensors": 2 * layers, "method": method, "chose": chose,
                       "gbps": nbytes / (t.gpu_ms * 1e6), "wall_gbps": nbytes / (t.wall_ms * 1e6),
                       "cpu_us": t.cpu_us}


def small_batches(counts=(16, 64, 256), block: int = 16 * KiB, repeats: int = 200) -> Iterator[dict]:
    """What a decode step issues: tens of blocks. Call-to-completion wall time (the
    call, then a stream synchronize, from an idle stream), median of ``repeats``,
    against one contiguous copy of the same bytes."""
    import torch

    stream = torch.cuda.Stream()
    for direction in ("h2d", "d2h"):
        pools = Pools(direction, max(counts) * block, "torch")
        for count in counts:
            ptrs = _pointers(pools, block, count, count)
            nbytes = count * block

            def contiguous() -> None:
                with torch.cuda.stream(stream):
                    pools.dst[:nbytes].copy_(pools.src[:nbytes], non_blocking=True)
            cases: dict[str, Callable[[], object]] = {"contiguous": contiguous}
            for method in ("auto", "kernel", "batch"):
                cases[method] = functools.partial(kvcopy.copy_batch, *ptrs, stream=stream,
                                                  method=cast(RequestedMethod, method))
            walls = {}
            for name, fn in cases.items():
                for _ in range(5):
                    fn()
                stream.synchronize()
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    stream.synchronize()
                    times.append((time.perf_counter() - t0) * 1e6)
                walls[name] = statistics.median(times)
            for name, us in walls.items():
                yield {"scenario": "small_batches", "direction": direction, "blocks": count,
                       "block_bytes": block, "method": name, "wall_us": us,
                       "wall_gbps": nbytes / us / 1e3,
                       "of_contiguous_wall": walls["contiguous"] / us}
