"""What a serving step needs from the copy paths, measured piece by piece on one GPU:
  bidir     both directions at once, each direction's own GB/s, for kernel footprints
            per direction and for copy engines fed in interleaved chunks;
  footprint fewest CTAs per block size, one way (fraction of the contiguous copy);
  d2d       CTAs and threads for copies inside the GPU;
  latency   call-to-completion floor for small batches, and where the time goes;
  chunks    wall time of batched DMA issued in chunks, and of the kernel path split
            into a small first launch and the rest.
Run on a GPU: python3 experiments/serving_probe.py [part ...]"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.timing import call_to_completion_us, measure
from kvcopy.config import config

KiB, MiB = 1 << 10, 1 << 20
TOTAL = 64 * MiB


def pointers(src, dst, block, n, seed):
    rng = np.random.default_rng(seed)
    p, q = rng.permutation(2 * n)[:n], rng.permutation(2 * n)[:n]
    return (
        (src.data_ptr() + p * block).astype(np.uint64),
        (dst.data_ptr() + q * block).astype(np.uint64),
        np.full(n, block, np.uint64),
    )


def sliced(ptrs, start, stop):
    return tuple(a[start:stop] for a in ptrs)


def stream_times_ms(enqueue, streams, repeats=7):
    """Per repeat, the GPU time from a common start to the end of each of ``streams``;
    a sleep on the first (sized from the call's CPU time) keeps the work from starting
    before it is all enqueued."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    enqueue()
    torch.cuda.synchronize()
    cover = int(((time.perf_counter() - t0) * 2e6 + 300) * 2000)
    rows = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(streams[0]):
            torch.cuda._sleep(cover)
        start.record(streams[0])
        for s in streams[1:]:
            s.wait_event(start)
        enqueue()
        ends = []
        for s in streams:
            end = torch.cuda.Event(enable_timing=True)
            end.record(s)
            ends.append(end)
        torch.cuda.synchronize()
        rows.append([start.elapsed_time(e) for e in ends])
    return rows


def per_stream_ms(enqueue, s1, s2, repeats=7):
    """Median GPU time from a common start to the end of each of two streams
    (stream_times_ms)."""
    rows = stream_times_ms(enqueue, [s1, s2], repeats)
    return (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))


class BothWays:
    """Pools and two streams for a load (host to GPU, on s1) and a store (GPU to host,
    on s2) of TOTAL bytes each, and the contiguous pair's GPU time."""

    def __init__(self) -> None:
        self.host_a = torch.empty(2 * TOTAL, dtype=torch.uint8, pin_memory=True)
        self.host_b = torch.empty(2 * TOTAL, dtype=torch.uint8, pin_memory=True)
        self.gpu_a = torch.empty(2 * TOTAL, dtype=torch.uint8, device="cuda")
        self.gpu_b = torch.empty(2 * TOTAL, dtype=torch.uint8, device="cuda")
        self.s1, self.s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def batches(self, block):
        """(load, store) pointer triples of scattered blocks."""
        n = TOTAL // block
        return (
            pointers(self.host_a, self.gpu_a, block, n, 1),
            pointers(self.gpu_b, self.host_b, block, n, 2),
        )

    def contiguous(self) -> None:
        with torch.cuda.stream(self.s1):
            self.gpu_a[:TOTAL].copy_(self.host_a[:TOTAL], non_blocking=True)
        with torch.cuda.stream(self.s2):
            self.host_b[:TOTAL].copy_(self.gpu_b[:TOTAL], non_blocking=True)

    def span_ms(self, fn) -> float:
        return max(per_stream_ms(fn, self.s1, self.s2))


def bidir(blocks=(4 * KiB, 16 * KiB, 256 * KiB)):
    both = BothWays()
    s1, s2 = both.s1, both.s2
    print(
        "bidir: UNROLL", os.environ.get("KVCOPY_UNROLL", "4"), "; GB/s h2d, d2h, sum; sum / contiguous pair"
    )
    for block in blocks:
        n = TOTAL // block
        h2d, d2h = both.batches(block)
        contiguous = both.contiguous
        cases = {"contiguous pair": contiguous}
        for hc, dc, threads in (
            (16, 16, 512),
            (4, 4, 512),
            (32, 16, 512),
            (64, 16, 512),
            (132, 16, 512),
            (64, 4, 512),
            (132, 4, 512),
            (64, 64, 512),
            (128, 16, 256),
            (132, 8, 512),
        ):

            def kernels(hc=hc, dc=dc, threads=threads):
                config.threads_per_cta = threads
                kvcopy.copy_batch(*h2d, stream=s1, method="kernel", max_ctas=hc)
                kvcopy.copy_batch(*d2h, stream=s2, method="kernel", max_ctas=dc)
                config.threads_per_cta = 512

            cases[f"kernel h{hc} d{dc} x{threads}"] = kernels
        if os.environ.get("KVCOPY_UNROLL", "4") == "4":
            chunk = max(8, (1 * MiB) // block)

            def interleaved(h_method, d_method):
                def run():
                    for i in range(0, n, chunk):
                        kvcopy.copy_batch(
                            *sliced(h2d, i, i + chunk),
                            stream=s1,
                            method=h_method,
                            max_ctas=None if h_method == "batch" else 64,
                        )
                        kvcopy.copy_batch(*sliced(d2h, i, i + chunk), stream=s2, method=d_method)

                return run

            cases["batch + batch, interleaved"] = interleaved("batch", "batch")
            cases["kernel64 + batch, interleaved"] = interleaved("kernel", "batch")
            cases["batch + kernel16, interleaved"] = interleaved("batch", "kernel")
        pair = None
        for name, fn in cases.items():
            h_ms, d_ms = per_stream_ms(fn, s1, s2)
            span = max(h_ms, d_ms)
            pair = pair or span
            print(
                f"  {block // KiB:>4} KiB {name:<32} {TOTAL / h_ms / 1e6:6.1f} "
                f"{TOTAL / d_ms / 1e6:6.1f} {2 * TOTAL / span / 1e6:6.1f}  {pair / span:.2f}",
                flush=True,
            )


def one_way_pools(direction, total):
    host = torch.empty(2 * total, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    return {"h2d": (host, dev), "d2h": (dev, host), "d2d": (dev, dev2)}[direction]


def ratio_rows(direction, blocks, variants, total=TOTAL):
    src, dst = one_way_pools(direction, total)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        contiguous = measure(lambda: dst[:total].copy_(src[:total], non_blocking=True), stream)
    print(
        f"{direction}: contiguous {total / contiguous.gpu_ms / 1e6:.1f} GB/s, "
        f"wall {total / contiguous.wall_ms / 1e6:.1f}"
    )
    for block in blocks:
        n = total // block
        ptrs = pointers(src, dst, block, n, block)
        cells = []
        for label, ctas, threads in variants:
            config.threads_per_cta = threads
            t = measure(
                lambda: kvcopy.copy_batch(*ptrs, stream=stream, method="kernel", max_ctas=ctas), stream
            )
            config.threads_per_cta = 512
            cells.append(f"{label} {contiguous.gpu_ms / t.gpu_ms:.2f}/{contiguous.wall_ms / t.wall_ms:.2f}")
        print(f"  {block // KiB:>5} KiB  " + "  ".join(cells), flush=True)


def footprint():
    print("footprint: GPU-time/wall fraction of the contiguous copy")
    variants = [(f"{c}x512", c, 512) for c in (2, 4, 8, 16)]
    for direction in ("h2d", "d2h"):
        ratio_rows(direction, (2 * KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB), variants)


def d2d():
    print("d2d: GPU-time/wall fraction of the contiguous copy")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = [
        (f"{k}x{sms}x{t}", k * sms, t)
        for k, t in ((1, 512), (2, 512), (3, 512), (4, 512), (4, 256), (8, 256))
    ]
    ratio_rows("d2d", (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB), variants, total=256 * MiB)


def wall_us(fn, stream, repeats=300, sync=None):
    return call_to_completion_us(fn, sync or stream.synchronize, repeats=repeats)


def latency():
    from cuda.bindings import driver as cu

    stream = torch.cuda.Stream()
    handle = stream.cuda_stream
    for direction in ("h2d", "d2h"):
        src, dst = one_way_pools(direction, 4 * MiB)
        for count in (16, 64, 256):
            nbytes = count * 16 * KiB
            ptrs = pointers(src, dst, 16 * KiB, count, count)
            raw_sync = lambda: cu.cuStreamSynchronize(handle)  # noqa: E731
            rows = {
                "torch contiguous + stream.sync": wall_us(
                    lambda: dst[:nbytes].copy_(src[:nbytes], non_blocking=True), torch.cuda.current_stream()
                ),
                "cuMemcpyAsync contiguous + cuStreamSynchronize": wall_us(
                    lambda: cu.cuMemcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes, handle),
                    stream,
                    sync=raw_sync,
                ),
                "kvcopy kernel, torch stream, stream.sync": wall_us(
                    lambda: kvcopy.copy_batch(*ptrs, stream=stream, method="kernel"), stream
                ),
                "kvcopy kernel, raw handle, cuStreamSynchronize": wall_us(
                    lambda: kvcopy.copy_batch(*ptrs, stream=handle, method="kernel"), stream, sync=raw_sync
                ),
                "kvcopy kernel 4 CTAs, raw handle": wall_us(
                    lambda: kvcopy.copy_batch(*ptrs, stream=handle, method="kernel", max_ctas=4),
                    stream,
                    sync=raw_sync,
                ),
                "kvcopy auto, raw handle": wall_us(
                    lambda: kvcopy.copy_batch(*ptrs, stream=handle), stream, sync=raw_sync
                ),
                "kvcopy kernel 16 CTAs, raw handle": wall_us(
                    lambda: kvcopy.copy_batch(*ptrs, stream=handle, method="kernel", max_ctas=16),
                    stream,
                    sync=raw_sync,
                ),
                "kvcopy kernel 64 CTAs, raw handle": wall_us(
                    lambda: kvcopy.copy_batch(*ptrs, stream=handle, method="kernel", max_ctas=64),
                    stream,
                    sync=raw_sync,
                ),
                "kvcopy call alone (no sync)": wall_us(
                    lambda: kvcopy.copy_batch(*ptrs, stream=handle, method="kernel"),
                    stream,
                    sync=lambda: None,
                    repeats=100,
                ),
                "kvcopy auto call alone (no sync)": wall_us(
                    lambda: kvcopy.copy_batch(*ptrs, stream=handle), stream, sync=lambda: None, repeats=100
                ),
                "cuStreamSynchronize of an idle stream": wall_us(lambda: None, stream, sync=raw_sync),
            }
            for name, us in rows.items():
                print(f"latency {direction} {count:>3}x16KiB  {name:<50} {us:7.1f} us", flush=True)


def chunks():
    stream = torch.cuda.Stream()
    for direction in ("h2d", "d2h"):
        src, dst = one_way_pools(direction, TOTAL)
        with torch.cuda.stream(stream):
            contiguous = measure(lambda: dst[:TOTAL].copy_(src[:TOTAL], non_blocking=True), stream)
        for block in (64 * KiB, 256 * KiB, 1 * MiB):
            ptrs = pointers(src, dst, block, TOTAL // block, block)
            for chunk in (16384, 256, 64, 16):
                config.batch_chunk = chunk
                t = measure(lambda: kvcopy.copy_batch(*ptrs, stream=stream, method="batch"), stream)
                print(
                    f"chunks {direction} {block // KiB:>5} KiB batch chunk {chunk:>5}: "
                    f"GPU {contiguous.gpu_ms / t.gpu_ms:.2f} wall {contiguous.wall_ms / t.wall_ms:.2f}"
                    f" cpu {t.cpu_us:.0f} us",
                    flush=True,
                )
            config.batch_chunk = 16384
        for block in (2 * KiB, 4 * KiB):
            n = TOTAL // block
            ptrs = pointers(src, dst, block, n, block)
            for first in (0, 512, 2048, 8192):

                def split(first=first):
                    if first:
                        kvcopy.copy_batch(*sliced(ptrs, 0, first), stream=stream, method="kernel")
                    kvcopy.copy_batch(*sliced(ptrs, first, n), stream=stream, method="kernel")

                t = measure(split, stream)
                print(
                    f"chunks {direction} {block // KiB} KiB kernel first launch {first:>5}: "
                    f"GPU {contiguous.gpu_ms / t.gpu_ms:.2f} wall {contiguous.wall_ms / t.wall_ms:.2f}"
                    f" cpu {t.cpu_us:.0f} us",
                    flush=True,
                )


def pair(blocks=(4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB)):
    """copy_both_ways (one launch, CTAs split by direction) for several splits."""
    from kvcopy.testing import engine

    device = engine.device

    both = BothWays()
    s1 = both.s1
    base = device.thresholds(0)
    print("pair: copy_both_ways, one launch; total GB/s, of contiguous pair")
    for block in blocks:
        load, store = both.batches(block)
        pair_ms = both.span_ms(both.contiguous)
        cells = []
        for h, d in ((8, 4), (16, 8), (24, 12), (32, 16), (48, 24), (64, 32), (32, 32), (40, 16)):
            use_split(base, h, d)
            ms = both.span_ms(lambda: kvcopy.copy_both_ways(store, load, stream=s1, method="kernel"))
            cells.append(f"h{h}/d{d} {pair_ms / ms:.2f}")
        device.set_thresholds(0, base)
        ms = both.span_ms(lambda: kvcopy.copy_both_ways(store, load, stream=s1))
        print(
            f"  {block // KiB:>4} KiB pair {2 * TOTAL / pair_ms / 1e6:.1f} GB/s  "
            + "  ".join(cells)
            + f"  auto({kvcopy.last_decision().method}) {pair_ms / ms:.2f}",
            flush=True,
        )


def d2d_descriptors():
    """Copies inside the GPU by the copy kernel: descriptors uploaded before each launch,
    already in device memory, or read in place from pinned memory; one or four CTAs
    per SM; GPU time against the contiguous copy. (One CTA per tile, tried on the
    H200, reached 0.86-0.87 at 16 KiB with descriptors in device memory, below four
    warp-per-tile CTAs per SM at 0.89-0.90, and was dropped.)"""
    from kvcopy.testing import engine

    kernels = engine.kernels
    from kvcopy.testing import cuda

    describe, driver, launch, memory = cuda.describe, cuda.driver, cuda.launch, cuda.memory

    total = 256 * MiB
    src, dst = one_way_pools("d2d", total)
    stream = torch.cuda.Stream()
    handle = stream.cuda_stream
    with torch.cuda.stream(stream):
        contiguous = measure(lambda: dst[:total].copy_(src[:total], non_blocking=True), stream)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kvcopy.copy_batch([src.data_ptr()], [dst.data_ptr()], [16], stream=handle, method="kernel")
    cc = torch.cuda.get_device_capability(0)
    kernel = kernels.kernel_for_current_context(cc[0], cc[1], driver.driver_version())
    for block in (16 * KiB, 64 * KiB, 256 * KiB):
        n = total // block
        s, d, z = pointers(src, dst, block, n, block)
        host = memory.host_alloc(n * 32)
        dev = memory.mem_alloc(n * 32)
        batch = describe.describe_copies(s, d, z, host, False)
        count, tiles = batch.count, batch.tiles
        mapped = memory.host_device_pointer(host)
        launch.launch_descs(kernel.function_uploaded, dev, count, tiles, sms, 512, handle, host)
        cells = []
        for label, function, descs, upload, ctas, threads in (
            ("warp upload", kernel.function_uploaded, dev, host, sms, 512),
            ("warp in-place", kernel.function_uploaded, mapped, 0, sms, 512),
            ("warp 1x", kernel.function_uploaded, dev, 0, sms, 512),
            ("warp 4x", kernel.function_uploaded, dev, 0, 4 * sms, 512),
            ("warp 4x upload", kernel.function_uploaded, dev, host, 4 * sms, 512),
            ("warp 4x in-place", kernel.function_uploaded, mapped, 0, 4 * sms, 512),
        ):
            t = measure(
                lambda: launch.launch_descs(function, descs, count, tiles, ctas, threads, handle, upload),
                stream,
            )
            cells.append(f"{label} {contiguous.gpu_ms / t.gpu_ms:.2f}")
        stream.synchronize()
        memory.host_free(host)
        memory.mem_free(dev)
        print(f"d2d_descriptors {block // KiB:>4} KiB  " + "  ".join(cells), flush=True)


def profile_small():
    """Where a 16-copy call's CPU time goes (cProfile, per call)."""
    import cProfile
    import pstats

    src, dst = one_way_pools("h2d", 4 * MiB)
    ptrs = pointers(src, dst, 16 * KiB, 16, 16)
    stream = torch.cuda.Stream()
    handle = stream.cuda_stream
    for _ in range(50):
        kvcopy.copy_batch(*ptrs, stream=handle)
    stream.synchronize()
    prof = cProfile.Profile()
    for _ in range(2000):
        prof.enable()
        kvcopy.copy_batch(*ptrs, stream=handle)
        prof.disable()
        stream.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def beside_parts():
    """Matmul slowdown beside copies, per direction and footprint (kvcopy_bench.beside)."""
    from kvcopy_bench import beside

    variants = [
        ("kernel 4", {"method": "kernel", "max_ctas": 4}),
        ("kernel 2", {"method": "kernel", "max_ctas": 2}),
        ("kernel 1", {"method": "kernel", "max_ctas": 1}),
        ("batch", {"method": "batch"}),
    ]
    for direction in ("h2d", "d2h"):
        for row in beside.compute_beside(pairs=8, direction=direction, variants=variants):
            print(
                f"beside {direction} {row['method']:<10} median {row['median_slowdown']:+.3f} "
                f"p25 {row['p25_slowdown']:+.3f} p75 {row['p75_slowdown']:+.3f} "
                f"copy {row['copy_gbps']:.1f} GB/s",
                flush=True,
            )
    serving_blocks(blocks=(16 * KiB,), pairs=6)


def serving_blocks(blocks=(16 * KiB, 256 * KiB, 1 * MiB), pairs=8):
    """The benchmark's serving step (a matmul beside a store and a load on two streams)
    for each block size, every method (kvcopy_bench.beside.SERVING_METHODS)."""
    from kvcopy_bench import beside

    for block in blocks:
        for row in beside.serving_step(pairs=pairs, block=block):
            print(
                f"serving {block // KiB:>5} KiB {row['method']:<22} store "
                f"{row['store_gbps']:5.1f} load {row['load_gbps']:5.1f} median "
                f"{row['median_slowdown']:+.3f} p25 {row['p25_slowdown']:+.3f} "
                f"p75 {row['p75_slowdown']:+.3f}",
                flush=True,
            )


def forked(blocks=(4 * KiB, 16 * KiB)):
    """Both directions as two launches on two streams (per-direction CTAs) against
    copy_both_ways' single launch with the same split."""
    from kvcopy.testing import engine

    device = engine.device

    both = BothWays()
    s1, s2 = both.s1, both.s2
    base = device.thresholds(0)
    for block in blocks:
        load, store = both.batches(block)
        pair_ms = both.span_ms(both.contiguous)
        cells = []
        for h, d in ((16, 8), (32, 16), (64, 32), (32, 32)):

            def two(h=h, d=d):
                kvcopy.copy_batch(*load, stream=s1, method="kernel", max_ctas=h)
                kvcopy.copy_batch(*store, stream=s2, method="kernel", max_ctas=d)

            def two_reversed(h=h, d=d):
                kvcopy.copy_batch(*store, stream=s2, method="kernel", max_ctas=d)
                kvcopy.copy_batch(*load, stream=s1, method="kernel", max_ctas=h)

            use_split(base, h, d)
            one = both.span_ms(lambda: kvcopy.copy_both_ways(store, load, stream=s1))
            cells.append(
                f"h{h}/d{d} two {pair_ms / both.span_ms(two):.2f} "
                f"two-rev {pair_ms / both.span_ms(two_reversed):.2f} "
                f"one {pair_ms / one:.2f}"
            )
        device.set_thresholds(0, base)
        print(f"forked {block // KiB:>3} KiB  " + "  ".join(cells), flush=True)


def footprint_small():
    print("footprint_small: UNROLL", os.environ.get("KVCOPY_UNROLL", "4"))
    variants = [(f"{c}x512", c, 512) for c in (1, 2, 4)]
    for direction in ("h2d", "d2h"):
        ratio_rows(direction, (2 * KiB, 16 * KiB, 256 * KiB), variants)


def use_split(base, h2d: int, d2h: int) -> None:
    """Make copy_both_ways on device 0 split its CTAs h2d / d2h (from thresholds ``base``)."""
    import dataclasses
    from kvcopy.testing import engine

    device = engine.device

    device.set_thresholds(0, dataclasses.replace(base, both_ways_ctas={"h2d": h2d, "d2h": d2h}))


def both_ways_beside(splits=((16, 8), (16, 2), (8, 2), (32, 4), (16, 1), (8, 1))):
    """copy_both_ways per CTA split: both directions' GPU time against the contiguous
    pair (4 and 16 KiB), and a matmul window's slowdown beside it (alternating pairs)."""
    from kvcopy.testing import engine

    device = engine.device
    from kvcopy_bench import beside

    both = BothWays()
    base = device.thresholds(0)
    matmuls = beside.Matmuls()
    for h, d in splits:
        use_split(base, h, d)
        cells = []
        for block in (4 * KiB, 16 * KiB):
            load, store = both.batches(block)
            pair_ms = both.span_ms(both.contiguous)
            ms = both.span_ms(lambda: kvcopy.copy_both_ways(store, load, stream=both.s1))
            cells.append(f"{block // KiB} KiB {pair_ms / ms:.2f}")
        load, store = both.batches(16 * KiB)
        copier = beside.Copier(
            "pair", lambda: kvcopy.copy_both_ways(store, load, stream=both.s1), both.s1, 2 * TOTAL
        )
        spread, gbps, _ = beside.paired(matmuls, [copier], 5)
        print(
            f"both_ways_beside h{h}/d{d}: of pair "
            + "  ".join(cells)
            + f"  matmul {spread['median_slowdown']:+.3f} (min {spread['min_slowdown']:+.3f} "
            f"max {spread['max_slowdown']:+.3f}) beside {gbps['pair']:.1f} GB/s",
            flush=True,
        )
    device.set_thresholds(0, base)


def both_ways_methods(blocks=(64 * KiB, 128 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)):
    """Where copy engines beat the kernel for a store and a load at once: GPU time and
    wall (call to both streams idle) against the contiguous pair, for copy_both_ways
    by kernel and by batch, and for batches issued in interleaved chunks."""
    both = BothWays()
    s1, s2 = both.s1, both.s2

    def sync():
        s1.synchronize()
        s2.synchronize()

    pair_wall = call_to_completion_us(both.contiguous, sync, repeats=20)
    pair_ms = both.span_ms(both.contiguous)
    for block in blocks:
        load, store = both.batches(block)
        n = TOTAL // block
        cases = {
            m: (lambda m=m: kvcopy.copy_both_ways(store, load, stream=s1, method=m))
            for m in ("kernel", "batch")
        }
        for chunk in (16, 64):

            def interleaved(chunk=chunk):
                for i in range(0, n, chunk):
                    kvcopy.copy_batch(*sliced(load, i, i + chunk), stream=s1, method="batch")
                    kvcopy.copy_batch(*sliced(store, i, i + chunk), stream=s2, method="batch")

            cases[f"batch chunks of {chunk}"] = interleaved
        cells = []
        for name, fn in cases.items():
            wall = call_to_completion_us(fn, sync, repeats=20)
            cells.append(f"{name} {pair_ms / both.span_ms(fn):.2f}/{pair_wall / wall:.2f}")
        print(f"both_ways_methods {block // KiB:>5} KiB GPU/wall of pair: " + "  ".join(cells), flush=True)


def dma_threads(blocks=(4 * KiB, 16 * KiB, 64 * KiB), chunk=256):
    """Does batched DMA's CPU cost per copy spread over threads? Wall GB/s (call to
    all streams idle) of 64 MiB of scattered blocks issued by T Python threads, each
    on a stream of its own in chunks of ``chunk`` copies (the GIL is released in the
    driver call), one way and both ways, against the contiguous copy's wall."""
    from concurrent.futures import ThreadPoolExecutor

    both = BothWays()
    pool = ThreadPoolExecutor(8)
    streams = [torch.cuda.Stream() for _ in range(8)]

    def sync():
        torch.cuda.synchronize()  # every stream, the default one (contiguous copy) too

    one_wall = call_to_completion_us(
        lambda: both.gpu_a[:TOTAL].copy_(both.host_a[:TOTAL], non_blocking=True), sync, repeats=20
    )
    pair_wall = call_to_completion_us(both.contiguous, sync, repeats=20)
    print(
        f"dma_threads: contiguous one way {TOTAL / one_wall / 1e3:.1f} GB/s wall, "
        f"pair {2 * TOTAL / pair_wall / 1e3:.1f} GB/s wall; chunks of {chunk}"
    )
    for block in blocks:
        load, store = both.batches(block)
        n = TOTAL // block

        def run(jobs):
            def go():
                futures = [
                    pool.submit(
                        lambda j=j: [
                            kvcopy.copy_batch(*sliced(j[0], i, i + chunk), stream=j[1], method="batch")
                            for i in range(j[2], j[3], chunk)
                        ]
                    )
                    for j in jobs
                ]
                for f in futures:
                    f.result()

            return go

        def split(batch, threads, first):
            step = -(-n // threads)
            return [(batch, streams[first + t], t * step, min(n, (t + 1) * step)) for t in range(threads)]

        cells = []
        for threads in (1, 2, 4):
            us = call_to_completion_us(run(split(store, threads, 0)), sync, repeats=10)
            cells.append(f"d2h x{threads} {TOTAL / us / 1e3:5.1f} ({one_wall / us:.2f})")
        for threads in (1, 2, 4):
            jobs = split(load, threads, 0) + split(store, threads, 4)
            us = call_to_completion_us(run(jobs), sync, repeats=10)
            cells.append(f"both x{threads}+{threads} {2 * TOTAL / us / 1e3:5.1f} ({pair_wall / us:.2f})")
        print(f"dma_threads {block // KiB:>4} KiB  " + "  ".join(cells), flush=True)


def beside_dma_threads(threads_list=(1, 2, 4), chunk=256):
    """Matmul slowdown beside GPU-to-host batched DMA of 16 KiB blocks fed by T
    threads (one stream each): can copy engines carry stores at the link's rate
    without the SM stores' cost to compute?"""
    from concurrent.futures import ThreadPoolExecutor
    from kvcopy_bench import beside

    matmuls = beside.Matmuls()
    total, block = 64 * MiB, 16 * KiB
    n = total // block
    ptrs = pointers(*one_way_pools("d2h", total), block, n, 3)
    pool = ThreadPoolExecutor(8)
    streams = [torch.cuda.Stream() for _ in range(max(threads_list))]
    for threads in threads_list:
        step = -(-n // threads)

        def part(t, step=step):
            for i in range(t * step, min(n, (t + 1) * step), chunk):
                kvcopy.copy_batch(
                    *sliced(ptrs, i, min(i + chunk, (t + 1) * step)), stream=streams[t], method="batch"
                )

        def call(threads=threads, part=part):
            for f in [pool.submit(part, t) for t in range(threads)]:
                f.result()
            for t in range(1, threads):  # the copier's GB/s is timed on stream 0
                streams[0].wait_stream(streams[t])

        spread, gbps, _ = beside.paired(matmuls, [beside.Copier("d2h", call, streams[0], total)], 8)
        print(
            f"beside_dma_threads d2h batch x{threads} median {spread['median_slowdown']:+.3f} "
            f"p25 {spread['p25_slowdown']:+.3f} p75 {spread['p75_slowdown']:+.3f} "
            f"copy {gbps['d2h']:.1f} GB/s",
            flush=True,
        )


def dma_attrs(blocks=(4 * KiB, 16 * KiB, 64 * KiB)):
    """Does any attribute of cuMemcpyBatchAsync cut its CPU cost per copy? CPU µs per
    copy of one call over 64 MiB of scattered blocks (the copy then waited for, not
    timed) and wall GB/s (call to completion), per source access order, flag and
    location hint, one way each, in torch's pinned memory and in kvcopy's."""
    from kvcopy.testing import cuda

    dma = cuda.dma
    stream = torch.cuda.Stream()
    handle = stream.cuda_stream
    dev = torch.cuda.current_device()
    variants = {
        "stream+overlap": dict(order=1),
        "any+overlap": dict(order=3),
        "stream, no flag": dict(order=1, flags=0),
        "any, no flag": dict(order=3, flags=0),
        "during_call": dict(order=2),
    }
    for direction in ("h2d", "d2h"):
        host_hint, dev_hint = (2, 0), (1, dev)
        hints = host_hint + dev_hint if direction == "h2d" else dev_hint + host_hint
        variants_here = dict(variants, **{"stream+hints": dict(order=1, hints=hints)})
        for memory in ("torch", "kvcopy"):
            src, dst = one_way_pools(direction, TOTAL)
            if memory == "kvcopy":
                host = torch.from_numpy(kvcopy.pinned_empty(2 * TOTAL, dtype=np.uint8))
                src, dst = (host, dst) if direction == "h2d" else (src, host)
            for block in blocks:
                n = TOTAL // block
                s, d, z = pointers(src, dst, block, n, block)
                cells = []
                for name, kw in variants_here.items():
                    cpu, wall = [], []
                    for _ in range(5):
                        stream.synchronize()
                        t0 = time.perf_counter()
                        dma.memcpy_batch(d, s, z, handle, False, 1 << 20, **kw)
                        t1 = time.perf_counter()
                        stream.synchronize()
                        t2 = time.perf_counter()
                        cpu.append((t1 - t0) * 1e6 / n)
                        wall.append(t2 - t0)
                    cells.append(
                        f"{name} {statistics.median(cpu):.2f}us "
                        f"{TOTAL / statistics.median(wall) / 1e9:.1f}GB/s"
                    )
                print(
                    f"dma_attrs {direction} {memory:<6} {block // KiB:>3} KiB x{n:<5} " + "  ".join(cells),
                    flush=True,
                )


def compact(blocks=(2 * KiB, 4 * KiB, 16 * KiB), rounds=3):
    """16-byte entries (describe_compact) against 32-byte descriptors for large
    batches of one block size, in the same process: wall (call to completion,
    median of 50) as a fraction of the contiguous copy's, each way, the two
    variants alternating ``rounds`` times; and GPU time once each."""
    from kvcopy.testing import engine

    dispatch = engine.dispatch
    from kvcopy.testing import cuda

    describe = cuda.describe

    def full_descriptors(src, dst, sizes, out, merge):
        return describe.describe_copies(src, dst, sizes, out, merge)

    variants = {"desc32": full_descriptors, "pairs16": describe.describe_compact}
    for direction in ("h2d", "d2h", "d2d"):
        total = 256 * MiB if direction == "d2d" else TOTAL
        src, dst = one_way_pools(direction, total)
        stream = torch.cuda.Stream()

        def contiguous():
            with torch.cuda.stream(stream):
                dst[:total].copy_(src[:total], non_blocking=True)

        ref_wall = call_to_completion_us(contiguous, stream.synchronize, repeats=50)
        ref_gpu = measure(contiguous, stream).gpu_ms
        for block in blocks:
            ptrs = pointers(src, dst, block, total // block, block)

            def call():
                kvcopy.copy_batch(*ptrs, stream=stream, method="kernel")

            walls: dict[str, list[float]] = {name: [] for name in variants}
            gpus = {}
            for _ in range(rounds):
                for name, fn in variants.items():
                    dispatch.describe.describe_compact = fn
                    walls[name].append(ref_wall / call_to_completion_us(call, stream.synchronize, repeats=50))
                    gpus[name] = ref_gpu / measure(call, stream).gpu_ms
            dispatch.describe.describe_compact = describe.describe_compact
            cells = [
                f"{name} wall {' '.join(f'{w:.3f}' for w in walls[name])} gpu {gpus[name]:.3f}"
                for name in variants
            ]
            print(
                f"compact {direction} {block // KiB:>3} KiB x{total // block:<6} " + "  ".join(cells),
                flush=True,
            )


PARTS = {
    "serving_blocks": serving_blocks,
    "compact": compact,
    "dma_attrs": dma_attrs,
    "beside_dma_threads": beside_dma_threads,
    "dma_threads": dma_threads,
    "both_ways_methods": both_ways_methods,
    "both_ways_beside": both_ways_beside,
    "beside": beside_parts,
    "forked": forked,
    "footprint_small": footprint_small,
    "pair": pair,
    "d2d_descriptors": d2d_descriptors,
    "profile_small": profile_small,
    "bidir": bidir,
    "footprint": footprint,
    "d2d": d2d,
    "latency": latency,
    "chunks": chunks,
}

if __name__ == "__main__":
    torch.cuda.init()
    for part in sys.argv[1:] or list(PARTS):
        PARTS[part]()
