"""swap_blocks of 32,768 random 2 KiB block pairs (64 MiB) between one GPU pool and one
pinned pool, each way: where its CPU time goes (plan, issue, whole call, each call
synchronised after; a cProfile), and the GPU time, wall and CPU per call of swap_blocks
by the layout kernel, by the block kernel (tensor table), and of copy_rows on the same
ids (host and GPU indices), then both kernels at several CTA counts, each against the
contiguous copy of as many bytes. ``steps``: only the CPU time of each step of
execute_blocks, the driver calls included, at 32,768 pairs (the layout kernel's launch)
and at one (the copy engines, issue_dma), and a cProfile of one-pair calls. ``sizes``: the CPU
time of a call from 1 to 32,768 pairs, each call synchronised after and back to back,
and its plan and issue apart (what a call costs whatever its size, and per pair).
``chained``: the layout kernel's chunked launches as execute_blocks issues them (each
chunk's ids uploaded on a side stream, each launch waiting only for its own chunk's)
against the uploads on the caller's stream, each behind the launch before: whether
the GPU waits between launches, by GPU time and wall; every byte checked.

    python3 experiments/swap_blocks_probe.py [steps | sizes | chained]"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import defaultdict

import torch

import kvcopy
from kvcopy import Layout
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.layouts import swap_pools
from kvcopy_bench.timing import call_cpu_us, measure
from kvcopy._plans.blocks import BlockPlan
from kvcopy.testing import engine, plans

PAIRS, BLOCK = 32768, 2048
layout_sides = BlockPlan.layout_sides
stream = torch.cuda.Stream()
gpu, host, mapping = swap_pools(torch, PAIRS, BLOCK)
src_ids, dst_ids = mapping[:, 0].copy(), mapping[:, 1].copy()
gpu_src, gpu_dst = torch.from_numpy(src_ids).cuda(), torch.from_numpy(dst_ids).cuda()


def cpu_us(fn) -> str:
    median, least = call_cpu_us(fn, stream.synchronize, calls=100, warmup=10)
    return f"median {median:7.1f} min {least:7.1f}"


class _Timed:
    """A module of the dispatcher's whose named functions add their time to ``spent``."""

    def __init__(self, module, spent, names) -> None:
        self._module, self._spent, self._names = module, spent, names

    def __getattr__(self, name):
        real = getattr(self._module, name)
        if name not in self._names:
            return real

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = real(*args, **kwargs)
            self._spent[name] += time.perf_counter() - start
            if name == "RowsLaunches":
                return _Timed(out, self._spent, ("launch",))
            return out

        return timed


def launch_steps(src, dst, pairs: int, calls: int = 200) -> None:
    """CPU microseconds per call of each step of execute_blocks (driver calls included)."""
    d, h = engine.blocks, stream.cuda_stream
    plan = plans.plan_blocks(src, dst, mapping[:pairs].copy(), stream=h)
    for _ in range(10):  # (the first call loads the kernel and asks the device once)
        d.execute_blocks(plan, h)
    stream.synchronize()
    spent: dict[str, float] = defaultdict(float)
    # (classification is the shared dispatcher's; the rest the block family's own)
    home = {"settled_classes": engine.dispatch}
    names = (
        "plan_arrays",
        "launch",
        "rows",
        "settled_classes",
        "decide",
        "wait_for_streams",
        "issue_dma",
        "ring",
    )
    real = {name: getattr(home.get(name, d), name) for name in names}
    d.plan_arrays = _Timed(real["plan_arrays"], spent, ("split_block_ids",))
    d.launch = _Timed(real["launch"], spent, ("upload",))
    d.rows = _Timed(real["rows"], spent, ("RowsLaunches",))
    for name in ("settled_classes", "decide", "wait_for_streams", "issue_dma"):
        module = home.get(name, d)
        setattr(module, name, _Timed(module, spent, (name,)).__getattr__(name))
    try:
        whole = 0.0
        for _ in range(calls):
            start = time.perf_counter()
            d.execute_blocks(plan, h)
            whole += time.perf_counter() - start
            stream.synchronize()
    finally:
        for name, value in real.items():
            setattr(home.get(name, d), name, value)
    steps = "  ".join(f"{k} {v / calls * 1e6:.1f}" for k, v in spent.items())
    print(f"execute_blocks {whole / calls * 1e6:.1f} us: {steps} (RowsLaunches: building; launch: issuing)")


def by_pairs(src, dst, direction: str) -> None:
    """CPU microseconds of swap_blocks by pairs: synchronised after each call, back to
    back (synchronised after every fourth), and planning and issuing apart."""
    h = stream.cuda_stream
    for n in (1, 256, 4096, 32768):
        m = mapping[:n].copy()

        def call() -> None:
            kvcopy.swap_blocks(src, dst, m, stream=stream)

        for _ in range(20):
            call()
        stream.synchronize()
        synced, piped, planned, issued = [], [], [], []
        for _ in range(200):
            start = time.perf_counter()
            call()
            synced.append(time.perf_counter() - start)
            stream.synchronize()
        for i in range(200):
            start = time.perf_counter()
            call()
            piped.append(time.perf_counter() - start)
            if i % 4 == 3:
                stream.synchronize()
        stream.synchronize()
        for _ in range(200):
            start = time.perf_counter()
            plan = plans.plan_blocks(src, dst, m, stream=h)
            middle = time.perf_counter()
            engine.blocks.execute_blocks(plan, h)
            planned.append(middle - start)
            issued.append(time.perf_counter() - middle)
            stream.synchronize()

        def us(values: list) -> float:
            return statistics.median(values) * 1e6

        print(
            f"{direction} pairs {n:6d} synchronised {us(synced):6.1f} back to back "
            f"{us(piped):6.1f} plan {us(planned):6.1f} issue {us(issued):6.1f}"
        )


def contiguous_timing(src, dst):
    """The contiguous copy of as many bytes as the pairs move, timed as they are."""
    a, b = src[:PAIRS], dst[:PAIRS]

    def contiguous():
        with torch.cuda.stream(stream):
            b.copy_(a, non_blocking=True)

    return measure(contiguous, stream, repeats=15)


def chained() -> None:
    """swap_blocks as execute_blocks issues it (ids uploaded on a side stream) against
    each chunk's ids uploaded on the caller's stream, behind the launch before."""
    from kvcopy import policy
    from kvcopy.config import config
    from kvcopy.testing import cuda

    own = engine.blocks._launch_as_rows

    def caller_uploads(blocks, sides, kernel, target, src_view, dst_view) -> None:
        n, handle, start = blocks.num_pairs, target.handle, 0
        with engine.ring.ring_for_current_context().reserve(16 * n) as slot:
            for count in policy.id_chunks(n):
                at = 16 * start
                nbytes = cuda.plan_arrays.split_block_ids(blocks.mapping, slot.host + at, start, count)
                cuda.launch.upload(slot.device + at, slot.host + at, nbytes, handle)
                cuda.rows.RowsLaunches(
                    kernel.function_rows,
                    (slot.device + at, *sides[0]),
                    (slot.device + at + 8 * count, *sides[1]),
                    src_view,
                    dst_view,
                    count,
                    1,
                    blocks.geometry.block_bytes,
                    target.rows_ctas(),
                    config.threads_per_cta,
                    handle,
                ).launch()
                start += count
            engine.ring.DescriptorRing.fence(slot, handle)

    for direction, (src, dst) in (("h2d", (host, gpu)), ("d2h", (gpu, host))):
        c = contiguous_timing(src, dst)
        print(f"{direction} contiguous gpu_ms {c.gpu_ms:.3f} wall_ms {c.wall_ms:.3f}")
        for name, way in (
            ("uploads on the caller's stream", caller_uploads),
            ("uploads on a side stream", own),
        ):
            engine.blocks._launch_as_rows = way
            try:
                src.random_(0, 256)
                dst.zero_()
                ran = kvcopy.swap_blocks(src, dst, mapping, stream=stream)
                stream.synchronize()
                ok = torch.equal(
                    dst[torch.from_numpy(mapping[:, 1])].cpu(), src[torch.from_numpy(mapping[:, 0])].cpu()
                )
                t = measure(lambda: kvcopy.swap_blocks(src, dst, mapping, stream=stream), stream, repeats=15)
            finally:
                engine.blocks._launch_as_rows = own
            print(
                f"{direction} {name:<31} ({ran}) gpu_vs {c.gpu_ms / t.gpu_ms:.3f} wall_vs "
                f"{c.wall_ms / t.wall_ms:.3f} cpu_us {t.cpu_us:6.1f} bytes right: {ok}"
            )


if sys.argv[1:] == ["chained"]:
    chained()
    sys.exit(0)

if sys.argv[1:] == ["sizes"]:
    for direction, (src, dst) in (("h2d", (host, gpu)), ("d2h", (gpu, host))):
        by_pairs(src, dst, direction)
    sys.exit(0)

if sys.argv[1:] == ["steps"]:
    for direction, (src, dst) in (("h2d", (host, gpu)), ("d2h", (gpu, host))):
        for pairs in (1, PAIRS):
            print(f"{direction} pairs {pairs:6d}", end=" ")
            launch_steps(src, dst, pairs)
    one = mapping[:1].copy()
    profile = cProfile.Profile()
    profile.enable()
    for i in range(2000):
        kvcopy.swap_blocks(host, gpu, one, stream=stream)
        if i % 100 == 99:
            stream.synchronize()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(30)
    print("h2d pairs 1, 2000 calls:\n" + "\n".join(out.getvalue().splitlines()[6:40]))
    sys.exit(0)

for direction, (src, dst) in (("h2d", (host, gpu)), ("d2h", (gpu, host))):
    h = stream.cuda_stream
    print(f"{direction} plan_blocks   {cpu_us(lambda: plans.plan_blocks(src, dst, mapping, stream=h))}")
    plan = plans.plan_blocks(src, dst, mapping, stream=h)
    print(f"{direction} execute_blocks {cpu_us(lambda: engine.blocks.execute_blocks(plan, h))}")
    print(f"{direction} swap_blocks   {cpu_us(lambda: kvcopy.swap_blocks(src, dst, mapping, stream=stream))}")
    c = contiguous_timing(src, dst)
    print(f"{direction} contiguous gpu_ms {c.gpu_ms:.3f} wall_ms {c.wall_ms:.3f} cpu_us {c.cpu_us:.1f}")
    cases = {"swap_blocks": lambda: kvcopy.swap_blocks(src, dst, mapping, stream=stream)}

    def block_kernel():
        BlockPlan.layout_sides = lambda self: None  # the tensor table's kernel instead
        try:
            kvcopy.swap_blocks(src, dst, mapping, stream=stream)
        finally:
            BlockPlan.layout_sides = layout_sides

    cases["swap_blocks, block kernel"] = block_kernel
    ls, ld = Layout.of(src, slot=0), Layout.of(dst, slot=0)
    cases["copy_rows host ids"] = lambda: kvcopy.copy_rows(ls, ld, src_ids, dst_ids, stream=stream)
    cases["copy_rows gpu ids"] = lambda: kvcopy.copy_rows(ls, ld, gpu_src, gpu_dst, stream=stream)
    prepared = kvcopy.prepare_rows(ls, ld, gpu_src, gpu_dst, stream=stream)
    cases["prepared gpu ids"] = prepared
    for name, fn in cases.items():
        t = measure(fn, stream, repeats=15)
        print(
            f"{direction} {name:<20} gpu_vs {c.gpu_ms / t.gpu_ms:.3f} wall_vs "
            f"{c.wall_ms / t.wall_ms:.3f} cpu_us {t.cpu_us:7.1f} gpu_ms {t.gpu_ms:.3f}"
        )
    for ctas in (4, 8, 16, 32, 64):
        kvcopy.config.host_ctas = ctas
        t = measure(cases["swap_blocks, block kernel"], stream, repeats=15)
        r = measure(cases["swap_blocks"], stream, repeats=15)
        print(
            f"{direction} ctas {ctas:>3} block kernel gpu_vs {c.gpu_ms / t.gpu_ms:.3f} "
            f"layout kernel gpu_vs {c.gpu_ms / r.gpu_ms:.3f}"
        )
    del kvcopy.config.host_ctas
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(100):
        kvcopy.swap_blocks(src, dst, mapping, stream=stream)
        stream.synchronize()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(14)
    print("\n".join(out.getvalue().splitlines()[6:26]))
