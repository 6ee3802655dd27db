"""JSON, CSV and PNG output of a benchmark run."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

KiB = 1 << 10


def write_json(path: Path, meta: dict, rows: list[dict], extra: dict) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": rows, **extra}, indent=1))


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend, or None where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt: Any, fig: Any, path: Path, title: str) -> None:
    """Title, lay out (legends below the axes included) and write a figure."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot(path: Path, rows: list[dict], title: str) -> bool:
    """GB/s against block size, one line per method, a panel per direction, ceiling dashed;
    dotted: wall-time GB/s (call to completion) of the contiguous copy, auto and batch."""
    plt = _pyplot()
    if plt is None:
        return False
    directions = [d for d in ("h2d", "d2h", "d2d") if any(r["direction"] == d for r in rows)]
    fig, axes = plt.subplots(1, len(directions), figsize=(6 * len(directions), 4.6), squeeze=False)
    names = {"h2d": "host → GPU", "d2h": "GPU → host", "d2d": "GPU → GPU"}
    for ax, direction in zip(axes[0], directions):
        mine = [r for r in rows if r["direction"] == direction and r["memory"] == "torch"]
        for method in dict.fromkeys(r["method"] for r in mine):
            pts = sorted((r["block_bytes"], r["gbps"]) for r in mine if r["method"] == method)
            style = dict(ls="--", color="black", lw=1.5) if method == "contiguous" else dict(marker="o", ms=4)
            label = (
                "contiguous copy (ceiling)"
                if method == "contiguous"
                else (f"kvcopy {method}" if method in ("auto", "kernel", "batch", "loop") else method)
            )
            lw = 2.8 if method == "auto" else None
            if lw:
                style["lw"] = lw
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
            if method in ("auto", "batch", "contiguous"):
                # wall time beside GPU time: GPU time alone hides batched DMA's CPU cost
                walls = sorted(
                    (r["block_bytes"], r["wall_gbps"])
                    for r in mine
                    if r["method"] == method and "wall_gbps" in r
                )
                ax.plot(
                    [p[0] for p in walls],
                    [p[1] for p in walls],
                    ls=":",
                    lw=1.2,
                    color=line.get_color(),
                    label=f"{label}, wall (call + completion)",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log" if direction == "d2d" else "linear")
        ticks = sorted({r["block_bytes"] for r in mine})
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t // KiB}K" if t < 1 << 20 else f"{t >> 20}M" for t in ticks], rotation=45)
        ax.set_xlabel("block size")
        ax.set_ylabel("GB/s")
        ax.set_title(names[direction])
        ax.grid(alpha=0.3)
        ax.legend(
            fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False
        )  # below the axes: over the curves it hid them
    _save(plt, fig, path, title)
    return True


def plot_scenarios(path: Path, scenarios: dict, title: str) -> bool:
    """The serving-like scenarios: a store and a load at once (fraction of the contiguous
    pair, GPU time and wall), small batches (call to completion), and a matmul beside
    copies (its slowdown against the copies' GB/s). Panels for what the run measured."""
    plt = _pyplot()
    if plt is None:
        return False
    panels = [
        key
        for key in ("bidirectional", "small_batches", "serving_step", "compute_beside")
        if scenarios.get(key)
    ]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        rows = scenarios[key]
        if key == "bidirectional":
            for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "contiguous"):
                pairs = sorted(
                    (r["block_bytes"], r["of_contiguous_pair"], r["wall_of_contiguous_pair"])
                    for r in rows
                    if r["method"] == method
                )
                (line,) = ax.plot(
                    [p[0] for p in pairs],
                    [p[1] for p in pairs],
                    marker="o",
                    ms=4,
                    label=f"{method}, GPU time",
                )
                ax.plot(
                    [p[0] for p in pairs],
                    [p[2] for p in pairs],
                    ls=":",
                    color=line.get_color(),
                    label=f"{method}, wall",
                )
            ax.set_xscale("log", base=2)
            ax.set_xlabel("block size (bytes)")
            ax.set_ylabel("of the contiguous pair")
            ax.set_title("a store and a load at once")
        elif key == "small_batches":
            for direction, method in dict.fromkeys((r["direction"], r["method"]) for r in rows):
                pts = sorted(
                    (r["blocks"], r["wall_us"])
                    for r in rows
                    if r["direction"] == direction and r["method"] == method
                )
                ax.plot(
                    [p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, label=f"{direction} {method}"
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("blocks of 16 KiB")
            ax.set_ylabel("call to completion (us)")
            ax.set_title("small batches")
        else:
            labels = [
                f"{r['method']} {r['block_bytes'] // KiB}K"
                + (f" {r['direction']}" if "direction" in r else "")
                for r in rows
            ]
            slow = [100 * r["median_slowdown"] for r in rows]
            ax.barh(range(len(rows)), slow, color="tab:red", alpha=0.7)
            ax.set_yticks(range(len(rows)))
            ax.set_yticklabels(labels, fontsize=7)
            ax.set_xlabel("matmul slowdown (%), median")
            ax.set_title(
                "a matmul beside a store and a load" if key == "serving_step" else "a matmul beside copies"
            )
        ax.grid(alpha=0.3)
        if key in ("bidirectional", "small_batches"):
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    _save(plt, fig, path, title)
    return True
