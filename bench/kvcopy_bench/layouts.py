"""Layout transfers against the contiguous copy of the same bytes, in one run.

    python bench/layouts.py [--out FILE.json]

Scenarios: token-slot gathers and scatters between vLLM-style paged GPU caches and a
pinned LMCache-style chunk (32 layers x K and V x 256 tokens of 2 KiB rows, 32 MiB;
MLA rows of 1152 B), and strided runs of 512 B and 128 B fragments (TP-rank head
fragments into a canonical host page). Each row: kvcopy.copy_rows with GPU-resident
indices, the same transfer as pointer copies (kvcopy.copy_batch, one copy per row or
fragment), vLLM's own way with the same fragments (loads: a Triton kernel of its kind,
its 12-program grid, kvcopy_bench.triton_alt, where Triton runs; stores: batched DMA,
one cuMemcpyBatchAsync entry per fragment), and a contiguous copy
of as many bytes; GPU time (events, CPU time hidden behind a sleep kernel), CPU time
per call (copy_rows, and the same transfer prepared once by kvcopy.prepare_rows) and
wall time (call to completion), medians. `python bench/run.py` runs it as its
layouts stage.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import numpy as np

import kvcopy
from kvcopy import Layout
from kvcopy_bench.extra import timed_pair
from kvcopy_bench.gpu import gpu_or_exit
from kvcopy_bench.scenarios import triton_block_copier
from kvcopy_bench.timing import measure

KiB, MiB = 1 << 10, 1 << 20


def _pointers(src: Layout, dst: Layout, src_slots, dst_slots, rows: int):
    """The transfer as pointer copies (what an engine without layouts would issue)."""
    s = np.arange(rows) if src_slots is None else np.asarray(src_slots)
    d = np.arange(rows) if dst_slots is None else np.asarray(dst_slots)
    a, b = src.row_addresses(s).ravel(), dst.row_addresses(d).ravel()
    return a, b, np.full(a.size, src.row_bytes, dtype=np.uint64)


def token_rows(torch, row: int, planes_per_layer: int, layers: int = 32, tokens: int = 256):
    """Paged GPU caches (one [planes, blocks, 16, row] per layer) and a pinned chunk."""
    blocks = 4 * tokens // 16
    caches = [
        torch.empty((planes_per_layer, blocks, 16, row), dtype=torch.uint8, device="cuda")
        for _ in range(layers)
    ]
    chunk = torch.empty((planes_per_layer, layers, tokens, row), dtype=torch.uint8, pin_memory=True)
    slots = torch.randperm(blocks * 16, device="cuda")[:tokens]
    return (
        Layout.of(caches, planes=(0,), page=1, slot=2),
        Layout.of(chunk, planes=(1, 0), slot=2),
        slots,
        (caches, chunk),
    )


def fragment_runs(torch, fragment: int, total: int = 32 * MiB, heads_per_page: int = 8):
    """A TP rank's head fragments (contiguous on the GPU) and their places in canonical
    host pages that hold every rank's heads (stride: heads_per_page fragments)."""
    count = total // fragment
    gpu = torch.empty(total, dtype=torch.uint8, device="cuda")
    host = torch.empty(total * heads_per_page, dtype=torch.uint8, pin_memory=True)
    near = Layout.from_pointers([gpu.data_ptr()], slots=count, row_bytes=fragment, keep=(gpu,))
    far = Layout.from_pointers(
        [host.data_ptr()],
        slots=count,
        row_bytes=fragment,
        slot_stride=fragment * heads_per_page,
        keep=(host,),
    )
    return near, far, count, (gpu, host)


def _on(torch, stream, copy):
    """``copy`` issued on ``stream`` (torch's copies go to its current stream)."""

    def call():
        with torch.cuda.stream(stream):
            copy()

    return call


def row(name: str, nbytes: int, layout_t, prepared_t, pointer_t, vllm_t, contiguous_t) -> dict:
    gbps = lambda ms: nbytes / (ms * 1e6)  # noqa: E731
    return {
        "scenario": name,
        "bytes": nbytes,
        "gpu_gbps": gbps(layout_t.gpu_ms),
        "wall_gbps": gbps(layout_t.wall_ms),
        "cpu_us": layout_t.cpu_us,
        "prepared_cpu_us": prepared_t.cpu_us,
        "prepared_wall_gbps": gbps(prepared_t.wall_ms),
        "pointer_gpu_gbps": gbps(pointer_t.gpu_ms),
        "pointer_cpu_us": pointer_t.cpu_us,
        "vllm_gpu_gbps": None if vllm_t is None else gbps(vllm_t.gpu_ms),
        "contiguous_gpu_gbps": gbps(contiguous_t.gpu_ms),
        "contiguous_wall_gbps": gbps(contiguous_t.wall_ms),
        "gpu_vs_contiguous": contiguous_t.gpu_ms / layout_t.gpu_ms,
        "wall_vs_contiguous": contiguous_t.wall_ms / layout_t.wall_ms,
        "prepared_wall_vs_contiguous": contiguous_t.wall_ms / prepared_t.wall_ms,
        "vs_pointer_path": pointer_t.gpu_ms / layout_t.gpu_ms,
        "vs_vllm": None if vllm_t is None else vllm_t.gpu_ms / layout_t.gpu_ms,
    }


def _measure_all(
    torch,
    stream,
    nbytes: int,
    src: Layout,
    dst: Layout,
    s,
    d,
    rows: int,
    host_bytes,
    gpu_bytes,
    h2d: bool,
    name: str,
) -> dict:
    """One scenario's row: copy_rows, prepared, pointers, vLLM's way, contiguous."""
    ps = _pointers(
        src, dst, None if s is None else s.cpu().numpy(), None if d is None else d.cpu().numpy(), rows
    )
    prepared = kvcopy.prepare_rows(src, dst, s, d, rows=rows, stream=stream)
    if h2d:
        vllm_fn = triton_block_copier(ps[0], ps[1], src.piece_bytes, stream)
    else:  # vLLM stores by batched DMA, one entry per fragment
        vllm_fn = lambda: kvcopy.copy_batch(*ps, stream=stream, method="batch")  # noqa: E731
    a, b = (host_bytes, gpu_bytes) if h2d else (gpu_bytes, host_bytes)
    return row(
        name,
        nbytes,
        measure(lambda: kvcopy.copy_rows(src, dst, s, d, rows=rows, stream=stream), stream, repeats=15),
        measure(prepared, stream, repeats=15),
        measure(lambda: kvcopy.copy_batch(*ps, stream=stream), stream, repeats=15),
        None if vllm_fn is None else measure(vllm_fn, stream, repeats=5),
        measure(_on(torch, stream, lambda: b.copy_(a, non_blocking=True)), stream, repeats=15),
    )


def run(torch) -> list[dict]:
    stream = torch.cuda.Stream()
    out = []
    cases = [
        ("tokens 2 KiB", token_rows(torch, 2 * KiB, 2)),
        ("tokens MLA 1152 B", token_rows(torch, 1152, 1)),
    ]
    for name, (paged, chunk, slots, keep) in cases:
        nbytes = paged.num_planes * len(slots) * paged.row_bytes
        gpu_side = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host_side = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        for direction, (src, dst, s, d) in (
            ("d2h", (paged, chunk, slots, None)),
            ("h2d", (chunk, paged, None, slots)),
        ):
            out.append(
                _measure_all(
                    torch,
                    stream,
                    nbytes,
                    src,
                    dst,
                    s,
                    d,
                    len(slots),
                    host_side,
                    gpu_side,
                    direction == "h2d",
                    f"{name} {direction}",
                )
            )
    for fragment in (512, 128):
        near, far, count, keep = fragment_runs(torch, fragment)
        nbytes = count * fragment
        flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        for direction, (src, dst) in (("h2d", (far, near)), ("d2h", (near, far))):
            out.append(
                _measure_all(
                    torch,
                    stream,
                    nbytes,
                    src,
                    dst,
                    None,
                    None,
                    count,
                    flat_host,
                    keep[0],
                    direction == "h2d",
                    f"runs {fragment} B {direction}",
                )
            )
    return out


def swap_pools(torch, pairs: int, block: int):
    """A GPU pool and a pinned pool of 2 x ``pairs`` blocks of ``block`` bytes, and a
    mapping of ``pairs`` random (source, destination) ids, each side's distinct."""
    gpu = torch.empty((2 * pairs, block), dtype=torch.uint8, device="cuda")
    host = torch.empty((2 * pairs, block), dtype=torch.uint8, pin_memory=True)
    rng = np.random.default_rng(5)
    mapping = np.stack(
        [rng.choice(2 * pairs, pairs, replace=False), rng.choice(2 * pairs, pairs, replace=False)], axis=1
    )
    return gpu, host, mapping


def swap_blocks_rows(torch, pairs: int = 32768, block: int = 2 * KiB) -> list[dict]:
    """swap_blocks of ``pairs`` random block pairs (64 MiB of 2 KiB blocks) between one
    GPU pool and one pinned pool of twice as many blocks, each way, against the
    contiguous copy of as many bytes: GPU time, CPU per call and call to completion."""
    stream = torch.cuda.Stream()
    gpu, host, mapping = swap_pools(torch, pairs, block)
    nbytes = pairs * block
    out = []
    for direction, (src, dst) in (("h2d", (host, gpu)), ("d2h", (gpu, host))):
        a, b = src[:pairs], dst[:pairs]
        method = kvcopy.swap_blocks(src, dst, mapping, stream=stream)
        t = measure(lambda: kvcopy.swap_blocks(src, dst, mapping, stream=stream), stream, repeats=15)
        c = measure(_on(torch, stream, lambda: b.copy_(a, non_blocking=True)), stream, repeats=15)
        out.append(
            {
                "scenario": f"swap_blocks {pairs} x {block // KiB} KiB {direction}",
                "bytes": nbytes,
                "method": method,
                "gpu_gbps": nbytes / (t.gpu_ms * 1e6),
                "wall_gbps": nbytes / (t.wall_ms * 1e6),
                "cpu_us": t.cpu_us,
                "gpu_vs_contiguous": c.gpu_ms / t.gpu_ms,
                "wall_vs_contiguous": c.wall_ms / t.wall_ms,
            }
        )
    return out


def both_ways_rows(
    torch, rows_bytes=(4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB), total: int = 32 * MiB, repeats: int = 7
) -> list[dict]:
    """A serving step in layout form: a store of ``total`` bytes of rows from a GPU pool
    at random slots into a pinned chunk, and a load of as many from another pinned chunk
    into other slots, by one copy_rows_both_ways (indices on the GPU, and on the host),
    against two contiguous copies on two streams: GPU time spanning both, and wall."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    pool_gpu = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    out_host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    in_host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    up, down = torch.empty(total, dtype=torch.uint8, device="cuda"), out_host
    rng = np.random.default_rng(6)
    rows_out = []
    for row_bytes in rows_bytes:
        count = total // row_bytes
        pool = Layout.of(pool_gpu.view(2 * count, row_bytes), slot=0)
        chunk_out = Layout.of(out_host.view(count, row_bytes), slot=0)
        chunk_in = Layout.of(in_host.view(count, row_bytes), slot=0)
        order = rng.permutation(2 * count)
        store_slots, load_slots = order[:count].copy(), order[count:].copy()

        def contiguous() -> None:
            with torch.cuda.stream(s1):
                up.copy_(in_host, non_blocking=True)
            with torch.cuda.stream(s2):
                down.copy_(pool_gpu[:total], non_blocking=True)

        cases: dict = {"contiguous": contiguous}
        for where, (a, b) in (
            ("gpu", (torch.from_numpy(store_slots).cuda(), torch.from_numpy(load_slots).cuda())),
            ("host", (store_slots, load_slots)),
        ):
            cases[f"copy_rows_both_ways, {where} indices"] = functools.partial(
                kvcopy.copy_rows_both_ways, (pool, chunk_out, a), (chunk_in, pool, None, b), stream=s1
            )
        for name, chose, gpu_ms, seconds, pair_ms, pair_s in timed_pair(cases, s1, s2, repeats):
            rows_out.append(
                {
                    "scenario": f"both ways {row_bytes // KiB} KiB rows {total // MiB} MiB",
                    "method": name,
                    "chose": chose,
                    "bytes": 2 * total,
                    "gpu_gbps": 2 * total / gpu_ms / 1e6,
                    "of_contiguous_pair": pair_ms / gpu_ms,
                    "wall_of_contiguous_pair": pair_s / seconds,
                }
            )
    return rows_out


def run_here() -> list[dict]:
    """run(), swap_blocks_rows() and both_ways_rows() (32 MiB each way, and 64 MiB) on
    torch's current GPU (python bench/run.py's layouts stage)."""
    import torch

    # (64 MiB each way: where the policy stages a batch whose host side is one span)
    return (
        run(torch)
        + swap_blocks_rows(torch)
        + both_ways_rows(torch)
        + both_ways_rows(torch, (16 * KiB, 64 * KiB), 64 * MiB)
    )


def print_rows(name: str, rows: list[dict]) -> None:
    print(
        f"{name}: layout transfers (GB/s; ratios against the contiguous copy, the pointer "
        "path and vLLM's way (loads: Triton; stores: batched DMA), GPU time)"
    )
    print(
        f"{'scenario':<22} {'MiB':>5} {'gpu':>6} {'wall':>6} {'cpu_us':>7} {'prep_us':>7} "
        f"{'contig':>6} {'vs_contig':>9} {'wall_vs':>7} {'pointer':>7} {'vs_ptr':>6} "
        f"{'vllm':>6} {'vs_vllm':>7}"
    )
    dash = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        if r["scenario"].startswith("both ways"):
            print(
                f"{r['scenario']:<29} {r['method']:<34} ({r['chose'] or '-'}) "
                f"{r['gpu_gbps']:6.1f} GB/s of pair {r['of_contiguous_pair']:.2f} "
                f"wall {r['wall_of_contiguous_pair']:.2f}"
            )
            continue
        if r["scenario"].startswith("swap_blocks"):
            print(
                f"{r['scenario']:<30} ({r['method']}) gpu {r['gpu_gbps']:.1f} wall "
                f"{r['wall_gbps']:.1f} cpu_us {r['cpu_us']:.1f} vs_contig "
                f"{r['gpu_vs_contiguous']:.2f} wall_vs {r['wall_vs_contiguous']:.2f}"
            )
            continue
        print(
            f"{r['scenario']:<22} {r['bytes'] / MiB:5.1f} {r['gpu_gbps']:6.1f} "
            f"{r['wall_gbps']:6.1f} {r['cpu_us']:7.1f} {r['prepared_cpu_us']:7.1f} "
            f"{r['contiguous_gpu_gbps']:6.1f} {r['gpu_vs_contiguous']:9.2f} "
            f"{r['wall_vs_contiguous']:7.2f} {r['pointer_gpu_gbps']:7.1f} "
            f"{r['vs_pointer_path']:6.2f} {dash(r['vllm_gpu_gbps'], '6.1f'):>6} "
            f"{dash(r['vs_vllm'], '7.2f'):>7}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/layouts.py")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    name = gpu_or_exit()
    rows = run_here()
    print_rows(name, rows)
    if args.out:
        args.out.write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    return 0
