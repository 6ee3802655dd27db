"""Experiment: Hopper's bulk copy unit (cp.async.bulk, the TMA's 1-D form) for
scattered blocks over PCIe, against kvcopy's register copy kernel.

The question: SM stores to host memory are issued 128 bytes at a time by load/store
units, and a matmul beside them slows by 4-56% (h200-store-hint-experiment.txt);
both ways at once the kernel pair reaches 0.77-0.85 of the contiguous pair. A bulk
copy is one instruction per piece, carried out by the SM's bulk copy unit with
its own queue. Does it move host traffic at a larger fraction of the link, and
does it cost a matmul beside it less?

Kernel: one thread per CTA drives a ring of STAGES shared-memory buffers of
STAGE_BYTES: a bulk load (global -> shared, completion on an mbarrier), then a
bulk store (shared -> global) of each piece; a buffer is refilled once its store
has read it. sm_90 or newer. Copies must be multiples of 16 bytes, 16-byte aligned.

Run on a GPU: python3 experiments/bulk_probe.py [sanity] [oneway] [beside] [both]
(BULK_VARIANTS=5x8K,2x8Kw BULK_CTAS=2,4 BULK_DIRS=d2h narrow it down)
"""

from __future__ import annotations

import os
import statistics
import sys

import numpy as np
import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.beside import Copier, Matmuls, paired
from kvcopy_bench.scenarios import Pools, scattered_offsets

KiB, MiB = 1 << 10, 1 << 20
TOTAL = 64 * MiB
GATE = 2_000_000  # sleep cycles (~1 ms) so the enqueued work starts together

SOURCE = r"""
__device__ __forceinline__ unsigned smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void bar_init(unsigned bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void bar_expect(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                     " selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}
__device__ __forceinline__ void bulk_load(unsigned dst, unsigned long long src, unsigned n,
                                          unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];" :: "r"(dst), "l"(src), "r"(n), "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_store(unsigned long long dst, unsigned src, unsigned n) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(dst), "r"(src), "r"(n) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

struct Piece { unsigned long long src, dst; unsigned len; };

__device__ __forceinline__ Piece piece_of(const unsigned long long* __restrict__ pairs,
                                          unsigned long long k, unsigned long long size,
                                          unsigned long long per_copy) {
    const unsigned long long item = blockIdx.x + k * gridDim.x;
    const unsigned long long i = item / per_copy;
    const unsigned long long off = (item - i * per_copy) * STAGE_BYTES;
    const unsigned long long rest = size - off;
    Piece p = {pairs[2 * i] + off, pairs[2 * i + 1] + off,
               (unsigned)(rest < STAGE_BYTES ? rest : STAGE_BYTES)};
    return p;
}

extern "C" __global__ void __launch_bounds__(32) bulk_pairs(
        const unsigned long long* __restrict__ pairs, unsigned long long count,
        unsigned long long size) {
    __shared__ alignas(128) unsigned char buf[STAGES][STAGE_BYTES];
    __shared__ alignas(8) unsigned long long bars[STAGES];
    if (threadIdx.x != 0) return;
    const unsigned long long per_copy = (size + STAGE_BYTES - 1) / STAGE_BYTES;
    const unsigned long long total = count * per_copy;
    if (blockIdx.x >= total) return;
    const unsigned long long mine = (total - blockIdx.x + gridDim.x - 1) / gridDim.x;
    for (int s = 0; s < STAGES; ++s) bar_init(smem(&bars[s]));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const unsigned long long first = mine < STAGES ? mine : STAGES;
    for (unsigned long long k = 0; k < first; ++k) {
        const Piece p = piece_of(pairs, k, size, per_copy);
        bar_expect(smem(&bars[k]), p.len);
        bulk_load(smem(buf[k]), p.src, p.len, smem(&bars[k]));
    }
    for (unsigned long long k = 0; k < mine; ++k) {
        const int s = (int)(k % STAGES);
        const bool refill = k >= 1 && k - 1 + STAGES < mine;
        Piece next = {0, 0, 0};
        if (refill) next = piece_of(pairs, k - 1 + STAGES, size, per_copy);
        const Piece p = piece_of(pairs, k, size, per_copy);
        bar_wait(smem(&bars[s]), (unsigned)((k / STAGES) & 1));
        bulk_store(p.dst, smem(buf[s]), p.len);
        if (refill) {
#if FULL_WAIT   /* the previous store performed, not only read from shared memory */
            asm volatile("cp.async.bulk.wait_group 1;" ::: "memory");
#else
            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
#endif
            const int r = (int)((k - 1) % STAGES);
            bar_expect(smem(&bars[r]), next.len);
            bulk_load(smem(buf[r]), next.src, next.len, smem(&bars[r]));
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""

# name -> (stages, stage bytes, full wait); BULK_VARIANTS picks some ("5x8K,2x8Kw")
VARIANTS = {
    f"{n}x{b}K{'w' if w else ''}": (n, b * KiB, w)
    for n, b in ((2, 4), (2, 8), (3, 8), (4, 4), (5, 8), (10, 4))
    for w in (0, 1)
}
CTAS = [int(c) for c in os.environ.get("BULK_CTAS", "2,4,8,16").split(",")]
DIRECTIONS = os.environ.get("BULK_DIRS", "h2d,d2h").split(",")


def _core():
    try:
        from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch
    except ImportError:  # cuda.core < 0.4
        from cuda.core.experimental import Device, LaunchConfig, Program, ProgramOptions, launch
    return Device, LaunchConfig, Program, ProgramOptions, launch


Device, LaunchConfig, Program, ProgramOptions, launch = _core()
DEVICE = Device(0)
DEVICE.set_current()
CC = DEVICE.compute_capability


def compile_variant(stages: int, stage_bytes: int, full_wait: int):
    text = (
        f"#define STAGES {stages}\n#define STAGE_BYTES {stage_bytes}\n"
        f"#define FULL_WAIT {full_wait}\n" + SOURCE
    )
    options = ProgramOptions(arch=f"sm_{CC[0]}{CC[1]}", std="c++17")
    return Program(text, code_type="c++", options=options).compile("cubin").get_kernel("bulk_pairs")


class Streams:
    """cuda.core streams, each seen by torch as an external stream. Kept for the
    whole process: torch may still hold work or events on a stream it did not create."""

    kept: list = []

    def __init__(self, n: int) -> None:
        self.core = [DEVICE.create_stream() for _ in range(n)]
        self.torch = [torch.cuda.ExternalStream(int(s.handle)) for s in self.core]
        Streams.kept.append(self)


class Batch:
    """Scattered blocks of one direction, as pointer arrays and a device pair table."""

    def __init__(self, direction: str, block: int, seed: int) -> None:
        self.direction, self.block = direction, block
        self.count = TOTAL // block
        self.pools = Pools(direction, TOTAL, "torch")
        src_off, dst_off = scattered_offsets(self.count, block, np.random.default_rng(seed))
        self.src_slots, self.dst_slots = src_off // block, dst_off // block
        self.src = np.uint64(self.pools.src.data_ptr()) + src_off.astype(np.uint64)
        self.dst = np.uint64(self.pools.dst.data_ptr()) + dst_off.astype(np.uint64)
        self.sizes = np.full(self.count, block, np.uint64)
        table = np.stack([self.src, self.dst], axis=1).reshape(-1).view(np.int64)
        self.pairs = torch.from_numpy(table.copy()).cuda()

    def bulk(self, kernel, ctas: int, stream) -> None:
        DEVICE.set_current()  # the copy loop calls from a thread of its own
        launch(
            stream,
            LaunchConfig(grid=ctas, block=32),
            kernel,
            np.uint64(self.pairs.data_ptr()),
            np.uint64(self.count),
            np.uint64(self.block),
        )

    def kvcopy_kernel(self, stream) -> None:
        kvcopy.copy_batch(self.src, self.dst, self.sizes, stream=stream, method="kernel")

    def contiguous(self, stream) -> None:
        with torch.cuda.stream(stream):
            self.pools.dst[:TOTAL].copy_(self.pools.src[:TOTAL], non_blocking=True)

    def check(self) -> bool:
        torch.cuda.synchronize()
        src = self.pools.src.view(-1, self.block).cpu()[torch.from_numpy(self.src_slots)]
        dst = self.pools.dst.view(-1, self.block).cpu()[torch.from_numpy(self.dst_slots)]
        ok = bool(torch.equal(src, dst))
        self.pools.dst.zero_()
        return ok


def gpu_ms(enqueue, streams: list, reps: int = 7) -> float:
    """Median GPU time from a common start to the end of every stream."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(streams[0]):
            torch.cuda._sleep(GATE)
        start.record(streams[0])
        for s in streams[1:]:
            s.wait_event(start)
        enqueue()
        for s in streams[1:]:
            done = torch.cuda.Event()
            done.record(s)
            streams[0].wait_event(done)
        end.record(streams[0])
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def oneway(kernels: dict) -> None:
    streams = Streams(1)
    cs, ts = streams.core[0], streams.torch[0]
    for direction in DIRECTIONS:
        for block in (4 * KiB, 16 * KiB, 64 * KiB):
            batch = Batch(direction, block, 1)
            ceiling = gbps(TOTAL, gpu_ms(lambda: batch.contiguous(ts), [ts]))
            ref = gbps(TOTAL, gpu_ms(lambda: batch.kvcopy_kernel(ts), [ts]))
            batch.kvcopy_kernel(ts)
            ok = batch.check()
            line = (
                f"oneway {direction} {block // KiB:3d} KiB contiguous {ceiling:5.1f}  "
                f"kvcopy kernel {ref / ceiling:.3f}{'' if ok else ' WRONG'}"
            )
            for name, kernel in kernels.items():
                for ctas in CTAS:
                    ms = gpu_ms(lambda: batch.bulk(kernel, ctas, cs), [ts])
                    batch.bulk(kernel, ctas, cs)
                    ok = batch.check()
                    line += f"  {name} x{ctas} {gbps(TOTAL, ms) / ceiling:.3f}{'' if ok else ' WRONG'}"
            print(line, flush=True)


def beside(kernels: dict, pairs: int = 8) -> None:
    streams = Streams(1)
    cs, ts = streams.core[0], streams.torch[0]
    matmuls = Matmuls()
    for direction in DIRECTIONS:
        batch = Batch(direction, 16 * KiB, 2)
        calls = [("kvcopy kernel", lambda: batch.kvcopy_kernel(ts))]
        for name, kernel in kernels.items():
            for ctas in CTAS:
                calls.append((f"{name} x{ctas}", lambda k=kernel, c=ctas: batch.bulk(k, c, cs)))
        for label, call in calls:
            spread, rates, _ = paired(matmuls, [Copier(direction, call, ts, TOTAL)], pairs)
            print(
                f"beside {direction} 16 KiB {label:14s} median {spread['median_slowdown']:+.3f} "
                f"p25 {spread['p25_slowdown']:+.3f} p75 {spread['p75_slowdown']:+.3f} "
                f"copy {rates[direction]:.1f} GB/s",
                flush=True,
            )


def both(kernels: dict) -> None:
    streams = Streams(2)
    (c1, c2), (t1, t2) = streams.core, streams.torch
    for block in (4 * KiB, 16 * KiB, 64 * KiB):
        load, store = Batch("h2d", block, 3), Batch("d2h", block, 4)

        def contiguous() -> None:
            load.contiguous(t1)
            store.contiguous(t2)

        pair = gbps(2 * TOTAL, gpu_ms(contiguous, [t1, t2]))
        ref = gbps(
            2 * TOTAL,
            gpu_ms(
                lambda: kvcopy.copy_both_ways(
                    (store.src, store.dst, store.sizes), (load.src, load.dst, load.sizes), stream=t1
                ),
                [t1],
            ),
        )
        line = f"both {block // KiB:3d} KiB pair {pair:5.1f}  kvcopy copy_both_ways {ref / pair:.3f}"
        for name, kernel in kernels.items():
            for h, d in ((4, 4), (8, 4), (8, 8), (16, 8), (16, 16)):

                def enqueue(k=kernel, h=h, d=d) -> None:
                    load.bulk(k, h, c1)
                    store.bulk(k, d, c2)

                ms = gpu_ms(enqueue, [t1, t2])
                enqueue()
                ok = load.check() and store.check()
                line += f"  {name} h{h}/d{d} {gbps(2 * TOTAL, ms) / pair:.3f}{'' if ok else ' WRONG'}"
        print(line, flush=True)


def sanity(kernels: dict) -> None:
    """One checked copy each way per variant; a hang here means bulk copies cannot reach
    host memory on this system."""
    stream = Streams(1).core[0]
    for direction in ("h2d", "d2h"):
        batch = Batch(direction, 16 * KiB, 5)
        for name, kernel in kernels.items():
            batch.bulk(kernel, 4, stream)
            print(f"sanity {direction} {name}: {'ok' if batch.check() else 'WRONG'}", flush=True)
    from kvcopy.testing import engine

    registers_per_thread = engine.kernels.registers_per_thread
    print(f"kvcopy kernel registers per thread: {registers_per_thread(CC[0] * 10 + CC[1])}")


def main(parts: list[str]) -> None:
    if CC[0] < 9:
        sys.exit(f"bulk copies need sm_90 or newer; this GPU is sm_{CC[0]}{CC[1]}")
    chosen = os.environ.get("BULK_VARIANTS", "5x8K,10x4K").split(",")
    kernels = {name: compile_variant(*VARIANTS[name]) for name in chosen}
    print(
        f"# bulk_probe on {torch.cuda.get_device_name()}, 64 MiB batches, GPU time, "
        "fractions of the contiguous copy (or pair) in the same run",
        flush=True,
    )
    for part in parts or ["oneway", "beside", "both"]:
        {"sanity": sanity, "oneway": oneway, "beside": beside, "both": both}[part](kernels)


if __name__ == "__main__":
    import faulthandler

    faulthandler.enable()
    main(sys.argv[1:])
