"""Steady-state CPU time of kvcopy's calls, call to return, beside the floor of one
driver call measured in the same run.

Each row calls the same thing again and again with the same objects, as an engine
does every step (the offload worker per scheduler step, HiCache and LMCache per
layer), and prints the median and quartile of the call-to-return microseconds after
warm-up. The stream is synchronised after every call, outside the timing, so that
no row is slowed by a full queue. Blocks are small (2 KiB) so that the GPU work of
the large rows stays short, and the drop-ins move a 128-byte item a token and layer
(the all-layer ops 2 MiB a call): a call's CPU work does not depend on what it moves,
but its time does where the bytes are many, since the GPU's writes into host memory
evict the caller's working set from the CPU's caches (the last row, the all-layer op
with 2 KiB items, 32 MiB a call, shows that cost; it has no target).
torch's current stream is the benchmark's own throughout (set once, as an engine's
step sets it): the drop-ins copy on it, and no row times torch's stream switch.

The floor rows: a bare ``cuda.bindings`` ``cuMemcpyAsync`` of 2 KiB from pinned
memory, and a torch ``copy_`` of 2 KiB. The target column is the CPU time each
call is to be held to (docs/performance.md, "CPU time per call").

    python3 bench/steady_calls.py [--calls N] [--only TEXT] [--profile TEXT]

``--only`` runs the rows whose label contains TEXT; ``--profile`` prints where the
time of those rows goes (cProfile, which also times Cython functions).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

BLOCK_SHAPE = (16, 1, 64)  # bf16: 2 KiB a block


def median_quartile(call: Callable[[], object], sync: Callable[[], None], calls: int) -> tuple[float, float]:
    """Median and first quartile of ``calls`` timed calls, µs, each after a sync."""
    for _ in range(20):
        call()
    sync()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        sync()
    quartiles = statistics.quantiles(times, n=4)
    return statistics.median(times) * 1e6, quartiles[0] * 1e6


def rows(torch, stream) -> list[tuple[str, float | None, Callable[[], object]]]:
    """(label, target µs or None, call) for every row, the objects made once. A row
    whose objects cannot be made here is left out, with the reason on stderr."""
    import kvcopy
    from cuda.bindings import driver as cu
    from kvcopy.compat import lmcache, sglang

    def gpu(n: int, layers: int = 1) -> list:
        return [torch.empty((n,) + BLOCK_SHAPE, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]

    def host(n: int, layers: int = 1) -> list:
        return [torch.empty((n,) + BLOCK_SHAPE, dtype=torch.bfloat16, pin_memory=True) for _ in range(layers)]

    rng = np.random.default_rng(0)

    def pairs(blocks: int, n: int) -> np.ndarray:
        return np.stack([rng.choice(blocks, n, replace=False), rng.choice(blocks, n, replace=False)], axis=1)

    pinned = torch.empty(2048, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(2048, dtype=torch.uint8, device="cuda")
    raw_stream = stream.cuda_stream

    def bare_driver() -> None:
        cu.cuMemcpyAsync(device.data_ptr(), pinned.data_ptr(), 2048, raw_stream)

    out: list[tuple[str, float | None, Callable[[], object]]] = [
        ("floor: cuMemcpyAsync 2 KiB (cuda.bindings)", None, bare_driver),
        ("floor: torch copy_ 2 KiB", None, lambda: device.copy_(pinned, non_blocking=True)),
    ]

    one_g, one_h = gpu(64), host(64)
    one = pairs(64, 1)
    out.append(
        (
            "swap_blocks 1 pair, 1 tensor a side",
            8,
            lambda: kvcopy.swap_blocks(one_g, one_h, one, stream=stream),
        )
    )
    layer_g, layer_h = gpu(64, 32), host(64, 32)
    out.append(
        (
            "swap_blocks 1 pair, 32 tensors a side",
            12,
            lambda: kvcopy.swap_blocks(layer_g, layer_h, one, stream=stream),
        )
    )
    # (the same caches as arrays: GPU tensors through __cuda_array_interface__, the pinned
    # host tensors as NumPy arrays, each kept as torch tensors are)
    arrays_g = [_ArrayInterface(t.view(torch.uint8)) for t in layer_g]
    arrays_h = [t.view(torch.uint8).numpy() for t in layer_h]
    out.append(
        (
            "swap_blocks 1 pair, 32 arrays a side (array interface, NumPy)",
            None,
            lambda: kvcopy.swap_blocks(arrays_g, arrays_h, one, stream=stream),
        )
    )
    many_g, many_h = gpu(8192, 64), host(8192, 64)
    many = pairs(8192, 4096)
    out.append(
        (
            "swap_blocks 4096 pairs, 64 tensors a side",
            60,
            lambda: kvcopy.swap_blocks(many_g, many_h, many, stream=stream),
        )
    )
    big_g, big_h = gpu(65536), host(65536)
    big = pairs(65536, 32768)
    out.append(
        (
            "swap_blocks 32768 pairs, 1 tensor a side",
            120,
            lambda: kvcopy.swap_blocks(big_g, big_h, big, stream=stream),
        )
    )

    src_pool = torch.empty(2 * 8192 * 2048, dtype=torch.uint8, pin_memory=True)
    dst_pool = torch.empty(2 * 8192 * 2048, dtype=torch.uint8, device="cuda")
    slots = rng.permutation(2 * 8192)[:8192].astype(np.uint64) * np.uint64(2048)
    src_ptrs = np.uint64(src_pool.data_ptr()) + slots
    dst_ptrs = np.uint64(dst_pool.data_ptr()) + slots[::-1].copy()
    sizes = np.full(8192, 2048, dtype=np.uint64)
    s1, d1, z1 = src_ptrs[:1].copy(), dst_ptrs[:1].copy(), sizes[:1].copy()
    out.append(("copy_batch 1 copy", 6, lambda: kvcopy.copy_batch(s1, d1, z1, stream=stream)))
    out.append(
        ("copy_batch 8192 copies", 30, lambda: kvcopy.copy_batch(src_ptrs, dst_ptrs, sizes, stream=stream))
    )

    tokens_g = torch.empty(8192, 1024, dtype=torch.bfloat16, device="cuda")
    tokens_h = torch.empty(8192, 1024, dtype=torch.bfloat16, pin_memory=True)
    src_layout, dst_layout = kvcopy.Layout.of(tokens_g, slot=0), kvcopy.Layout.of(tokens_h, slot=0)
    index_h = torch.from_numpy(rng.choice(8192, 256, replace=False).astype(np.int64))
    index_g = index_h.cuda()
    cupy_like = _ArrayInterface(index_g)
    out.append(
        (
            "copy_rows 256 rows, GPU indices (torch)",
            5,
            lambda: kvcopy.copy_rows(src_layout, dst_layout, index_g, index_g, stream=stream),
        )
    )
    out.append(
        (
            "copy_rows 256 rows, GPU indices (__cuda_array_interface__)",
            5,
            lambda: kvcopy.copy_rows(src_layout, dst_layout, cupy_like, cupy_like, stream=stream),
        )
    )
    out.append(
        (
            "copy_rows 256 rows, host indices",
            15,
            lambda: kvcopy.copy_rows(src_layout, dst_layout, index_h, index_h, stream=stream),
        )
    )

    layers, item = 32, 128

    def caches(item_bytes: int) -> list:
        shape = (4096, item_bytes // 2)
        return [
            [
                torch.empty(shape, dtype=torch.bfloat16, device=where, pin_memory=where == "cpu")
                for _ in range(layers)
            ]
            for where in ("cuda", "cpu", "cuda", "cpu")
        ]

    k_g, k_h, v_g, v_h = caches(item)
    hicache_idx = torch.from_numpy(rng.choice(4096, 256, replace=False).astype(np.int64)).cuda()

    def per_layer() -> None:
        sglang.transfer_kv_per_layer(k_g[0], k_h[0], v_g[0], v_h[0], hicache_idx, hicache_idx, item)

    out.append(("SGLang transfer_kv_per_layer, 256 tokens", 8, per_layer))

    def table(tensors: list) -> object:
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device="cuda")

    def all_layer_of(tensors: list, item_bytes: int) -> Callable[[], None]:
        tables = [table(t) for t in tensors]
        return lambda: sglang.transfer_kv_all_layer(
            tables[0], tables[1], tables[2], tables[3], hicache_idx, hicache_idx, item_bytes, layers
        )

    out.append(
        ("SGLang transfer_kv_all_layer, 32 layers, 256 tokens", 8, all_layer_of([k_g, k_h, v_g, v_h], item))
    )

    heads = item // 2 // 128 or 1  # (LMCache's chunk: as many bytes a token and layer as above)
    flash = [
        torch.empty(2, 256, 16, heads, item // 2 // heads, dtype=torch.bfloat16, device="cuda")
        for _ in range(layers)
    ]
    flash_ptrs = torch.tensor([c.data_ptr() for c in flash], dtype=torch.int64).pin_memory()
    chunk = torch.empty(2, layers, 256, item // 2, dtype=torch.bfloat16, pin_memory=True)
    slot_mapping = torch.from_numpy(rng.choice(256 * 16, 256, replace=False)).cuda()

    def lmcache_store() -> None:
        lmcache.multi_layer_kv_transfer(
            chunk, flash_ptrs, slot_mapping, flash[0].device, 256 * 16, True, False
        )

    out.append(("LMCache multi_layer_kv_transfer, 32 layers, 256 tokens", 10, lmcache_store))
    out.append(("vLLM CopyBackend.submit, 64 planes x 8 blocks, a new job a call", 15, vllm_job(torch, rng)))
    wide = caches(2048)
    out.append(
        ("SGLang transfer_kv_all_layer as above, 2 KiB items (32 MiB a call)", None, all_layer_of(wide, 2048))
    )
    return out


def vllm_job(torch, rng: np.random.Generator) -> Callable[[], None]:
    """vLLM's offload worker storing a job a step: 8 scattered blocks of 2 KiB of each of
    64 layer planes (32 layers' K and V) into the host's blocks, a run a block and plane
    (vLLM's CopyRunDescriptor), submitted to kvcopy's CopyBackend and retired. Each step
    stores other blocks, as a serving engine's do: the calls go through 16 jobs in turn."""
    from kvcopy.compat.vllm import CopyBackend, CopyRunDescriptor

    block, blocks = 2048, 1024
    planes_g = [torch.empty(blocks * block, dtype=torch.uint8, device="cuda") for _ in range(64)]
    planes_h = [torch.empty(blocks * block, dtype=torch.uint8, pin_memory=True) for _ in range(64)]

    def job() -> list:
        src_ids, dst_ids = rng.choice(blocks, 8, replace=False), rng.choice(blocks, 8, replace=False)
        return [
            CopyRunDescriptor(
                g.data_ptr() + int(s) * block, h.data_ptr() + int(d) * block, block, 1, block, block
            )
            for g, h in zip(planes_g, planes_h)
            for s, d in zip(src_ids, dst_ids)
        ]

    jobs = [job() for _ in range(16)]
    backend = CopyBackend()
    step = [0]

    def submit() -> None:
        backend.submit(jobs[step[0] % len(jobs)])
        backend.finish_transfer()
        step[0] += 1

    submit.keep = (planes_g, planes_h)  # type: ignore[attr-defined]
    return submit


class _ArrayInterface:
    """A GPU array seen only through __cuda_array_interface__ (as CuPy and Numba give)."""

    def __init__(self, tensor) -> None:
        self._tensor = tensor
        self.__cuda_array_interface__ = dict(tensor.__cuda_array_interface__, stream=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls a row")
    parser.add_argument("--only", default="", help="rows whose label contains this")
    parser.add_argument("--profile", default="", help="profile rows whose label contains this")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("steady_calls: no CUDA GPU here; this benchmark needs one", file=sys.stderr)
        return 2
    from kvcopy_bench.cli import first_use_calibration

    first_use_calibration(0)  # (none running beside the timed calls)
    stream = torch.cuda.Stream()
    print(f"{torch.cuda.get_device_name()}; median and p25 of {args.calls} calls, µs")
    print(f"{'call':60s} {'median':>8s} {'p25':>8s} {'target':>7s}")
    # (the drop-ins copy on torch's current stream: set once, as an engine's step sets
    # it, so that no row times torch's own stream switch)
    with torch.cuda.stream(stream):
        return _run_rows(args, torch, stream)


def _run_rows(args: argparse.Namespace, torch: Any, stream: Any) -> int:
    """Time (and where asked, profile) every row ``args`` selects; 0."""
    for label, target, call in rows(torch, stream):
        if args.only not in label:
            continue
        calls = (
            args.calls if "4096 pairs" not in label and "32768" not in label else max(args.calls // 10, 20)
        )
        try:
            median, p25 = median_quartile(call, stream.synchronize, calls)
        except Exception as exc:  # (a row that fails says so; the others still run)
            print(f"{label:60s} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        shown = "" if target is None else f"{target:7d}"
        print(f"{label:60s} {median:8.1f} {p25:8.1f} {shown}", flush=True)
        if args.profile and args.profile in label:
            profile(call, stream.synchronize)
    return 0


def profile(call: Callable[[], object], sync: Callable[[], None], calls: int = 300) -> None:
    """Print the functions that take the most of ``call``'s own time."""
    prof = cProfile.Profile()
    for _ in range(calls):
        prof.enable()
        call()
        prof.disable()
        sync()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    sys.exit(main())
