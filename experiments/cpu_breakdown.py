"""Where copy_batch's CPU time goes, piece by piece, with minor page faults per call.

Times each step of the kernel path for 8192 descriptors (NumPy pointer arrays)
in isolation: argument conversion, the planner the DMA paths use, the fused
describe pass (into pinned and into pageable memory), and the whole call.
"""

from __future__ import annotations

import ctypes
import resource
import types
import statistics
import time

import numpy as np
import torch

import kvcopy
from kvcopy.testing import cuda

kv_classify, kv_describe, kv_driver, kv_launch, kv_testing = (
    cuda.classify,
    cuda.describe,
    cuda.driver,
    cuda.launch,
    cuda.testing,
)
kv_memory = cuda.memory
from kvcopy.testing import engine

decide = engine.decide
from kvcopy.interop.arrays import as_u64_array
from kvcopy._plans.copies import plan_copies
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.workloads import block_pairs, layered_caches, scattered_batch


def timed(label: str, fn, calls: int = 300, sync=None) -> None:
    for _ in range(10):
        fn()
    if sync:
        sync()
    times, faults = [], []
    for _ in range(calls):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        if sync:
            sync()
    print(
        f"breakdown {label:<34} median_us={statistics.median(times):8.1f} "
        f"min_us={min(times):8.1f} minor_faults={statistics.median(faults):.0f}"
    )


def main(count: int = 8192, block: int = 16 << 10, swap: bool = True) -> None:
    print(f"breakdown batch: {count} x {block} B host to GPU")
    _keep, s, d, sizes = scattered_batch(count, block)
    stream = torch.cuda.Stream()
    kvcopy.copy_batch(s, d, sizes, stream=stream, method="kernel")
    torch.cuda.synchronize()
    ref = np.arange(8192, dtype=np.uint64)
    out = np.empty_like(ref)
    timed("reference: np.add 8192 (out=)", lambda: np.add(ref, ref, out=out))
    timed("reference: np.empty x4 64 KiB", lambda: [np.empty(8192, np.uint64) for _ in range(4)])
    timed("as_u64_array x3", lambda: [as_u64_array(a, "x") for a in (s, d, sizes)])
    timed("plan_copies", lambda: plan_copies(s, d, sizes))
    plan = plan_copies(s, d, sizes)
    pinned = kv_memory.host_alloc(plan.count * kv_describe.DESCRIPTOR_BYTES)
    pageable = np.empty(plan.count * 4, dtype=np.uint64)
    timed("describe_copies -> pinned", lambda: kv_describe.describe_copies(s, d, sizes, pinned))
    timed("describe_compact -> pinned", lambda: kv_describe.describe_compact(s, d, sizes, pinned))
    timed(
        "describe_copies -> pageable", lambda: kv_describe.describe_copies(s, d, sizes, pageable.ctypes.data)
    )
    # the least any describe pass must do: read both pointer arrays, store 16-byte pairs
    timed("floor: min+max of src and dst", lambda: (s.min(), s.max(), d.min(), d.max()))
    pairs = np.frombuffer((ctypes.c_uint64 * (2 * plan.count)).from_address(pinned), dtype=np.uint64).reshape(
        plan.count, 2
    )
    timed(
        "floor: pairs stored to pinned",
        lambda: (pairs[:, 0].__setitem__(slice(None), s), pairs[:, 1].__setitem__(slice(None), d)),
    )
    general = np.array([[0, 1, 0, -1, 0]], dtype=np.int64)  # seeds nothing the batch uses
    timed(
        "describe, general loop -> pinned",
        lambda: kv_testing.describe_copies_in(general, s, d, sizes, pinned, True, False),
    )
    print(f"breakdown vectorised describe available: {kv_describe.fast_describe_available()}")
    view = np.empty_like(plan.src)
    timed("classify_pointers src", lambda: kv_classify.classify_pointers(plan.src, plan.sizes, view))
    from kvcopy.testing import engine

    dispatch = engine.dispatch
    from kvcopy.testing import engine

    kernels, ring = engine.kernels, engine.ring
    from kvcopy.testing import engine

    ContextScope = engine.context.ContextScope
    from kvcopy.interop.streams import resolve_stream

    handle = resolve_stream(stream)
    timed("resolve_stream(torch stream)", lambda: resolve_stream(stream))

    def scope() -> None:
        with ContextScope(handle):
            pass

    timed("ContextScope enter+exit", scope)

    def reserve() -> None:
        with ring.ring_for_current_context().reserve(1 << 18):
            pass

    timed("ring lookup + reserve", reserve)
    batch = kv_describe.describe_copies(s, d, sizes, pinned)
    count, total, tiles = batch.count, batch.total_bytes, batch.tiles
    found = decide.MemoryClasses.of(batch)
    timed("_decide", lambda: decide.decide(handle, "kernel", count, total, found))
    target = decide.decide(handle, "kernel", count, total, found)
    info = target.info
    timed("kernel lookup", lambda: kernels.kernel_for_current_context(*info.cc, info.driver_version))
    kernel = kernels.kernel_for_current_context(*info.cc, info.driver_version)
    slot = ring.Slot()
    slot.ensure(count * kv_describe.DESCRIPTOR_BYTES)
    kv_describe.describe_copies(s, d, sizes, slot.host)
    ctas, threads = target.ctas(None), kvcopy.config.threads_per_cta
    timed(
        "launch, descriptors read in place",
        lambda: kv_launch.launch_descs(
            kernel.function_uploaded, slot.mapped, count, tiles, ctas, threads, handle
        ),
        sync=stream.synchronize,
    )
    timed(
        "launch, descriptors uploaded",
        lambda: kv_launch.launch_descs(
            kernel.function_uploaded, slot.device, count, tiles, ctas, threads, handle, slot.host
        ),
        sync=stream.synchronize,
    )
    event = kv_driver.event_create()
    timed("event record (ring fence)", lambda: kv_driver.event_record(event, handle))
    timed("stream_capture_status", lambda: kv_driver.stream_capture_status(handle))
    stream.synchronize()
    slot.free()

    def launch() -> None:
        with ring.ring_for_current_context().reserve(count * 32) as slot:
            described = kv_describe.describe_copies(s, d, sizes, slot.host)
            dispatch.launch_kernel(described, target, slot, None)

    timed("reserve + describe + launch", launch, sync=stream.synchronize)
    timed(
        "copy_batch kernel (synced)",
        lambda: kvcopy.copy_batch(s, d, sizes, stream=stream, method="kernel"),
        sync=stream.synchronize,
    )
    timed(
        "copy_batch kernel + sync (wall)",
        lambda: (kvcopy.copy_batch(s, d, sizes, stream=stream, method="kernel"), stream.synchronize()),
        calls=50,
    )
    kv_memory.host_free(pinned)
    if swap:
        swap_blocks_breakdown(stream)


def swap_blocks_breakdown(stream) -> None:
    """The steps of swap_blocks over 64 tensors and 1024 pairs."""
    from kvcopy.testing import engine

    from kvcopy._plans.blocks import block_geometry
    from kvcopy.interop.streams import resolve_stream

    gpu, host = layered_caches(2048)
    mapping = block_pairs(2048, 1024)
    timed("swap: block_geometry", lambda: block_geometry(gpu, host))
    geometry = block_geometry(gpu, host)
    timed("swap: with_mapping", lambda: geometry.with_mapping(mapping))
    plan = geometry.with_mapping(mapping)
    handle = resolve_stream(stream)
    timed("swap: execute_blocks", lambda: engine.blocks.execute_blocks(plan, handle), sync=stream.synchronize)
    timed(
        "swap: whole call",
        lambda: kvcopy.swap_blocks(gpu, host, mapping, stream=stream),
        sync=stream.synchronize,
    )


def small_batch_breakdown(count: int = 16, block: int = 16 << 10) -> None:
    """The steps of one call of ``count`` host-to-GPU copies (a decode step's batch):
    which of its ~11 us are Python, which the driver."""
    from kvcopy.testing import engine

    dispatch, replay = engine.dispatch, engine.replay
    from kvcopy.testing import engine

    kernels = engine.kernels
    from kvcopy.testing import cuda

    kv_drv = cuda.driver
    from kvcopy.testing import engine

    ContextScope = engine.context.ContextScope
    from kvcopy.interop.streams import resolve_stream

    host = torch.empty(2 * count * block, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(2 * count * block, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(0)
    s = (host.data_ptr() + rng.permutation(2 * count)[:count] * block).astype(np.uint64)
    d = (gpu.data_ptr() + rng.permutation(2 * count)[:count] * block).astype(np.uint64)
    sizes = np.full(count, block, dtype=np.uint64)
    stream = torch.cuda.Stream()
    handle = resolve_stream(stream)
    label = f"small {count}:"
    timed(
        f"{label} copy_batch, raw handle",
        lambda: kvcopy.copy_batch(s, d, sizes, stream=handle),
        sync=stream.synchronize,
    )
    replays = replay.replays()
    timed(
        f"{label} copy_batch, decided afresh",
        lambda: (replay.forget(), kvcopy.copy_batch(s, d, sizes, stream=handle)),
        sync=stream.synchronize,
    )
    assert replay.replays() == replays  # (each call above went the full path)
    kvcopy.copy_batch(s, d, sizes, stream=handle)  # recorded again
    buffer = np.empty(count * kv_describe.DESCRIPTOR_BYTES, dtype=np.uint8)
    scratch = types.SimpleNamespace(host=buffer.ctypes.data)  # where the engine describes
    timed(
        f"{label} replay.replay",
        lambda: replay.replay(s, d, sizes, handle, "auto", scratch.host),
        sync=stream.synchronize,
    )
    # what a batch that matches no record costs there: another shape (no describe),
    # and the same bytes from pageable memory (described, then no match)
    timed(
        f"{label} replay, other bytes",
        lambda: replay.replay(s[1:], d[1:], sizes[1:], handle, "auto", scratch.host),
    )
    pageable = np.empty(2 * count * block, dtype=np.uint8)
    s_pageable = (s - np.uint64(host.data_ptr())) + np.uint64(pageable.ctypes.data)
    timed(
        f"{label} replay, other memory",
        lambda: replay.replay(s_pageable, d, sizes, handle, "auto", scratch.host),
    )
    timed(f"{label} as_u64_array x3", lambda: [as_u64_array(a, "x") for a in (s, d, sizes)])
    timed(f"{label} resolve_stream(int)", lambda: resolve_stream(handle))

    def scope() -> None:
        with ContextScope(handle):
            pass

    timed(f"{label} ContextScope enter+exit", scope)
    timed(f"{label} stream_capture_status", lambda: kv_drv.stream_capture_status(handle))
    timed(
        f"{label} describe_copies (2 ranges)", lambda: kv_describe.describe_copies(s, d, sizes, scratch.host)
    )
    batch = kv_describe.describe_copies(s, d, sizes, scratch.host)
    n, total = batch.count, batch.total_bytes
    found = decide.MemoryClasses.of(batch)
    timed(f"{label} MemoryClasses", lambda: decide.MemoryClasses.of(batch))
    timed(f"{label} decide (replay)", lambda: decide.decide(handle, "auto", n, total, found))
    timed(f"{label} context_device", kv_drv.context_device)
    target = decide.decide(handle, "auto", n, total, found)
    info = target.info
    timed(f"{label} kernel lookup", lambda: kernels.kernel_for_current_context(*info.cc, info.driver_version))
    kernel = kernels.kernel_for_current_context(*info.cc, info.driver_version)
    timed(
        f"{label} launch_descs_inline (tiny)",
        lambda: kv_launch.launch_descs_inline(
            kernel.function_tiny,
            kv_launch.INLINE_MAX_TINY,
            scratch.host,
            n,
            target.ctas(None),
            kvcopy.config.threads_per_cta,
            handle,
        ),
        sync=stream.synchronize,
    )
    timed(
        f"{label} dispatch.launch_kernel",
        lambda: dispatch.launch_kernel(batch, target, scratch, None),
        sync=stream.synchronize,
    )
    timed(
        f"{label} execute_arrays",
        lambda: dispatch.execute_arrays(s, d, sizes, handle),
        sync=stream.synchronize,
    )
    timed(
        f"{label} execute_arrays, decided afresh",
        lambda: (replay.forget(), dispatch.execute_arrays(s, d, sizes, handle)),
        sync=stream.synchronize,
    )


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["small"]:
        small_batch_breakdown()
    elif sys.argv[1:] == ["large"]:
        main(32768, 2 << 10, swap=False)  # 64 MiB of 2 KiB blocks
    else:
        main()
