"""Experiment: do the descriptor ring's slot growths wait for the whole GPU?

serving_probe.py serving_blocks got 4.0 + 4.0 GB/s and a +0.0% matmul slowdown for
copy_both_ways of 16 KiB blocks in a fresh process, where the benchmark minutes before
got 31.9 + 31.9 and +2.9%. The suspect: that call needs 256 KiB of descriptors, no
call before had grown the ring's slots past 128 KiB, and each slot, on its first use
at the larger size, frees its old buffers (ring.Slot.ensure -> release:
cuMemFreeHost, cuMemFree) and allocates new ones, which may wait for all work on the
device, here the matmul window.

Measured here, while a sleep kernel of SLEEP_MS runs on another stream: the CPU time
of each driver call a growth makes (cuMemHostAlloc, cuMemAlloc, cuMemFreeHost,
cuMemFree, each on a buffer of 256 KiB), and of copy_batch calls of 4096 then 8192
blocks of 16 KiB (128 and 256 KiB of descriptors) in a fresh process, ring slot by
ring slot. A call that lasts about SLEEP_MS waited for the sleep kernel.

Before those, kvcopy.prepare() beside a sleep kernel: what a process's first copy
does (the device's facts, loading the copy kernel's module, the descriptor ring;
this probe saw the first copy_batch wait 52 ms beside a 50 ms sleep, and
device_info, which loads the module, 49 ms). The copy_batch calls after it then show
whether anything else in a first copy waits.

Run on a GPU: python3 experiments/alloc_sync_probe.py
"""

from __future__ import annotations

import time

import torch

import kvcopy
from kvcopy.testing import cuda

kv_driver, kv_memory = cuda.driver, cuda.memory
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.workloads import scattered_batch

SLEEP_MS = 50
NBYTES = 256 << 10


_cycles_per_ms: list[float] = []


def _sleep_beside() -> torch.cuda.Stream:
    """A stream running a sleep kernel of about SLEEP_MS from now."""
    cycles = int(SLEEP_MS * _cycles_per_millisecond())
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(cycles)
    return busy


def _cycles_per_millisecond() -> float:
    """The sleep kernel's cycles per millisecond, timed once with events."""
    if not _cycles_per_ms:
        cycles = 10_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _cycles_per_ms.append(cycles / start.elapsed_time(end))
    return _cycles_per_ms[0]


def _timed_us(call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e6


def driver_calls() -> None:
    for name, make, free in (
        ("cuMemHostAlloc / cuMemFreeHost", kv_memory.host_alloc, kv_memory.host_free),
        ("cuMemAlloc / cuMemFree", kv_memory.mem_alloc, kv_memory.mem_free),
    ):
        torch.cuda.synchronize()
        busy = _sleep_beside()
        holder: list[int] = []
        alloc_us = _timed_us(lambda: holder.append(make(NBYTES)))
        free_us = _timed_us(lambda: free(holder[0]))
        print(
            f"beside a {SLEEP_MS} ms sleep: {name}: allocate {alloc_us:9.1f} us, "
            f"free {free_us:9.1f} us, sleep still running after: {not busy.query()}",
            flush=True,
        )
        busy.synchronize()


def first_call_steps() -> None:
    """kvcopy.prepare() beside a sleep: what a process's first copy would do (the
    device's facts, the copy kernel's module, the descriptor ring)."""
    torch.cuda.synchronize()
    busy = _sleep_beside()
    prepare_us = _timed_us(kvcopy.prepare)
    print(
        f"beside a {SLEEP_MS} ms sleep: kvcopy.prepare() {prepare_us:9.1f} us, "
        f"sleep still running after: {not busy.query()}",
        flush=True,
    )
    torch.cuda.synchronize()


def copy_calls() -> None:
    stream = torch.cuda.Stream()
    for count in (4096, 8192):
        _keep, s, d, sizes = scattered_batch(count, 16 << 10, seed=count)
        for k in range(10):  # more than the ring's 8 slots
            torch.cuda.synchronize()
            _sleep_beside()
            us = _timed_us(lambda: kvcopy.copy_batch(s, d, sizes, stream=stream, method="kernel"))
            print(
                f"beside a {SLEEP_MS} ms sleep: copy_batch {count} x 16 KiB "
                f"({count * 32 >> 10} KiB of descriptors), call {k}: {us:9.1f} us",
                flush=True,
            )
        torch.cuda.synchronize()


if __name__ == "__main__":
    torch.cuda.init()
    torch.cuda.synchronize()
    first_call_steps()
    copy_calls()  # first: the ring's slots are fresh in this process
    driver_calls()
