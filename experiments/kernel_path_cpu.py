"""CPU time from call to return of copy_batch on the kernel path: 8192 scattered
16 KiB pinned-to-device copies as NumPy pointer arrays, on a busy stream (a sleep
kernel queued ahead, so the GPU never waits for the CPU), median and p25 of
CALLS calls. Prints one line, tagged with the first argument, so that two
builds of kvcopy can be timed alternately on one machine."""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

import kvcopy

try:
    import bench_package  # noqa: F401 - kvcopy_bench's place
    from kvcopy_bench.workloads import scattered_batch
except ImportError:  # a build from before kvcopy_bench.workloads, timed for comparison

    def scattered_batch(count: int, block: int):
        src = torch.empty(2 * count * block, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(2 * count * block, dtype=torch.uint8, device="cuda")
        rng = np.random.default_rng(0)
        s = np.uint64(src.data_ptr()) + (rng.permutation(2 * count)[:count] * block).astype(np.uint64)
        d = np.uint64(dst.data_ptr()) + (rng.permutation(2 * count)[:count] * block).astype(np.uint64)
        return (src, dst), s, d, np.full(count, block, dtype=np.uint64)


CALLS, COUNT, BLOCK = 400, 8192, 16384

_keep, s, d, sizes = scattered_batch(COUNT, BLOCK)
stream = torch.cuda.Stream()
for _ in range(10):
    kvcopy.copy_batch(s, d, sizes, stream=stream)
stream.synchronize()
times = []
for i in range(CALLS):
    if i % 8 == 0:
        stream.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)
    t0 = time.perf_counter()
    kvcopy.copy_batch(s, d, sizes, stream=stream)
    times.append((time.perf_counter() - t0) * 1e6)
stream.synchronize()
times.sort()
tag = (sys.argv[1] if len(sys.argv) > 1 else "") + ":" + kvcopy.__file__
print(
    f"kernel_path_cpu {tag} count={COUNT} median_us={statistics.median(times):.1f} "
    f"p25_us={times[len(times) // 4]:.1f} min_us={times[0]:.1f} method={kvcopy.last_decision().method}"
)
