"""Experiment: is what a copy kernel costs a matmul beside it the SMs its CTAs hold,
or the traffic they move?

Beside a full-GPU bf16 matmul, GPU-to-host copies by SMs cost +4-6% (bulk copier,
4 CTAs of 64 threads) to +29% (registers); host-to-GPU +2%; one CTA of either
costs more than four (+5.7 / +6.9%). Copies by the copy engines cost +0.2%. Here
kernels that move nothing hold SMs for a while (they sleep on the global timer),
relaunched back to back from a thread as the copies are, with the footprints of
kvcopy's copiers and smaller ones: a CTA that leaves room for a matmul CTA on
its SM, and one that does not. The matmul's own kernel (name, grid, block,
registers, shared memory) is read from the profiler, and the same windows are
measured beside kvcopy's copies for reference.

Run on a GPU: python3 experiments/occupancy_probe.py [hold] [lean] [kvcopy] [sizes]
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile

import numpy as np
import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.beside import Copier, Matmuls, paired
from kvcopy_bench.scenarios import Pools

import bulk_probe  # scripts/: the ring kernel, and cuda.core's device, compiler and launch
from bulk_probe import CC, DEVICE, LaunchConfig, Program, ProgramOptions, launch

KiB, MiB = 1 << 10, 1 << 20

SOURCE = r"""
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
/* Holds its SM slot for ns nanoseconds, LIVE registers per thread kept live across
 * the wait and dynamic shared memory as launched, moving no data. */
extern "C" __global__ void hold(unsigned long long ns, int* sink) {
    extern __shared__ int pad[];
#if LIVE > 0
    float v[LIVE];
#pragma unroll
    for (int i = 0; i < LIVE; ++i) v[i] = threadIdx.x * (i + 1);
#endif
    const unsigned long long start = now_ns();
    while (now_ns() - start < ns) {
#if LIVE > 0
#pragma unroll
        for (int i = 0; i < LIVE; ++i) asm volatile("" : "+f"(v[i]));
#endif
        __nanosleep(20000);
    }
    float sum = 0.f;
#if LIVE > 0
#pragma unroll
    for (int i = 0; i < LIVE; ++i) sum += v[i];
#endif
    if (sum == -1.f) { pad[0] = 1; *sink = pad[0]; }   // never: keeps v and pad alive
}
"""


def compile_hold(live: int):
    options = ProgramOptions(arch=f"sm_{CC[0]}{CC[1]}", std="c++17")
    return (
        Program(f"#define LIVE {live}\n" + SOURCE, code_type="c++", options=options)
        .compile("cubin")
        .get_kernel("hold")
    )


def set_attribute(kernel, name: str, value: int) -> None:
    """cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_<name>) for ``kernel`` on this device."""
    from cuda.bindings import driver as cu

    (err,) = cu.cuKernelSetAttribute(
        getattr(cu.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name}"), value, kernel.handle, DEVICE.device_id
    )
    assert err == cu.CUresult.CUDA_SUCCESS, err


def prefer_max_shared(kernel) -> None:
    """Ask for the SM's largest shared-memory carveout for ``kernel``: an SM runs CTAs of
    one carveout at a time, so a CTA launched with a smaller one keeps a matmul CTA
    that wants the largest off its SM even where registers and shared memory would fit."""
    set_attribute(kernel, "PREFERRED_SHARED_MEMORY_CARVEOUT", 100)


def registers(kernel) -> int:
    """Registers per thread of ``kernel``."""
    regs = kernel.attributes.num_regs
    return regs() if callable(regs) else int(regs)  # a method in older cuda.core


class Throttled:
    """A call that enqueues work on ``stream``, kept to at most two calls in flight (the
    copy loop calls as fast as it can; unthrottled launches would queue seconds of work)."""

    def __init__(self, call, stream) -> None:
        self.call, self.stream, self.pending = call, stream, []

    def __call__(self) -> None:
        self.call()
        done = torch.cuda.Event()
        done.record(self.stream)
        self.pending.append(done)
        if len(self.pending) > 2:
            self.pending.pop(0).synchronize()


class Holder:
    """Launches of the hold kernel with one footprint (throttle them)."""

    def __init__(self, ctas: int, threads: int, live: int, smem: int, hold_ns: int, carveout: bool) -> None:
        self.hold_ns, self.launched = hold_ns, 0
        self.kernel = compile_hold(live)
        if carveout:
            prefer_max_shared(self.kernel)
        if smem > 48 * KiB:  # past 48 KiB of dynamic shared memory, a kernel must opt in
            set_attribute(self.kernel, "MAX_DYNAMIC_SHARED_SIZE_BYTES", smem)
        self.config = LaunchConfig(grid=ctas, block=threads, shmem_size=smem)
        self.core_stream = DEVICE.create_stream()
        self.torch_stream = torch.cuda.ExternalStream(int(self.core_stream.handle))
        self.sink = torch.zeros(1, dtype=torch.int32, device="cuda")

    def __call__(self) -> None:
        DEVICE.set_current()  # called from the copy loop's thread
        self.launched += 1
        launch(
            self.core_stream,
            self.config,
            self.kernel,
            np.uint64(self.hold_ns),
            np.uint64(self.sink.data_ptr()),
        )


def matmul_kernel() -> str:
    """The matmul's kernel as the profiler saw it: name, grid, block, registers, smem."""
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.matmul(a, a)
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    found = [e for e in events if e.get("cat") == "kernel"]
    return "; ".join(
        f"{e['name'][:90]} grid {e['args'].get('grid')} block "
        f"{e['args'].get('block')} regs {e['args'].get('registers per thread')} "
        f"smem {e['args'].get('shared memory')} occupancy "
        f"{e['args'].get('est. achieved occupancy %')}"
        for e in found
    )


MS = 1_000_000
FOOTPRINTS = [  # name, CTAs, threads, live registers, dynamic shared memory, hold (ns)
    ("whole SM (1024 thr) x1, 3.6 ms", 1, 1024, 40, 0, 36 * MS // 10),
    ("one warp, 8 regs, 16 KiB x1, 3.6 ms", 1, 32, 0, 16 * KiB, 36 * MS // 10),
    ("one warp, 8 regs, 16 KiB x4, 1.3 ms", 4, 32, 0, 16 * KiB, 13 * MS // 10),
    ("one warp, 8 regs, 40 KiB x4, 1.3 ms", 4, 32, 0, 40 * KiB, 13 * MS // 10),
    ("one warp, 8 regs, 16 KiB x16, 1.3 ms", 16, 32, 0, 16 * KiB, 13 * MS // 10),
    ("bulk-like (64 thr, ~140 regs, 32 KiB) x4, 1.3 ms", 4, 64, 130, 32 * KiB, 13 * MS // 10),
]


def lean_bulk_rows(matmuls: Matmuls, pairs: int) -> None:
    """bulk_probe's one-thread ring kernel (11 registers: a warp of it fits in what the
    matmul's CTA leaves of a register file, and its ring in what it leaves of shared
    memory), GPU-to-host beside the matmul, with the default carveout and the largest."""
    batch = bulk_probe.Batch("d2h", 16 * KiB, 2)
    stream = bulk_probe.Streams(1)
    cs, ts = stream.core[0], stream.torch[0]
    for stages, stage_bytes in ((5, 8 * KiB), (4, 8 * KiB)):
        for carveout in (False, True):
            text = (
                f"#define STAGES {stages}\n#define STAGE_BYTES {stage_bytes}\n"
                f"#define FULL_WAIT 0\n" + bulk_probe.SOURCE
            )
            options = ProgramOptions(arch=f"sm_{CC[0]}{CC[1]}", std="c++17")
            kernel = Program(text, code_type="c++", options=options).compile("cubin").get_kernel("bulk_pairs")
            if carveout:
                prefer_max_shared(kernel)
            regs = registers(kernel)
            batch.bulk(kernel, 4, cs)
            ok = batch.check()
            for ctas in (2, 4, 8) if carveout else (4,):
                call = Throttled(lambda k=kernel, c=ctas: batch.bulk(k, c, cs), ts)
                spread, rates, _ = paired(matmuls, [Copier("d2h", call, ts, bulk_probe.TOTAL)], pairs)
                print(
                    f"lean d2h {stages}x{stage_bytes // KiB}K regs {regs:3d} x{ctas:<2d} "
                    f"{'max carveout' if carveout else 'default carveout'} "
                    f"{'ok' if ok else 'WRONG'}  median {spread['median_slowdown']:+.3f} "
                    f"p25 {spread['p25_slowdown']:+.3f} p75 {spread['p75_slowdown']:+.3f}  "
                    f"copy {rates['d2h']:.1f} GB/s",
                    flush=True,
                )


def kvcopy_rows(matmuls: Matmuls, pairs: int) -> None:
    for direction in ("d2h", "h2d"):
        pools = Pools(direction, 64 * MiB, "torch")
        ptrs = pools.scattered(16 * KiB, 4096, 7)
        stream = torch.cuda.Stream()
        for label, options in (("default", {}), ("1 CTA", {"max_ctas": 1})):

            def call(options=options) -> None:
                kvcopy.copy_batch(*ptrs, stream=stream, method="kernel", **options)

            call()
            variant = kvcopy.last_decision().variant
            spread, rates, _ = paired(matmuls, [Copier(direction, call, stream, 64 * MiB)], pairs)
            print(
                f"copy {direction} 16 KiB kernel {label:8s} ({variant})  median "
                f"{spread['median_slowdown']:+.3f} p25 {spread['p25_slowdown']:+.3f} p75 "
                f"{spread['p75_slowdown']:+.3f}  copy {rates[direction]:.1f} GB/s",
                flush=True,
            )


def batch_size_rows(matmuls: Matmuls, pairs: int) -> None:
    """kvcopy's default kernel beside the matmul, continuous batches of 16 KiB blocks of
    64 MiB down to 1 MiB: how long each launch runs, against what it costs."""
    for direction in ("d2h", "h2d"):
        for total in (64 * MiB, 16 * MiB, 4 * MiB, 1 * MiB):
            pools = Pools(direction, total, "torch")
            ptrs = pools.scattered(16 * KiB, total // (16 * KiB), 9)
            stream = torch.cuda.Stream()

            def call() -> None:
                kvcopy.copy_batch(*ptrs, stream=stream)

            call()
            decision = kvcopy.last_decision()
            spread, rates, _ = paired(matmuls, [Copier(direction, call, stream, total)], pairs)
            print(
                f"batch {direction} {total // MiB:2d} MiB of 16 KiB {decision.method} "
                f"({decision.variant})  median {spread['median_slowdown']:+.3f} p25 "
                f"{spread['p25_slowdown']:+.3f} p75 {spread['p75_slowdown']:+.3f}  copy "
                f"{rates[direction]:.1f} GB/s",
                flush=True,
            )


def main(parts: list[str]) -> None:
    pairs = int(os.environ.get("PAIRS", "8"))
    print(
        f"# occupancy_probe on {torch.cuda.get_device_name()} (sm_{CC[0]}{CC[1]}, "
        f"{DEVICE.properties.multiprocessor_count} SMs); bf16 8192^2 matmul windows, "
        f"{pairs} alone/beside pairs",
        flush=True,
    )
    try:
        print(f"matmul kernel: {matmul_kernel()}", flush=True)
    except Exception as exc:  # the profiler is a nicety here
        print(f"matmul kernel: profiler failed ({type(exc).__name__}: {exc})")
    matmuls = Matmuls()
    if "hold" in parts:
        for (name, ctas, threads, live, smem, hold_ns), carveout in itertools.product(
            FOOTPRINTS, (False, True)
        ):
            holder = Holder(ctas, threads, live, smem, hold_ns, carveout)
            name += ", max carveout" if carveout else ""
            copier = Copier("hold", Throttled(holder, holder.torch_stream), holder.torch_stream, 0)
            spread, _, alone = paired(matmuls, [copier], pairs)
            print(
                f"hold {name:64s} regs/thread {registers(holder.kernel):3d} launches "
                f"{holder.launched:5d}  median {spread['median_slowdown']:+.3f} p25 "
                f"{spread['p25_slowdown']:+.3f} p75 {spread['p75_slowdown']:+.3f}  "
                f"(alone {alone:.2f} ms)",
                flush=True,
            )
    if "lean" in parts:
        lean_bulk_rows(matmuls, pairs)
    if "kvcopy" in parts:
        kvcopy_rows(matmuls, pairs)
    if "sizes" in parts:
        batch_size_rows(matmuls, pairs)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("occupancy_probe needs a CUDA GPU")
    main(sys.argv[1:] or ["hold", "lean", "kvcopy", "sizes"])
