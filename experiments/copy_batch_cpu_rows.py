"""CPU time from call to return of copy_batch on the quick benchmark's scattered
rows (pinned pool <-> device pool, NumPy pointer arrays): h2d and d2h at 2 KiB x
32,768, 4 KiB x 16,384 and 16 KiB x 4,096 copies, each call behind a sleep kernel
(a busy stream), median and minimum of CALLS calls. Prints one line per row,
tagged with the first argument, so that two builds of kvcopy can be timed
alternately on one machine (the benchmark's cpu_us is a median of 7, too few to
compare builds by)."""

from __future__ import annotations

import statistics
import sys
import time

import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.workloads import scattered_batch

CALLS = 150
ROWS = ((2048, 32768), (4096, 16384), (16384, 4096))
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU work ahead of each call

tag = sys.argv[1] if len(sys.argv) > 1 else ""
stream = torch.cuda.Stream()


def cpu_us(call) -> tuple[float, float]:
    for _ in range(5):
        call()
    stream.synchronize()
    times = []
    for _ in range(CALLS):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e6)
        stream.synchronize()
    return statistics.median(times), min(times)


for block, count in ROWS:
    _keep, host, gpu, sizes = scattered_batch(count, block)
    for direction, (src, dst) in (("h2d", (host, gpu)), ("d2h", (gpu, host))):
        median, least = cpu_us(lambda: kvcopy.copy_batch(src, dst, sizes, stream=stream))
        print(
            f"{tag} {direction} {block:6d} x {count:6d}: cpu_us median {median:7.1f} "
            f"min {least:7.1f} chose {kvcopy.last_decision().method}",
            flush=True,
        )
