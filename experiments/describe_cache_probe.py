"""Experiment: why the describe pass costs three times as much inside copy_batch as alone.

cpu_breakdown.py (8192 x 16 KiB, fast host): describe_copies into a pinned
buffer takes 20.5 us and a launch 5.1, yet reserve + describe + launch takes 86.7 and
copy_batch 80.3. At 2 KiB blocks (32,768 copies) that CPU time comes before the first
copy and holds the wall near 0.82-0.88 of the contiguous copy's. Suspects: the kernel
reading the descriptors in place over PCIe leaves their cache lines in a state the
next describe pays for; any DMA read of them does; or the CPU idling through the
synchronize (clock, caches) does.

Measured here: the describe alone, repeated into one pinned buffer, with each of
these between two describes: nothing; the copy kernel reading that buffer in place,
then a synchronize; the buffer uploaded by a copy engine, then a synchronize; the
kernel reading another buffer (so the link and SMs are as busy), then a synchronize; a
sleep kernel as long, then a synchronize; time.sleep as long. Medians of 60.

Run on a GPU: python3 experiments/describe_cache_probe.py
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

import kvcopy
from kvcopy.testing import engine

decide, dispatch = engine.decide, engine.dispatch
kernels = engine.kernels
from kvcopy.testing import cuda

kv_describe, kv_driver, kv_launch = cuda.describe, cuda.driver, cuda.launch
kv_memory = cuda.memory
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.workloads import scattered_batch
from kvcopy.interop.streams import resolve_stream


def probe(count: int, block: int) -> None:
    _keep, s, d, sizes = scattered_batch(count, block)
    stream = torch.cuda.Stream()
    handle = resolve_stream(stream)
    kvcopy.copy_batch(s, d, sizes, stream=stream, method="kernel")
    stream.synchronize()
    nbytes = count * kv_describe.DESCRIPTOR_BYTES
    buffers = [kv_memory.host_alloc(nbytes) for _ in range(2)]
    device = kv_memory.mem_alloc(nbytes)
    batch = kv_describe.describe_copies(s, d, sizes, buffers[1])
    n, total, tiles = batch.count, batch.total_bytes, batch.tiles
    target = decide.decide(handle, "kernel", n, total, decide.MemoryClasses.of(batch))
    kernel = kernels.kernel_for_current_context(*target.info.cc, target.info.driver_version)
    ctas, threads = target.ctas(None), kvcopy.config.threads_per_cta

    def kernel_reads(buffer: int) -> Callable[[], None]:
        mapped = kv_memory.host_device_pointer(buffer)
        return lambda: (
            kv_launch.launch_descs(kernel.function_uploaded, mapped, n, tiles, ctas, threads, handle),
            stream.synchronize(),
        )

    kv_describe.describe_copies(s, d, sizes, buffers[0])  # (a kernel over it copies the batch)
    t0 = time.perf_counter()
    kernel_reads(buffers[0])()
    copy_s = time.perf_counter() - t0
    cycles = int(copy_s * 1.98e9)

    def sleep_kernel() -> None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
        stream.synchronize()

    between: dict[str, Callable[[], object]] = {
        "nothing": lambda: None,
        "kernel reads it in place, sync": kernel_reads(buffers[0]),
        "copy engine uploads it, sync": lambda: (
            kv_launch.upload(device, buffers[0], nbytes, handle),
            stream.synchronize(),
        ),
        "kernel reads another buffer, sync": kernel_reads(buffers[1]),
        "sleep kernel as long, sync": sleep_kernel,
        "time.sleep as long": lambda: time.sleep(copy_s),
    }
    print(f"# {count} x {block // 1024} KiB: the copy takes {copy_s * 1e6:.0f} us", flush=True)
    for name, after in between.items():
        times = []
        for _ in range(60):
            t0 = time.perf_counter()
            kv_describe.describe_copies(s, d, sizes, buffers[0])
            times.append((time.perf_counter() - t0) * 1e6)
            after()
        print(
            f"describe {count:6d} x {block // 1024:2d} KiB, between: {name:36s} "
            f"median {statistics.median(times):7.1f} us  min {min(times):7.1f}",
            flush=True,
        )
    for _ in range(3):
        times = []
        for _ in range(60):
            t0 = time.perf_counter()
            kvcopy.copy_batch(s, d, sizes, stream=stream, method="kernel")
            times.append((time.perf_counter() - t0) * 1e6)
            stream.synchronize()
        print(
            f"copy_batch {count:6d} x {block // 1024:2d} KiB, synced: median "
            f"{statistics.median(times):7.1f} us  min {min(times):7.1f}",
            flush=True,
        )
    for buffer in buffers:
        kv_memory.host_free(buffer)
    kv_memory.mem_free(device)


if __name__ == "__main__":
    probe(8192, 16 << 10)
    probe(32768, 2 << 10)
