"""Experiment: the kernel's descriptors in write-combined pinned memory.

The descriptor ring's slots are pinned memory the CPU caches (cuMemHostAlloc with
PORTABLE | DEVICEMAP). Two costs of small blocks come from it:
- Writing the descriptors before the first copy holds the wall under 0.90 at 2 and
  4 KiB. cpu_breakdown.py: 32,768 copies take 55-78 us, bound by the writes to
  pinned memory.
- Inside one GPU, the kernel's reads of them over PCIe bound it at 2 and 4 KiB.
  README: 16-byte pairs raised 0.58 to 0.81.
Write-combined memory is not cached by the CPU: writes stream out in 64-byte bursts,
and the GPU reads it without snooping the CPU's caches. The CUDA guide says such
transfers can be up to 40% faster. Reading it from the CPU is very slow, and any
read-back by the describe pass would show up here as a far longer time.

Measured here, for host->GPU, GPU->host and inside the GPU, at 2, 4 and 16 KiB
blocks (64 MiB per batch), with the same batch described into cached and into
write-combined pinned memory:
- the describe pass (describe_compact, as copy_batch runs it), median of 30;
- the copy kernel reading those descriptors in place: GPU time, median of 10,
  against one contiguous cuMemcpyAsync of the same bytes.
Each batch's bytes are checked once after a copy from the write-combined slot.

Run on a GPU: python3 experiments/wc_descriptors_probe.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from cuda.bindings import driver as cu

import kvcopy
from kvcopy.testing import engine

decide, dispatch = engine.decide, engine.dispatch
kernels = engine.kernels
from kvcopy.testing import cuda

kv_describe, kv_driver, kv_launch = cuda.describe, cuda.driver, cuda.launch
kv_memory = cuda.memory
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.scenarios import Pools, scattered_offsets

TOTAL = 64 << 20
DIRECTIONS = ("h2d", "d2h", "d2d")


def _check(result: tuple) -> object:
    err, *rest = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"driver call failed: {err}")
    return rest[0] if rest else None


def write_combined_alloc(nbytes: int) -> int:
    flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_WRITECOMBINED
    return int(_check(cu.cuMemHostAlloc(nbytes, flags)))


def _gpu_ms(run, stream: torch.cuda.Stream, repeats: int = 10) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats + 1):  # (the first warms up)
        stream.synchronize()
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def probe(direction: str, block: int) -> None:
    count = TOTAL // block
    pools = Pools(direction, TOTAL, "torch")  # (the source filled at random)
    src_pool, dst_pool = pools.src, pools.dst
    rng = np.random.default_rng(block)
    src_off, dst_off = (o.astype(np.uint64) for o in scattered_offsets(count, block, rng))
    s, d = np.uint64(src_pool.data_ptr()) + src_off, np.uint64(dst_pool.data_ptr()) + dst_off
    sizes = np.full(count, block, dtype=np.uint64)
    stream = torch.cuda.Stream()
    handle = stream.cuda_stream
    nbytes = count * kv_describe.DESCRIPTOR_BYTES
    slots = {"cached": kv_memory.host_alloc(nbytes), "write-combined": write_combined_alloc(nbytes)}
    batch = kv_describe.describe_compact(s, d, sizes, slots["cached"])
    n, total, tiles, compact_size = batch.count, batch.total_bytes, batch.tiles, batch.compact_size
    target = decide.decide(handle, "kernel", n, total, decide.MemoryClasses.of(batch))
    kernel = kernels.kernel_for_current_context(*target.info.cc, target.info.driver_version)
    ctas, threads = target.ctas(None), kvcopy.config.threads_per_cta

    def copy_from(slot: int):
        mapped = kv_memory.host_device_pointer(slot)
        if compact_size:
            return lambda: kv_launch.launch_compact(
                kernel.function_compact, mapped, n, compact_size, ctas, threads, handle
            )
        return lambda: kv_launch.launch_descs(
            kernel.function_uploaded, mapped, n, tiles, ctas, threads, handle
        )

    contiguous_ms = _gpu_ms(
        lambda: _check(
            cu.cuMemcpyAsync(
                cu.CUdeviceptr(dst_pool.data_ptr()),
                cu.CUdeviceptr(src_pool.data_ptr()),
                TOTAL,
                cu.CUstream(handle),
            )
        ),
        stream,
    )
    for name, slot in slots.items():
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            kv_describe.describe_compact(s, d, sizes, slot)
            times.append((time.perf_counter() - t0) * 1e6)
        ms = _gpu_ms(copy_from(slot), stream)
        entries = "pairs" if compact_size else "descriptors"
        print(
            f"{direction} {block >> 10:>2} KiB x{count:<6} {name:<15} describe median "
            f"{statistics.median(times):7.1f} us min {min(times):7.1f}  kernel "
            f"{contiguous_ms / ms:.3f} of the contiguous copy ({entries})",
            flush=True,
        )
    dst_pool.zero_()
    copy_from(slots["write-combined"])()
    stream.synchronize()
    src_bytes, dst_bytes = src_pool.cpu().numpy(), dst_pool.cpu().numpy()
    picks = rng.choice(count, size=min(count, 512), replace=False)
    right = all(
        np.array_equal(
            src_bytes[int(src_off[i]) : int(src_off[i]) + block],
            dst_bytes[int(dst_off[i]) : int(dst_off[i]) + block],
        )
        for i in picks
    )
    print(
        f"{direction} {block >> 10:>2} KiB bytes right after the write-combined copy "
        f"({len(picks)} copies checked): {right}",
        flush=True,
    )
    kv_memory.host_free(slots["cached"])
    _check(cu.cuMemFreeHost(slots["write-combined"]))


if __name__ == "__main__":
    torch.cuda.init()
    torch.empty(1, device="cuda")  # (the primary context current, as kvcopy finds it)
    for direction in DIRECTIONS:
        for block in (2 << 10, 4 << 10, 16 << 10):
            probe(direction, block)
