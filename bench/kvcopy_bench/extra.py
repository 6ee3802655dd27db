"""Scenarios beyond the block sweep: both directions at once, batches whose host side
is one span, small batches, and swap_blocks on a realistic paged KV cache (compute
beside copies: bench.beside)."""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, cast

import numpy as np

import kvcopy
from kvcopy.testing import engine
from kvcopy_bench.beside import EACH_CALL_ALONE, settings
from kvcopy_bench.scenarios import Pools, last_copier, last_method
from kvcopy_bench.timing import call_to_completion_us, measure, span_ms
from kvcopy_bench.workloads import layered_caches
from kvcopy.policy import RequestedMethod

KiB, MiB = 1 << 10, 1 << 20


def _both_ways(a: tuple, b: tuple, s1: Any, s2: Any, method: RequestedMethod) -> Callable[[], None]:
    """One call that copies batch a on stream s1 and batch b on stream s2."""

    def run() -> None:
        kvcopy.copy_batch(*a, stream=s1, method=method)
        kvcopy.copy_batch(*b, stream=s2, method=method)

    return run


def _each_call_alone(run: Callable[[], None]) -> Callable[[], None]:
    """``run`` with config.traffic_window_ms 0 (each call decided alone), restored after."""

    def alone() -> None:
        with settings(EACH_CALL_ALONE):
            run()

    return alone


def bidirectional(
    blocks=(4 * KiB, 16 * KiB, 64 * KiB, 128 * KiB, 256 * KiB, 1 * MiB, 4 * MiB),
    total: int = 64 * MiB,
    repeats: int = 5,
) -> Iterator[dict]:
    """Host-to-GPU and GPU-to-host at the same time: GPU time spanning both streams and
    wall time (call to completion), against two contiguous copies on two streams.
    kvcopy as an engine would call it (copy_batch per direction on two streams, by
    each method, 'auto' knowing of the other call through config.traffic_window_ms;
    'auto, each call alone': with the window 0) and with
    copy_both_ways (one call, one stream)."""
    import torch

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    h2d, d2h = Pools("h2d", total, "torch"), Pools("d2h", total, "torch")
    for block in blocks:
        count = total // block
        a, b = h2d.scattered(block, count, 1), d2h.scattered(block, count, 2)

        def contiguous() -> None:
            with torch.cuda.stream(s1):
                h2d.dst[:total].copy_(h2d.src[:total], non_blocking=True)
            with torch.cuda.stream(s2):
                d2h.dst[:total].copy_(d2h.src[:total], non_blocking=True)

        cases: dict[str, Callable[[], object]] = {"contiguous": contiguous}
        for method in ("auto", "kernel", "batch"):
            cases[method] = _both_ways(a, b, s1, s2, method)
        cases["auto, each call alone"] = _each_call_alone(_both_ways(a, b, s1, s2, "auto"))
        cases["copy_both_ways"] = functools.partial(kvcopy.copy_both_ways, b, a, stream=s1)
        for name, chose, gpu_ms, seconds, pair_ms, pair_wall in timed_pair(cases, s1, s2, repeats):
            yield {
                "scenario": "bidirectional",
                "block_bytes": block,
                "count": count,
                "method": name,
                "chose": chose,
                "total_gbps": 2 * total / gpu_ms / 1e6,
                "of_contiguous_pair": pair_ms / gpu_ms,
                "wall_gbps": 2 * total / seconds / 1e9,
                "wall_of_contiguous_pair": pair_wall / seconds,
            }


def timed_pair(
    cases: dict[str, Callable[[], object]], s1: Any, s2: Any, repeats: int
) -> Iterator[tuple[str, str, float, float, float, float]]:
    """Each case (the first, 'contiguous', the reference) timed on streams s1 and s2:
    (name, what kvcopy chose, GPU ms spanning both streams, call-to-completion
    seconds, and the reference's two). The reference is timed before the others and
    again after them, and its better reading of each kind kept: a single slow
    reading of the contiguous pair (seen at two thirds of the others of its run)
    would make every ratio of its row meaningless."""
    import torch

    def time_case(fn: Callable[[], object]) -> tuple[float, float]:
        seconds = call_to_completion_us(fn, torch.cuda.synchronize, repeats=repeats, warmup=1) / 1e6
        return span_ms(fn, s1, s2, repeats=repeats, cover_cycles=None), seconds

    timed = []
    for k, (name, fn) in enumerate(cases.items()):
        gpu_ms, seconds = time_case(fn)
        timed.append((name, last_method() if k else "", gpu_ms, seconds))
    again_ms, again_s = time_case(next(iter(cases.values())))
    reference_ms, reference_s = min(timed[0][2], again_ms), min(timed[0][3], again_s)
    timed[0] = (timed[0][0], "", reference_ms, reference_s)
    for name, chose, gpu_ms, seconds in timed:
        yield name, chose, gpu_ms, seconds, reference_ms, reference_s


def host_spans(
    cases=((4 * KiB, 64 * MiB), (16 * KiB, 64 * MiB), (64 * KiB, 64 * MiB)), repeats: int = 5
) -> Iterator[dict]:
    """Batches whose host side is one span (LMCache keeps a chunk in one host buffer),
    the GPU's blocks scattered, as (block, bytes each way) ``cases`` (below
    policy.STAGING_MIN_BYTES 'auto' runs the kernel): both ways at once
    (copy_both_ways) and each way alone (copy_batch), by 'auto' (which stages them:
    kvcopy._engine.staged) and by 'kernel', against the contiguous pair (or copy) in the same
    run: GPU time and wall."""
    import torch

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    largest = max(total for _, total in cases)
    h2d, d2h = Pools("h2d", largest, "torch"), Pools("d2h", largest, "torch")
    rng = np.random.default_rng(7)
    for block, total in cases:
        count = total // block
        host = np.arange(count, dtype=np.uint64) * np.uint64(block)
        sizes = np.full(count, block, dtype=np.uint64)

        def gpu_blocks(pool) -> np.ndarray:
            slots = rng.permutation(2 * count)[:count].astype(np.uint64)
            return np.uint64(pool.data_ptr()) + slots * np.uint64(block)

        load = (np.uint64(h2d.src.data_ptr()) + host, gpu_blocks(h2d.dst), sizes)
        store = (gpu_blocks(d2h.src), np.uint64(d2h.dst.data_ptr()) + host, sizes)

        def contiguous(load_too: bool = True, store_too: bool = True) -> None:
            if load_too:
                with torch.cuda.stream(s1):
                    h2d.dst[:total].copy_(h2d.src[:total], non_blocking=True)
            if store_too:
                with torch.cuda.stream(s2):
                    d2h.dst[:total].copy_(d2h.src[:total], non_blocking=True)

        ways: dict[str, dict[str, Callable[[], object]]] = {
            "both": {"contiguous": contiguous},
            "h2d": {"contiguous": lambda: contiguous(True, False)},
            "d2h": {"contiguous": lambda: contiguous(False, True)},
        }
        for method in ("auto", "kernel"):
            ways["both"][method] = functools.partial(
                kvcopy.copy_both_ways, store, load, stream=s1, method=method
            )
            ways["h2d"][method] = functools.partial(kvcopy.copy_batch, *load, stream=s1, method=method)
            ways["d2h"][method] = functools.partial(kvcopy.copy_batch, *store, stream=s2, method=method)
        for way, calls in ways.items():
            nbytes = 2 * total if way == "both" else total
            for name, chose, gpu_ms, seconds, reference_ms, reference_s in timed_pair(calls, s1, s2, repeats):
                yield {
                    "scenario": "host_spans",
                    "way": way,
                    "block_bytes": block,
                    "count": count,
                    "bytes_each_way": total,
                    "method": name,
                    "chose": chose,
                    "gbps": nbytes / gpu_ms / 1e6,
                    "of_contiguous": reference_ms / gpu_ms,
                    "wall_gbps": nbytes / seconds / 1e9,
                    "wall_of_contiguous": reference_s / seconds,
                }


def swap_blocks_cache(
    block_counts=(16, 64, 256, 1024, 4096), repeats: int = 5, batch_max_copies: int | None = None
) -> Iterator[dict]:
    """swap_blocks on 32 layers x (K, V), 16-token blocks, 8 heads of 128, bf16 (32 KiB blocks).

    Batched DMA is measured beside auto up to ``batch_max_copies`` block copies
    (it costs ~2 us of CPU per copy: 4096 blocks x 64 tensors take half a second)."""
    import torch

    layers, blocks = 32, max(block_counts)  # each call moves up to every block of the cache
    gpu, host = layered_caches(blocks, layers)
    stream = torch.cuda.Stream()
    block_bytes = 16 * 8 * 128 * 2
    rng = np.random.default_rng(4)
    for n in block_counts:
        mapping = np.stack(
            [rng.choice(blocks, n, replace=False), rng.choice(blocks, n, replace=False)], axis=1
        )
        nbytes = n * block_bytes * 2 * layers
        for direction, (src, dst) in {"d2h": (gpu, host), "h2d": (host, gpu)}.items():
            for method in ("auto", "batch"):
                if method == "batch" and batch_max_copies and n * 2 * layers > batch_max_copies:
                    continue
                chose = kvcopy.swap_blocks(src, dst, mapping, stream=stream, method=method)
                t = measure(
                    functools.partial(kvcopy.swap_blocks, src, dst, mapping, stream=stream, method=method),
                    stream,
                    repeats=repeats,
                )
                yield {
                    "scenario": "swap_blocks",
                    "direction": direction,
                    "blocks": n,
                    "tensors": 2 * layers,
                    "method": method,
                    "chose": chose,
                    "gbps": nbytes / (t.gpu_ms * 1e6),
                    "wall_gbps": nbytes / (t.wall_ms * 1e6),
                    "cpu_us": t.cpu_us,
                }
        if 64 <= n and 2 * n <= blocks:
            yield from _swap_both_ways(gpu, host, n, blocks, nbytes, repeats, rng)


def _swap_both_ways(
    gpu: list, host: list, n: int, blocks: int, nbytes: int, repeats: int, rng: Any
) -> Iterator[dict]:
    """A store of n blocks and a load of n others at once: two swap_blocks calls on two
    streams, as an engine with an offload and a reload stream issues them, against one
    swap_blocks_both_ways. GPU time spanning both, and wall (call to completion)."""
    import torch

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    gpu_ids, host_ids = rng.permutation(blocks), rng.permutation(blocks)
    store = (gpu, host, np.stack([gpu_ids[:n], host_ids[:n]], axis=1))
    load = (host, gpu, np.stack([host_ids[n : 2 * n], gpu_ids[n : 2 * n]], axis=1))

    def two_streams() -> tuple[str, str]:
        return (kvcopy.swap_blocks(*store, stream=s1), kvcopy.swap_blocks(*load, stream=s2))

    cases: dict[str, Callable[[], tuple[str, str]]] = {
        "swap_blocks x2, two streams": two_streams,
        "swap_blocks_both_ways": functools.partial(kvcopy.swap_blocks_both_ways, store, load, stream=s1),
    }
    for name, fn in cases.items():
        chose = "/".join(fn())
        gpu_ms = span_ms(fn, s1, s2, repeats=repeats, cover_cycles=None)
        seconds = call_to_completion_us(fn, torch.cuda.synchronize, repeats=repeats, warmup=1) / 1e6
        cpu_us = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            cpu_us.append((time.perf_counter() - started) * 1e6)
        torch.cuda.synchronize()
        yield {
            "scenario": "swap_blocks",
            "direction": "both",
            "blocks": n,
            "tensors": len(gpu),
            "method": name,
            "chose": chose,
            "gbps": 2 * nbytes / gpu_ms / 1e6,
            "wall_gbps": 2 * nbytes / seconds / 1e9,
            "cpu_us": statistics.median(cpu_us),
        }
    yield from _queues_both_ways(gpu, host, store[2], load[2], nbytes, repeats)


def _queues_both_ways(
    gpu: list, host: list, store_ids: Any, load_ids: Any, nbytes: int, repeats: int
) -> Iterator[dict]:
    """The same store and load through TransferQueue: one queue per direction (an
    engine's offload and reload queues), against one queue's job with ``back``. Wall:
    the submits, then wait(); GPU time: the job's own (its events), one queue only
    (two queues' jobs run on two streams, which their results do not span)."""
    with kvcopy.TransferQueue(gpu, host) as out, kvcopy.TransferQueue(host, gpu) as back:

        def two_queues() -> list:
            out.submit(0, store_ids)
            back.submit(0, load_ids)
            return out.wait() + back.wait()

        def one_job() -> list:
            out.submit(0, store_ids, back=load_ids)
            return out.wait()

        for name, fn in (("TransferQueue x2", two_queues), ("TransferQueue, back=", one_job)):
            results = fn()
            chose = (
                "/".join(r.method for r in results)
                if len(results) > 1
                else f"{results[0].method}/{results[0].back_method}"
            )
            walls, gpu_seconds = [], []
            for _ in range(repeats):
                started = time.perf_counter()
                results = fn()
                walls.append(time.perf_counter() - started)
                gpu_seconds.append(results[0].seconds)
            yield {
                "scenario": "swap_blocks",
                "direction": "both",
                "blocks": len(store_ids),
                "tensors": len(gpu),
                "method": name,
                "chose": chose,
                "gbps": (2 * nbytes / statistics.median(gpu_seconds) / 1e9 if len(results) == 1 else None),
                "wall_gbps": 2 * nbytes / statistics.median(walls) / 1e9,
            }


@dataclass(frozen=True)
class SmallBatch:
    """One small batch as small_batches times it: scattered pointers (src, dst,
    sizes), the raw stream handle they go on, that stream's synchronize, and one
    cuMemcpyAsync of the same bytes on it (the reference)."""

    direction: str
    count: int
    nbytes: int
    ptrs: tuple
    handle: int
    synchronize: Callable[[], object]
    contiguous: Callable[[], object]


def small_batch_cases(counts: tuple[int, ...], block: int) -> Iterator[SmallBatch]:
    """Per direction and count, a batch of ``count`` blocks scattered in torch pools,
    on one stream passed as its raw handle (so no framework's own overhead counts)."""
    import torch
    from cuda.bindings import driver as cu

    stream = torch.cuda.Stream()
    handle = stream.cuda_stream

    def synchronize() -> None:
        cu.cuStreamSynchronize(handle)

    for direction in ("h2d", "d2h"):
        pools = Pools(direction, max(counts) * block, "torch")
        for count in counts:
            nbytes = count * block
            contiguous = functools.partial(
                cu.cuMemcpyAsync, pools.dst.data_ptr(), pools.src.data_ptr(), nbytes, handle
            )
            yield SmallBatch(
                direction,
                count,
                nbytes,
                pools.scattered(block, count, count),
                handle,
                synchronize,
                contiguous,
            )


def _afresh(call: Callable[[], object]) -> object:
    """``call`` with kvcopy's recorded small-batch launches forgotten first."""
    engine.replay.forget()
    return call()


def small_batches(counts=(16, 64, 256), block: int = 16 * KiB, repeats: int = 300) -> Iterator[dict]:
    """What a decode step issues: tens of blocks. Call-to-completion wall time (the
    call, then cuStreamSynchronize, from an idle stream), median of ``repeats``,
    against one cuMemcpyAsync of the same bytes timed the same way (small_batch_cases)."""
    for batch in small_batch_cases(counts, block):
        cases: dict[str, Callable[[], object]] = {"contiguous": batch.contiguous}
        for method in ("auto", "kernel", "batch"):
            cases[method] = functools.partial(
                kvcopy.copy_batch, *batch.ptrs, stream=batch.handle, method=cast(RequestedMethod, method)
            )
        # the same call without its recorded launch (kvcopy._engine.replay): what a
        # batch of a shape not seen before costs
        cases["kernel, decided afresh"] = functools.partial(_afresh, cases["kernel"])
        walls, chose, copier = {}, {}, {}
        for name, fn in cases.items():
            walls[name] = call_to_completion_us(fn, batch.synchronize, repeats=repeats)
            chose[name] = "" if name == "contiguous" else last_method()
            copier[name] = "" if name == "contiguous" else last_copier()
        for name, us in walls.items():
            yield {
                "scenario": "small_batches",
                "direction": batch.direction,
                "blocks": batch.count,
                "block_bytes": block,
                "method": name,
                "chose": chose[name],
                "copier": copier[name],
                "wall_us": us,
                "wall_gbps": batch.nbytes / us / 1e3,
                "of_contiguous_wall": walls["contiguous"] / us,
            }
