"""Experiment: a store and a load at once with part of the load on the copy engines.

Below 128 KiB blocks copy_both_ways runs both sides by the copy kernel and keeps
0.72-0.82 of the contiguous pair: the SMs' 128-byte read requests share the
GPU-to-host lane with the stores' writes (scripts/link_budget.py). The copy engines
keep the link full both ways but cost the CPU about a microsecond or more per copy,
so a whole load on them is slower below 64-128 KiB. Here the kernel starts on the
store and the first part of the load, and while it runs the CPU issues the rest of
the load to the copy engines, 64 copies per cuMemcpyBatchAsync call, on a second
stream: the CPU's time per copy is then hidden behind the kernel's, as far as it
lasts.

For each block size: the contiguous pair, copy_both_ways as it decides now, and the
load split at several fractions (the engines' share), GPU time (work enqueued
behind a sleep, so the CPU's issue is off the clock) and wall (call to completion
from idle streams), both as fractions of the contiguous pair's. Also the CPU time
per copy of batched DMA at each size, which bounds the share the engines can take.

Run on a GPU: python3 experiments/split_load_probe.py
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.timing import call_to_completion_us

from serving_probe import KiB, BothWays, sliced, stream_times_ms  # scripts/

DMA_CALL = 64
SHARES = (0.0, 0.1, 0.25, 0.4, 0.6)


def span_ms(enqueue: Callable[[], object], streams: list) -> float:
    """Median GPU time from a common start to the end of the last of ``streams``."""
    return statistics.median(max(row) for row in stream_times_ms(enqueue, streams))


def dma_cpu_us_per_copy(load: tuple, stream) -> float:
    """CPU time per copy of batched DMA, DMA_CALL copies per call, the stream idle."""
    part = sliced(load, 0, 4 * DMA_CALL)
    times = []
    for _ in range(15):
        stream.synchronize()
        t0 = time.perf_counter()
        for i in range(0, 4 * DMA_CALL, DMA_CALL):
            kvcopy.copy_batch(*sliced(part, i, i + DMA_CALL), stream=stream, method="batch")
        times.append((time.perf_counter() - t0) * 1e6 / (4 * DMA_CALL))
    stream.synchronize()
    return statistics.median(times)


def main(blocks=(4 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB)) -> None:
    both = BothWays()
    s1, s2 = both.s1, both.s2
    s3 = torch.cuda.Stream()

    def sync() -> None:
        torch.cuda.synchronize()

    pair_gpu = max(span_ms(both.contiguous, [s1, s2]), 1e-9)
    pair_wall = call_to_completion_us(both.contiguous, sync, repeats=30)
    print(
        f"# split_load on {torch.cuda.get_device_name()}: contiguous pair "
        f"{pair_gpu * 1e3:.0f} us GPU, {pair_wall:.0f} us wall; cells: GPU time (wall) "
        f"of the pair",
        flush=True,
    )
    for block in blocks:
        load, store = both.batches(block)
        n = len(load[0])
        per_copy = dma_cpu_us_per_copy(load, s1)
        cases: dict[str, tuple[Callable[[], object], list]] = {
            "copy_both_ways": (lambda: kvcopy.copy_both_ways(store, load, stream=s2), [s2])
        }
        for share in SHARES:
            head = n - int(n * share)

            def fused(head: int = head) -> None:
                """One launch for the store and the load's head, the tail by DMA."""
                kvcopy.copy_both_ways(store, sliced(load, 0, head), stream=s2, method="kernel")
                for i in range(head, n, DMA_CALL):
                    kvcopy.copy_batch(*sliced(load, i, min(i + DMA_CALL, n)), stream=s1, method="batch")

            cases[f"fused+dma {share:.2f}"] = (fused, [s2, s1])
            if share:

                def apart(head: int = head) -> None:
                    """The store and the load's head as two kernels, the tail by DMA."""
                    kvcopy.copy_batch(*store, stream=s2, method="kernel", max_ctas=4)
                    kvcopy.copy_batch(*sliced(load, 0, head), stream=s1, method="kernel", max_ctas=8)
                    for i in range(head, n, DMA_CALL):
                        kvcopy.copy_batch(*sliced(load, i, min(i + DMA_CALL, n)), stream=s3, method="batch")

                cases[f"apart+dma {share:.2f}"] = (apart, [s2, s1, s3])
        cells = []
        for name, (fn, streams) in cases.items():
            gpu = pair_gpu / span_ms(fn, streams)
            wall = pair_wall / call_to_completion_us(fn, sync, repeats=20, warmup=3)
            cells.append(f"{name} {gpu:.3f} ({wall:.3f})")
        print(f"split {block // KiB:>3} KiB  dma cpu {per_copy:.2f} us/copy  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    torch.cuda.init()
    main()
