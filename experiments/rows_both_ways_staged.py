"""A store and a load at once in layout form with GPU indices (the layouts
benchmark's 'both ways' rows): the layout kernel's pair against staging sides
through GPU memory, their host rows moved by the copy engines in chunks (two GPU
staging buffers per side, the kernel gathering into or scattering from them at HBM
speed). GPU time spanning both and wall, against the contiguous pair of the same
bytes on two streams.

`sides` (32 MiB each way, staging done here with torch): both sides by the kernel,
the load staged, the store staged, both staged; which sides are worth staging.
`sizes`: copy_rows_both_ways staged (kvcopy._engine.rows_staged) against its kernel
pair from 4 to 32 MiB a side: policy.ROWS_STAGING_MIN_BYTES.
`chunks`: the staged pair at 32 MiB a side with config.staging_bytes from 2 to 16 MiB
(fewer chunks cost less CPU; longer ones fill the pipeline later).
`cpu`: CPU time of a copy_rows_both_ways call at 32 MiB a side of 16 KiB rows, staged
and as the layout kernel's pair, indices on the GPU and on the host, each call
synchronised after. `profile`: where a staged call's CPU goes (cProfile)."""

from __future__ import annotations

import functools
import statistics
import sys
import time

import numpy as np
import torch

import kvcopy
from kvcopy import Layout, policy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.extra import timed_pair

KiB, MiB = 1 << 10, 1 << 20
TOTAL, CHUNK = 32 * MiB, 4 * MiB


class Side:
    """One side's staging: two buffers, a copy stream and a kernel stream, events."""

    def __init__(self) -> None:
        self.bufs = [torch.empty(CHUNK, dtype=torch.uint8, device="cuda") for _ in range(2)]
        self.copy, self.kernel = torch.cuda.Stream(), torch.cuda.Stream()
        self.free = [torch.cuda.Event() for _ in range(2)]
        self.filled = [torch.cuda.Event() for _ in range(2)]
        for e in self.free:
            e.record(torch.cuda.current_stream())

    def start_after(self, origin: torch.cuda.Stream) -> None:
        start = torch.cuda.Event()
        start.record(origin)
        self.copy.wait_event(start)
        self.kernel.wait_event(start)

    @staticmethod
    def join(last: torch.cuda.Stream, origin: torch.cuda.Stream) -> None:
        done = torch.cuda.Event()
        done.record(last)
        origin.wait_event(done)


def staged_load(
    side: Side,
    host: torch.Tensor,
    pool: Layout,
    slots: torch.Tensor,
    row_bytes: int,
    origin: torch.cuda.Stream,
) -> None:
    rows = CHUNK // row_bytes
    side.start_after(origin)
    for k in range(TOTAL // CHUNK):
        b = k % 2
        side.copy.wait_event(side.free[b])
        with torch.cuda.stream(side.copy):
            side.bufs[b].copy_(host[k * CHUNK : (k + 1) * CHUNK], non_blocking=True)
        side.filled[b].record(side.copy)
        side.kernel.wait_event(side.filled[b])
        kvcopy.copy_rows(
            Layout.of(side.bufs[b].view(rows, row_bytes), slot=0),
            pool,
            None,
            slots[k * rows : (k + 1) * rows],
            stream=side.kernel,
        )
        side.free[b].record(side.kernel)
    side.join(side.kernel, origin)


def staged_store(
    side: Side,
    pool: Layout,
    slots: torch.Tensor,
    host: torch.Tensor,
    row_bytes: int,
    origin: torch.cuda.Stream,
) -> None:
    rows = CHUNK // row_bytes
    side.start_after(origin)
    for k in range(TOTAL // CHUNK):
        b = k % 2
        side.kernel.wait_event(side.free[b])
        kvcopy.copy_rows(
            pool,
            Layout.of(side.bufs[b].view(rows, row_bytes), slot=0),
            slots[k * rows : (k + 1) * rows],
            None,
            stream=side.kernel,
        )
        side.filled[b].record(side.kernel)
        side.copy.wait_event(side.filled[b])
        with torch.cuda.stream(side.copy):
            host[k * CHUNK : (k + 1) * CHUNK].copy_(side.bufs[b], non_blocking=True)
        side.free[b].record(side.copy)
    side.join(side.copy, origin)


class Step:
    """A GPU pool of twice ``total`` bytes, a pinned chunk to store into and one to load
    from, and the contiguous pair of the same bytes on streams s1 and s2."""

    def __init__(self, total: int, s1, s2) -> None:
        self.total, self.s1, self.s2 = total, s1, s2
        self.pool_gpu = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        self.out_host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        self.in_host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        self.up = torch.empty(total, dtype=torch.uint8, device="cuda")

    def rows(self, row_bytes: int, rng) -> tuple:
        """(pool, chunk_out, chunk_in, store slots, load slots) of ``row_bytes`` rows,
        the slots at random on the GPU."""
        count = self.total // row_bytes
        order = rng.permutation(2 * count)
        return (
            Layout.of(self.pool_gpu.view(2 * count, row_bytes), slot=0),
            Layout.of(self.out_host.view(count, row_bytes), slot=0),
            Layout.of(self.in_host.view(count, row_bytes), slot=0),
            torch.from_numpy(order[:count].copy()).cuda(),
            torch.from_numpy(order[count:].copy()).cuda(),
        )

    def contiguous(self) -> None:
        with torch.cuda.stream(self.s1):
            self.up.copy_(self.in_host, non_blocking=True)
        with torch.cuda.stream(self.s2):
            self.out_host.copy_(self.pool_gpu[: self.total], non_blocking=True)


def sizes() -> None:
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    rng = np.random.default_rng(6)
    for total in (4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB):
        step = Step(total, s1, s2)
        for row_bytes in (4 * KiB, 16 * KiB, 64 * KiB):
            pool, chunk_out, chunk_in, a, b = step.rows(row_bytes, rng)

            def both(least: int) -> None:
                policy.ROWS_STAGING_MIN_BYTES = least
                kvcopy.copy_rows_both_ways((pool, chunk_out, a), (chunk_in, pool, None, b), stream=s1)

            cases = {
                "contiguous": step.contiguous,
                "kernel pair": functools.partial(both, 1 << 62),
                "staged": functools.partial(both, 1),
            }
            for name, chose, gpu_ms, seconds, pair_ms, pair_s in timed_pair(cases, s1, s2, 9):
                print(
                    f"{total // MiB:>3} MiB a side {row_bytes // KiB:>3} KiB rows  {name:<12} "
                    f"({chose or '-'}) of pair {pair_ms / gpu_ms:.2f} wall "
                    f"{pair_s / seconds:.2f}  gpu_ms {gpu_ms:.3f}",
                    flush=True,
                )


def chunks() -> None:
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    rng = np.random.default_rng(6)
    step = Step(TOTAL, s1, s2)
    policy.ROWS_STAGING_MIN_BYTES = 1
    for row_bytes in (4 * KiB, 16 * KiB, 64 * KiB):
        pool, chunk_out, chunk_in, a, b = step.rows(row_bytes, rng)

        def staged(chunk_bytes: int) -> None:
            kvcopy.config.staging_bytes = chunk_bytes
            kvcopy.copy_rows_both_ways((pool, chunk_out, a), (chunk_in, pool, None, b), stream=s1)

        cases = {"contiguous": step.contiguous}
        cases.update(
            {
                f"chunks of {c // MiB} MiB": functools.partial(staged, c)
                for c in (2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB)
            }
        )
        for name, chose, gpu_ms, seconds, pair_ms, pair_s in timed_pair(cases, s1, s2, 9):
            print(
                f"{row_bytes // KiB:>3} KiB rows  {name:<16} ({chose or '-'}) of pair "
                f"{pair_ms / gpu_ms:.2f} wall {pair_s / seconds:.2f}  gpu_ms {gpu_ms:.3f}",
                flush=True,
            )


def _calls(step: Step, s1: torch.cuda.Stream):
    """The pair's call at 32 MiB a side of 16 KiB rows, indices on the GPU and on the host."""
    pool, chunk_out, chunk_in, a, b = step.rows(16 * KiB, np.random.default_rng(6))
    host_a, host_b = a.cpu().numpy(), b.cpu().numpy()
    return {
        where: functools.partial(
            kvcopy.copy_rows_both_ways, (pool, chunk_out, x), (chunk_in, pool, None, y), stream=s1
        )
        for where, x, y in (("gpu indices", a, b), ("host indices", host_a, host_b))
    }


def cpu() -> None:
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    calls = _calls(Step(TOTAL, s1, s2), s1)
    for name, least in (("staged pair", policy.ROWS_STAGING_MIN_BYTES), ("kernel pair", 1 << 62)):
        policy.ROWS_STAGING_MIN_BYTES = least
        for where, call in calls.items():
            chose = call()
            for _ in range(20):
                call()
            torch.cuda.synchronize()
            spent = []
            for _ in range(100):
                start = time.perf_counter()
                call()
                spent.append(time.perf_counter() - start)
                torch.cuda.synchronize()
            print(
                f"{name}, {where} {chose} call cpu median "
                f"{statistics.median(spent) * 1e6:.1f} min {min(spent) * 1e6:.1f}",
                flush=True,
            )


def profile() -> None:
    """cProfile of 200 staged calls each way of giving the indices: where the CPU goes."""
    import cProfile
    import pstats

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for where, call in _calls(Step(TOTAL, s1, s2), s1).items():
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        for _ in range(200):
            profiler.enable()
            call()
            profiler.disable()
            torch.cuda.synchronize()
        print(f"== staged pair, {where}: 200 calls", flush=True)
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(22)


def main() -> None:
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    step = Step(TOTAL, s1, s2)
    pool_gpu, out_host, in_host = step.pool_gpu, step.out_host, step.in_host
    stores, loads = Side(), Side()
    rng = np.random.default_rng(6)
    for row_bytes in (4 * KiB, 16 * KiB, 64 * KiB):
        count = TOTAL // row_bytes
        pool, chunk_out, chunk_in, a, b = step.rows(row_bytes, rng)
        kernel_store = functools.partial(kvcopy.copy_rows, pool, chunk_out, a, None, stream=s1)
        kernel_load = functools.partial(kvcopy.copy_rows, chunk_in, pool, None, b, stream=s2)
        load_staged = functools.partial(staged_load, loads, in_host, pool, b, row_bytes, s2)
        store_staged = functools.partial(staged_store, stores, pool, a, out_host, row_bytes, s1)
        cases = {
            "contiguous": step.contiguous,
            "kernel pair (copy_rows_both_ways)": functools.partial(
                kvcopy.copy_rows_both_ways, (pool, chunk_out, a), (chunk_in, pool, None, b), stream=s1
            ),
            "store kernel, load staged": lambda: (kernel_store(), load_staged()),
            "store staged, load kernel": lambda: (store_staged(), kernel_load()),
            "both staged": lambda: (store_staged(), load_staged()),
        }
        for name, _, gpu_ms, seconds, pair_ms, pair_s in timed_pair(cases, s1, s2, 9):
            print(
                f"{row_bytes // KiB:>3} KiB rows  {name:<36} of pair {pair_ms / gpu_ms:.2f} "
                f"wall {pair_s / seconds:.2f}  gpu_ms {gpu_ms:.3f}",
                flush=True,
            )
        # every byte right, once, for the staged sides
        pool_gpu.random_(0, 256)
        in_host.random_(0, 256)
        torch.cuda.synchronize()
        expect_store = pool_gpu.view(2 * count, row_bytes)[a.long()].cpu()
        expect_pool = pool_gpu.view(2 * count, row_bytes).clone()
        expect_pool[b.long()] = in_host.view(count, row_bytes).cuda()
        store_staged()
        load_staged()
        torch.cuda.synchronize()
        ok = torch.equal(out_host.view(count, row_bytes), expect_store) and torch.equal(
            pool_gpu.view(2 * count, row_bytes), expect_pool
        )
        print(f"{row_bytes // KiB:>3} KiB rows  staged bytes right: {ok}", flush=True)


if __name__ == "__main__":
    {"sizes": sizes, "chunks": chunks, "cpu": cpu, "profile": profile}.get(
        sys.argv[1] if sys.argv[1:] else "", main
    )()
