"""CPU time from call to return of kvcopy.copy_rows with GPU-resident indices: 32
layers x K and V of paged GPU caches (blocks of 16 tokens, 2 KiB rows) gathered by
256 token slots into a pinned chunk, 200 calls each synchronised after; the same
transfer prepared once (kvcopy.prepare_rows) and called 200 times; then a cProfile of
200 more copy_rows calls. Prints the medians and minimums in microseconds."""

from __future__ import annotations

import cProfile
import io
import pstats

import torch

import kvcopy
from kvcopy import Layout
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.timing import call_cpu_us

caches = [torch.empty((2, 64, 16, 2048), dtype=torch.uint8, device="cuda") for _ in range(32)]
chunk = torch.empty((2, 32, 256, 2048), dtype=torch.uint8, pin_memory=True)
slots = torch.randperm(1024, device="cuda")[:256]
src = Layout.of(caches, planes=(0,), page=1, slot=2)
dst = Layout.of(chunk, planes=(1, 0), slot=2)
stream = torch.cuda.Stream()


def call() -> None:
    kvcopy.copy_rows(src, dst, slots, stream=stream)


def cpu_us(fn) -> str:
    """Median and minimum call-to-return microseconds, each call synchronised after."""
    median, least = call_cpu_us(fn, stream.synchronize)
    return f"median {median:.1f} min {least:.1f}"


print(f"copy_rows gpu indices cpu_us {cpu_us(call)}")
print(f"prepare_rows call cpu_us {cpu_us(kvcopy.prepare_rows(src, dst, slots, stream=stream))}")
profile = cProfile.Profile()
profile.enable()
for _ in range(200):
    call()
    stream.synchronize()
profile.disable()
out = io.StringIO()
pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(18)
print(out.getvalue())
