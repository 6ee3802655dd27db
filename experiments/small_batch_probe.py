"""Experiment: do small batches (what a decode step issues) finish sooner with more CTAs?

The copy kernel's CTAs per host direction are the fewest that keep a 64 MiB batch at
0.90 of the contiguous copy (H200: 4 host->GPU, 2 GPU->host; GPU->host 16-64 KiB
blocks go by the bulk copier's 4 CTAs of two warps). A batch of 16-256 blocks is
bound by latency, not by the link: with 64 warps, 16 blocks of 16 KiB take two
PCIe round trips per warp, 256 blocks thirty-two. The quick benchmark's
small_batches rows when this was probed: 16 x 16 KiB host->GPU
27.6 us against the contiguous copy's 14.1; 64 blocks 42.5 against 28.7; 256
blocks 113.2 against 85.3.

Measured here, for CTA counts from the default up, per direction and batch size:
call-to-completion wall (the call, then cuStreamSynchronize on an idle stream,
median of REPEATS), the call's own CPU time, and the contiguous copy's wall, as the
benchmark's small_batches scenario times them.

Run on a GPU: python3 experiments/small_batch_probe.py
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.extra import small_batch_cases
from kvcopy_bench.timing import call_to_completion_us
from kvcopy_bench.scenarios import last_copier, last_method

KiB = 1 << 10
BLOCK = 16 * KiB
COUNTS = (16, 64, 256)
CTAS = (None, 8, 16, 32, 64)
REPEATS = 400


def cpu_us(fn, synchronize, repeats: int = REPEATS) -> float:
    """Median time of the call alone, from an idle stream."""
    times = []
    for _ in range(repeats):
        synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    synchronize()
    return statistics.median(times)


def main() -> None:
    kvcopy.prepare()
    print(
        f"small_batch_probe: {torch.cuda.get_device_name()}, {BLOCK // KiB} KiB blocks, median of {REPEATS}"
    )
    for batch in small_batch_cases(COUNTS, BLOCK):
        direction, count = batch.direction, batch.count
        base = call_to_completion_us(batch.contiguous, batch.synchronize, repeats=REPEATS)
        print(f"{direction} {count:4d} blocks contiguous wall {base:7.1f} us")
        for ctas in CTAS:
            kvcopy.config.host_ctas = ctas
            kvcopy.config.bulk_ctas = ctas
            fn = functools.partial(kvcopy.copy_batch, *batch.ptrs, stream=batch.handle)
            wall = call_to_completion_us(fn, batch.synchronize, repeats=REPEATS)
            cpu = cpu_us(fn, batch.synchronize)
            print(
                f"{direction} {count:4d} blocks ctas {str(ctas or 'default'):>7} "
                f"({last_method()}/{last_copier()}) wall {wall:7.1f} us "
                f"cpu {cpu:6.1f} us  of contiguous {base / wall:.3f}"
            )
        kvcopy.config.host_ctas = None
        kvcopy.config.bulk_ctas = None


if __name__ == "__main__":
    main()
