"""Layout transfers against the contiguous copy of the same bytes, in one run.

    python -m kvcopy.bench.layouts [--out FILE.json]

Scenarios: token-slot gathers and scatters between vLLM-style paged GPU caches and a
pinned LMCache-style chunk (32 layers x K and V x 256 tokens of 2 KiB rows, 32 MiB;
MLA rows of 1152 B), and strided runs of 512 B and 128 B fragments (TP-rank head
fragments into a canonical host page). Each row: kvcopy.copy_rows with GPU-resident
indices, the same transfer as pointer copies (kvcopy.copy_batch, one copy per row or
fragment), and a contiguous copy of as many bytes; GPU time (events, CPU time
hidden behind a sleep kernel), CPU time per call and wall time (call to completion),
medians.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import kvcopy
from kvcopy import Layout
from kvcopy.bench.__main__ import gpu_or_exit
from kvcopy.bench.timing import measure

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
    caches = [torch.empty((planes_per_layer, blocks, 16, row), dtype=torch.uint8, device="cuda")
              for _ in range(layers)]
    chunk = torch.empty((planes_per_layer, layers, tokens, row), dtype=torch.uint8,
                        pin_memory=True)
    slots = torch.randperm(blocks * 16, device="cuda")[:tokens]
    return (Layout.of(caches, planes=(0,), page=1, slot=2),
            Layout.of(chunk, planes=(1, 0), slot=2), slots, (caches, chunk))


def fragment_runs(torch, fragment: int, total: int = 32 * MiB, heads_per_page: int = 8):
    """A TP rank's head fragments (contiguous on the GPU) and their places in canonical
    host pages that hold every rank's heads (stride: heads_per_page fragments)."""
    count = total // fragment
    gpu = torch.empty(total, dtype=torch.uint8, device="cuda")
    host = torch.empty(total * heads_per_page, dtype=torch.uint8, pin_memory=True)
    near = Layout.from_pointers([gpu.data_ptr()], slots=count, row_bytes=fragment, keep=(gpu,))
    far = Layout.from_pointers([host.data_ptr()], slots=count, row_bytes=fragment,
                               slot_stride=fragment * heads_per_page, keep=(host,))
    return near, far, count, (gpu, host)


def _on(torch, stream, copy):
    """``copy`` issued on ``stream`` (torch's copies go to its current stream)."""
    def call():
        with torch.cuda.stream(stream):
            copy()
    return call


def row(name: str, nbytes: int, layout_t, pointer_t, contiguous_t) -> dict:
    gbps = lambda ms: nbytes / (ms * 1e6)   # noqa: E731
    return {"scenario": name, "bytes": nbytes,
            "gpu_gbps": gbps(layout_t.gpu_ms), "wall_gbps": gbps(layout_t.wall_ms),
            "cpu_us": layout_t.cpu_us,
            "pointer_gpu_gbps": gbps(pointer_t.gpu_ms), "pointer_cpu_us": pointer_t.cpu_us,
            "contiguous_gpu_gbps": gbps(contiguous_t.gpu_ms),
            "contiguous_wall_gbps": gbps(contiguous_t.wall_ms),
            "gpu_vs_contiguous": contiguous_t.gpu_ms / layout_t.gpu_ms,
            "wall_vs_contiguous": contiguous_t.wall_ms / layout_t.wall_ms,
            "vs_pointer_path": pointer_t.gpu_ms / layout_t.gpu_ms}


def run(torch) -> list[dict]:
    stream = torch.cuda.Stream()
    out = []
    cases = [("tokens 2 KiB", token_rows(torch, 2 * KiB, 2)),
             ("tokens MLA 1152 B", token_rows(torch, 1152, 1))]
    for name, (paged, chunk, slots, keep) in cases:
        nbytes = paged.num_planes * len(slots) * paged.row_bytes
        gpu_side = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host_side = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host_slots = slots.cpu().numpy()
        for direction, (src, dst, s, d) in (("d2h", (paged, chunk, slots, None)),
                                            ("h2d", (chunk, paged, None, slots))):
            ps = _pointers(src, dst, None if s is None else host_slots,
                           None if d is None else host_slots, len(host_slots))
            a, b = (gpu_side, host_side) if direction == "d2h" else (host_side, gpu_side)
            out.append(row(f"{name} {direction}", nbytes,
                           measure(lambda: kvcopy.copy_rows(src, dst, s, d, stream=stream),
                                   stream, repeats=15),
                           measure(lambda: kvcopy.copy_batch(*ps, stream=stream), stream,
                                   repeats=15),
                           measure(_on(torch, stream, lambda: b.copy_(a, non_blocking=True)), stream,
                                   repeats=15)))
    for fragment in (512, 128):
        near, far, count, keep = fragment_runs(torch, fragment)
        nbytes = count * fragment
        flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        for direction, (src, dst) in (("h2d", (far, near)), ("d2h", (near, far))):
            ps = _pointers(src, dst, None, None, count)
            a, b = ((flat_host, keep[0]) if direction == "h2d" else (keep[0], flat_host))
            out.append(row(f"runs {fragment} B {direction}", nbytes,
                           measure(lambda: kvcopy.copy_rows(src, dst, rows=count,
                                                            stream=stream), stream, repeats=15),
                           measure(lambda: kvcopy.copy_batch(*ps, stream=stream), stream,
                                   repeats=15),
                           measure(_on(torch, stream, lambda: b.copy_(a, non_blocking=True)), stream,
                                   repeats=15)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcopy.bench.layouts")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    name = gpu_or_exit()
    import torch
    rows = run(torch)
    print(f"{name}: layout transfers (GB/s; ratios against the contiguous copy and the "
          "pointer path, GPU time)")
    print(f"{'scenario':<22} {'MiB':>5} {'gpu':>6} {'wall':>6} {'cpu_us':>7} {'contig':>6} "
          f"{'vs_contig':>9} {'wall_vs':>7} {'pointer':>7} {'vs_ptr':>6}")
    for r in rows:
        print(f"{r['scenario']:<22} {r['bytes'] / MiB:5.1f} {r['gpu_gbps']:6.1f} "
              f"{r['wall_gbps']:6.1f} {r['cpu_us']:7.1f} {r['contiguous_gpu_gbps']:6.1f} "
              f"{r['gpu_vs_contiguous']:9.2f} {r['wall_vs_contiguous']:7.2f} "
              f"{r['pointer_gpu_gbps']:7.1f} {r['vs_pointer_path']:6.2f}")
    if args.out:
        args.out.write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
