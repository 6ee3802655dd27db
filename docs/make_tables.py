"""Print the README's headline table from a benchmark JSON (python docs/make_tables.py FILE)."""
from __future__ import annotations

import json
import sys

KiB, MiB = 1 << 10, 1 << 20


def label(block: int) -> str:
    return f"{block // MiB} MiB" if block >= MiB else f"{block // KiB} KiB"


def main(path: str) -> None:
    data = json.load(open(path))
    rows = {(r["direction"], r["block_bytes"], r["method"]): r for r in data["rows"]
            if r["memory"] == "torch"}

    def cell(direction, block, method, wall=False):
        r = rows.get((direction, block, method))
        if r is None:
            return "—"
        big = direction == "d2d"
        fmt = (lambda v: f"{v:.0f}") if big else (lambda v: f"{v:.1f}")
        return f"{fmt(r['gbps'])} ({fmt(r['wall_gbps'])})" if wall else fmt(r["gbps"])

    print("| block | dir | contiguous | kvcopy auto (method) | of ceiling | auto wall | batch DMA (wall) "
          "| Triton blocks (vLLM-style) | cuda.core copy_batch (wall) | torch per-block `copy_` "
          "| torch gather + staging (wall) |")
    print("|------:|-----|-----------:|------:|------:|------:|------:|------:|------:|------:|------:|")
    for direction in ("h2d", "d2h", "d2d"):
        blocks = sorted({b for d, b, _ in rows if d == direction})
        for block in blocks:
            auto = rows[(direction, block, "auto")]
            fmt = (lambda v: f"{v:.0f}") if direction == "d2d" else (lambda v: f"{v:.1f}")
            gather = rows.get((direction, block, "torch_gather_staging"))
            print(f"| {label(block)} | {direction.upper()} | {cell(direction, block, 'contiguous')} "
                  f"| {fmt(auto['gbps'])} ({auto['chose']}) | {auto['fraction_of_ceiling']:.2f} "
                  f"| {fmt(auto['wall_gbps'])} | {cell(direction, block, 'batch', wall=True)} "
                  f"| {cell(direction, block, 'triton_blocks')} "
                  f"| {cell(direction, block, 'cuda.core.copy_batch', wall=True)} "
                  f"| {cell(direction, block, 'torch_copy_loop')} "
                  f"| {fmt(gather['gbps']) if gather else '—'} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/h200-quick.json")
