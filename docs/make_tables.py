"""The performance tables of README.md and docs/performance.md, from the reference results.

    python docs/make_tables.py            # rewrite docs/performance-tables.md and README's table
    python docs/make_tables.py --check    # exit 1 if either is not what the results give

The reference results are bench/results/h200-quick.json (one H200) and
bench/results/h200x2-quick.json (two H200s joined by NVLink), written by
``python bench/run.py --quick --out DIR`` on those machines.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONE_GPU = ROOT / "bench" / "results" / "h200-quick.json"
TWO_GPUS = ROOT / "bench" / "results" / "h200x2-quick.json"
TABLES = ROOT / "docs" / "performance-tables.md"
README = ROOT / "README.md"
KiB, MiB = 1 << 10, 1 << 20
README_BLOCKS = (2 * KiB, 16 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
START, END = "<!-- results-table: docs/make_tables.py -->", "<!-- /results-table -->"


def label(block: int) -> str:
    return f"{block // MiB} MiB" if block >= MiB else f"{block // KiB} KiB"


def machine(meta: dict, path: Path) -> str:
    """Where a results file was measured, as its metadata says."""
    parts = [meta.get("device", "unknown GPU")]
    if meta.get("driver"):
        parts.append(f"driver {meta['driver']}")
    else:  # files written before results recorded their driver
        parts.append("driver not recorded in the file (the reference machines run 580)")
    if meta.get("cuda_runtime"):
        parts.append(f"CUDA {meta['cuda_runtime']}")
    parts.append(f"kvcopy {meta.get('kvcopy', '?')}")
    if meta.get("torch"):
        parts.append(f"torch {meta['torch']}")
    return f"{', '.join(parts)} (`{path.relative_to(ROOT)}`)"


def _rows(data: dict) -> dict:
    return {
        (r["direction"], r["block_bytes"], r["method"]): r for r in data["rows"] if r["memory"] == "torch"
    }


def _num(value: float, big: bool) -> str:
    return f"{value:.0f}" if big else f"{value:.1f}"


def sweep_table(data: dict, blocks: tuple | None = None, full: bool = True) -> list[str]:
    rows = _rows(data)

    def cell(direction: str, block: int, method: str, wall: bool = False) -> str:
        r = rows.get((direction, block, method))
        if r is None:
            return "—"
        big = direction == "d2d"
        return f"{_num(r['gbps'], big)} ({_num(r['wall_gbps'], big)})" if wall else _num(r["gbps"], big)

    head = ["block", "dir", "contiguous", "kvcopy auto (method)", "of contiguous", "auto wall"]
    if full:
        head += [
            "batch DMA (wall)",
            "vLLM's Triton kernel",
            "cuda.core copy_batch (wall)",
            "torch per-block copy_",
            "torch gather + staging",
        ]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for direction in ("h2d", "d2h", "d2d"):
        for block in sorted({b for d, b, _ in rows if d == direction}):
            if blocks and block not in blocks:
                continue
            auto = rows.get((direction, block, "auto"))
            if auto is None:
                continue
            big = direction == "d2d"
            line = [
                label(block),
                direction.upper(),
                cell(direction, block, "contiguous"),
                f"{_num(auto['gbps'], big)} ({auto['chose']})",
                f"{auto['fraction_of_ceiling']:.2f}",
                _num(auto["wall_gbps"], big),
            ]
            if full:
                line += [
                    cell(direction, block, "batch", wall=True),
                    cell(direction, block, "triton_vllm_grid"),
                    cell(direction, block, "cuda.core.copy_batch", wall=True),
                    cell(direction, block, "torch_copy_loop"),
                    cell(direction, block, "torch_gather_staging"),
                ]
            out.append("| " + " | ".join(line) + " |")
    return out


def both_ways_table(data: dict) -> list[str]:
    rows = data.get("scenarios", {}).get("bidirectional", [])
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "contiguous"]
    out = ["| block | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
    for block in sorted({r["block_bytes"] for r in rows}):
        cells = []
        for method in methods:
            found = [r for r in rows if r["block_bytes"] == block and r["method"] == method]
            cells.append(
                f"{found[0]['of_contiguous_pair']:.2f} ({found[0]['wall_of_contiguous_pair']:.2f})"
                if found
                else "—"
            )
        out.append(f"| {label(block)} | " + " | ".join(cells) + " |")
    return out


def small_batch_table(data: dict) -> list[str]:
    rows = data.get("scenarios", {}).get("small_batches", [])
    keys = list(dict.fromkeys((r["direction"], r["method"]) for r in rows))
    counts = sorted({r["blocks"] for r in rows})
    out = [
        "| direction | method | " + " | ".join(f"{n} blocks" for n in counts) + " |",
        "|---|---|" + "---:|" * len(counts),
    ]
    for direction, method in keys:
        cells = []
        for n in counts:
            found = [r for r in rows if (r["direction"], r["method"], r["blocks"]) == (direction, method, n)]
            cells.append(f"{found[0]['wall_us']:.1f}" if found else "—")
        out.append(f"| {direction} | {method} | " + " | ".join(cells) + " |")
    return out


def serving_table(data: dict) -> list[str]:
    rows = data.get("scenarios", {}).get("serving_step", [])
    out = [
        "| block | method | store GB/s | load GB/s | matmul slowdown (median) |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {label(r['block_bytes'])} | {r['method']} | {r['store_gbps']:.1f} | "
            f"{r['load_gbps']:.1f} | {100 * r['median_slowdown']:+.1f}% |"
        )
    return out


def peer_table(data: dict) -> list[str]:
    rows = data.get("scenarios", {}).get("peer", [])
    if not rows:
        return ["(no GPU-to-GPU rows in this file)"]
    keys = [k for k in rows[0] if k not in ("scenario",)]
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        out.append(
            "| " + " | ".join(f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |"
        )
    return out


def tables() -> str:
    one = json.loads(ONE_GPU.read_text())
    two = json.loads(TWO_GPUS.read_text())
    parts = [
        "<!-- written by docs/make_tables.py from the reference results; do not edit -->",
        "",
        "## Scattered blocks, one way",
        "",
        f"Measured on {machine(one['meta'], ONE_GPU)}. GB/s over the GPU time of the "
        "enqueued copy (the wall figure, in brackets or its own column, is call to "
        "completion); 64 MiB per batch (inside the GPU 256 MiB), medians.",
        "",
        *sweep_table(one),
        "",
        "## A store and a load at once (`copy_both_ways`)",
        "",
        "Fraction of the contiguous pair (two copies, one each way, at once) in GPU time, wall in brackets.",
        "",
        *both_ways_table(one),
        "",
        "## Small batches, call to completion (µs, 16 KiB blocks)",
        "",
        *small_batch_table(one),
        "",
        "## A bf16 matmul beside a store and a load",
        "",
        *serving_table(one),
        "",
        "## Between two GPUs",
        "",
        f"Measured on {machine(two['meta'], TWO_GPUS)}.",
        "",
        *peer_table(two),
        "",
    ]
    return "\n".join(parts)


def readme_table() -> str:
    one = json.loads(ONE_GPU.read_text())
    return "\n".join(
        [
            START,
            "",
            f"On {machine(one['meta'], ONE_GPU)}:",
            "",
            *sweep_table(one, README_BLOCKS, full=False),
            "",
            END,
        ]
    )


def main(argv: list[str]) -> int:
    check = "--check" in argv
    want_tables = tables()
    readme = README.read_text()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(readme):
        print(f"README.md has no {START} block", file=sys.stderr)
        return 1
    want_readme = pattern.sub(lambda _: readme_table(), readme)
    if check:
        stale = [
            p.name
            for p, want in ((TABLES, want_tables), (README, want_readme))
            if not p.is_file() or p.read_text() != want
        ]
        if stale:
            print(f"out of date: {', '.join(stale)}; run python docs/make_tables.py", file=sys.stderr)
            return 1
        return 0
    TABLES.write_text(want_tables)
    README.write_text(want_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
