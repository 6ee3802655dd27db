"""Experiment: a load whose scattered host blocks the CPU gathers, beside a store.

Below 128 KiB blocks a store and a load at once stay near 0.8 of the contiguous pair
(link_budget.py): the SMs' 128-byte reads of host memory queue behind the store's
writes, and the copy engines, which keep the link full both ways, cost the CPU about a
microsecond per copy. The one path left that reaches the engines without a copy per
block: CPU threads gather the load's host blocks into a contiguous pinned staging
buffer, one copy-engine copy per chunk moves it to a GPU staging buffer, and the copy
kernel scatters it inside the GPU, chunk k+1 gathered while chunk k crosses the link.

Measured here, per block size (64 MiB each way, blocks scattered in 128 MiB pools):
- the gather alone: GB/s with 1, 2, 4 and 8 threads (np.take on thread-pool slices,
  which releases the GIL) and torch.index_select with as many intra-op threads;
- call to completion (wall), of the contiguous copy's or pair's: the load by gather
  alone, and beside a store by the copy kernel on another stream, with 2, 4 and 8
  np.take threads and 8 and 14 index_select threads, against kvcopy.copy_both_ways
  and the kernel load alone.
The loaded bytes are checked once per block size.

Run on a GPU: python3 experiments/cpu_gather_probe.py
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

import numpy as np
import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.timing import call_to_completion_us

KiB, MiB = 1 << 10, 1 << 20
TOTAL = 64 * MiB
CHUNK = 8 * MiB


def wall_ms(fn: Callable[[], object], sync: Callable[[], object], repeats: int = 10) -> float:
    return call_to_completion_us(fn, sync, repeats=repeats, warmup=2) / 1e3


class Gatherer:
    """np.take of index slices on a thread pool (numpy drops the GIL for it)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads)

    def gather(self, src2d: np.ndarray, idx: np.ndarray, out2d: np.ndarray) -> None:
        bounds = np.linspace(0, len(idx), self.threads + 1).astype(int)
        futures = [
            self.pool.submit(np.take, src2d, idx[a:b], 0, out2d[a:b], "clip")
            for a, b in zip(bounds[:-1], bounds[1:])
            if b > a
        ]
        wait(futures)
        for f in futures:
            f.result()


class TorchGatherer:
    """torch.index_select with ``threads`` intra-op threads."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def gather(self, src2d: np.ndarray, idx: np.ndarray, out2d: np.ndarray) -> None:
        torch.set_num_threads(self.threads)
        torch.index_select(torch.from_numpy(src2d), 0, torch.from_numpy(idx), out=torch.from_numpy(out2d))


def main() -> None:
    host_a = torch.empty(2 * TOTAL, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(2 * TOTAL, dtype=torch.uint8, pin_memory=True)
    gpu_a = torch.empty(2 * TOTAL, dtype=torch.uint8, device="cuda")
    gpu_b = torch.empty(2 * TOTAL, dtype=torch.uint8, device="cuda")
    host_a.copy_(torch.randint(0, 255, host_a.shape, dtype=torch.uint8))
    gpu_b.random_(0, 255)
    stage_host = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    stage_gpu = [torch.empty(CHUNK, dtype=torch.uint8, device="cuda") for _ in range(2)]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    done = [torch.cuda.Event(), torch.cuda.Event()]

    def sync() -> None:
        s1.synchronize()
        s2.synchronize()

    def contiguous_load() -> None:
        with torch.cuda.stream(s1):
            gpu_a[:TOTAL].copy_(host_a[:TOTAL], non_blocking=True)

    def contiguous_pair() -> None:
        contiguous_load()
        with torch.cuda.stream(s2):
            host_b[:TOTAL].copy_(gpu_b[:TOTAL], non_blocking=True)

    load_ref = wall_ms(contiguous_load, sync)
    pair_ref = wall_ms(contiguous_pair, sync)
    print(
        f"contiguous: load {TOTAL / load_ref / 1e6:.1f} GB/s wall, pair "
        f"{2 * TOTAL / pair_ref / 1e6:.1f} GB/s wall",
        flush=True,
    )
    rng = np.random.default_rng(0)
    gatherers = {t: Gatherer(t) for t in (1, 2, 4, 8)}
    for block in (4 * KiB, 16 * KiB, 64 * KiB):
        n, per_chunk = TOTAL // block, CHUNK // block
        hidx = rng.permutation(2 * n)[:n].astype(np.int64)
        gidx = rng.permutation(2 * n)[:n].astype(np.int64)
        sidx, didx = rng.permutation(2 * n)[:n], rng.permutation(2 * n)[:n]
        sizes = np.full(n, block, dtype=np.uint64)
        load = (
            np.uint64(host_a.data_ptr()) + hidx.astype(np.uint64) * np.uint64(block),
            np.uint64(gpu_a.data_ptr()) + gidx.astype(np.uint64) * np.uint64(block),
            sizes,
        )
        store = (
            np.uint64(gpu_b.data_ptr()) + sidx.astype(np.uint64) * np.uint64(block),
            np.uint64(host_b.data_ptr()) + didx.astype(np.uint64) * np.uint64(block),
            sizes,
        )
        host2d = host_a.numpy().reshape(-1, block)
        stage2d = [s.numpy().reshape(-1, block) for s in stage_host]
        offsets = np.arange(per_chunk, dtype=np.uint64) * np.uint64(block)
        scatter_src = [np.uint64(g.data_ptr()) + offsets for g in stage_gpu]
        print(f"\n{block // KiB} KiB blocks, {n} per side", flush=True)

        for t, g in gatherers.items():
            out = np.empty((n, block), dtype=np.uint8)
            g.gather(host2d, hidx, out)
            t0 = time.perf_counter()
            for _ in range(3):
                g.gather(host2d, hidx, out)
            seconds = (time.perf_counter() - t0) / 3
            torch.set_num_threads(t)
            src_t, idx_t = torch.from_numpy(host2d), torch.from_numpy(hidx)
            out_t = torch.from_numpy(out)
            torch.index_select(src_t, 0, idx_t, out=out_t)
            t0 = time.perf_counter()
            for _ in range(3):
                torch.index_select(src_t, 0, idx_t, out=out_t)
            t_seconds = (time.perf_counter() - t0) / 3
            print(
                f"  gather alone, {t} threads: np.take {TOTAL / seconds / 1e9:.1f} GB/s, "
                f"torch.index_select {TOTAL / t_seconds / 1e9:.1f} GB/s",
                flush=True,
            )

        def load_by_gather(g: Gatherer | TorchGatherer) -> Callable[[], None]:
            def run() -> None:
                for k, start in enumerate(range(0, n, per_chunk)):
                    buf, end = k % 2, min(n, start + per_chunk)
                    if k >= 2:
                        done[buf].synchronize()  # its last copy out of host staging is over
                    g.gather(host2d, hidx[start:end], stage2d[buf][: end - start])
                    with torch.cuda.stream(s1):
                        stage_gpu[buf][: (end - start) * block].copy_(
                            stage_host[buf][: (end - start) * block], non_blocking=True
                        )
                        kvcopy.copy_batch(
                            scatter_src[buf][: end - start], load[1][start:end], sizes[start:end], stream=s1
                        )
                        done[buf].record(s1)

            return run

        def with_store(fn: Callable[[], object]) -> Callable[[], None]:
            def run() -> None:
                kvcopy.copy_batch(*store, stream=s2)
                fn()

            return run

        gpu_a.zero_()
        load_by_gather(gatherers[4])()
        sync()
        got = gpu_a.view(-1, block)[torch.from_numpy(gidx).cuda()]
        want = host_a.view(-1, block)[torch.from_numpy(hidx)].cuda()
        print(f"  bytes after a gathered load: {'ok' if torch.equal(got, want) else 'WRONG'}")

        kernel_load = lambda: kvcopy.copy_batch(*load, stream=s1)  # noqa: E731
        cases: dict[str, tuple[Callable[[], object], float, int]] = {
            "load, kernel": (kernel_load, load_ref, TOTAL),
            "load + store, kernel (two streams)": (with_store(kernel_load), pair_ref, 2 * TOTAL),
            "copy_both_ways": (lambda: kvcopy.copy_both_ways(store, load, stream=s1), pair_ref, 2 * TOTAL),
        }
        for t in (2, 4, 8):
            cases[f"load by gather, {t} threads"] = (load_by_gather(gatherers[t]), load_ref, TOTAL)
            cases[f"load by gather, {t} threads + store, kernel"] = (
                with_store(load_by_gather(gatherers[t])),
                pair_ref,
                2 * TOTAL,
            )
        for t in (8, 14):
            by_torch = load_by_gather(TorchGatherer(t))
            cases[f"load by index_select, {t} threads"] = (by_torch, load_ref, TOTAL)
            cases[f"load by index_select, {t} threads + store, kernel"] = (
                with_store(by_torch),
                pair_ref,
                2 * TOTAL,
            )
        for name, (fn, ref, moved) in cases.items():
            ms = wall_ms(fn, sync)
            print(f"  {name:<44} {moved / ms / 1e6:6.1f} GB/s wall, {ref / ms:.3f} of contiguous", flush=True)


if __name__ == "__main__":
    main()
