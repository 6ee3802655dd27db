"""Sweep of config.launch_bytes: what launches of at most 16 MiB, 32 MiB or one launch
per batch cost a copy alone (GPU time and wall, fractions of the contiguous copy
measured in the same process) and what they save a matmul beside continuous copies
(median slowdown of alternating pairs), one way, for one-tile (2-16 KiB) and
multi-tile (64 KiB) blocks.

Run on a GPU: python3 experiments/slice_sweep.py
"""

from __future__ import annotations

import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.beside import compute_beside
from kvcopy_bench.scenarios import block_copy_rows

KiB, MiB = 1 << 10, 1 << 20
TOTAL = 64 * MiB
LIMITS = {"16 MiB": 16 * MiB, "32 MiB": 32 * MiB, "one launch": 0}


def alone() -> None:
    for direction in ("h2d", "d2h"):
        for block in (2 * KiB, 4 * KiB, 64 * KiB):
            cells = []
            for label, limit in LIMITS.items():
                kvcopy.config.launch_bytes = limit
                ceiling, row = list(block_copy_rows(direction, block, TOTAL, "torch", ["kernel"], False, 7))
                cells.append(
                    f"{label}: gpu {row.fraction_of_ceiling:.3f} wall {row.wall_gbps / ceiling.wall_gbps:.3f}"
                )
                torch.cuda.empty_cache()
            print(f"alone {direction} {block // KiB:>2} KiB  " + "  ".join(cells), flush=True)
    kvcopy.config.launch_bytes = 16 * MiB


def beside() -> None:
    for direction in ("h2d", "d2h"):
        for block in (16 * KiB, 64 * KiB):
            variants = [
                (label, {"method": "kernel", "launch_bytes": limit}) for label, limit in LIMITS.items()
            ]
            for row in compute_beside(
                pairs=10, block=block, total=TOTAL, direction=direction, variants=variants
            ):
                print(
                    f"beside {direction} {block // KiB:>2} KiB {row['method']:<10} "
                    f"median {row['median_slowdown']:+.3f} (p25 {row['p25_slowdown']:+.3f} "
                    f"p75 {row['p75_slowdown']:+.3f}) copy {row['copy_gbps']:.1f} GB/s",
                    flush=True,
                )
            torch.cuda.empty_cache()


if __name__ == "__main__":
    torch.cuda.init()
    print(
        f"# slice_sweep on {torch.cuda.get_device_name()}: config.launch_bytes 16 MiB "
        f"(default), 32 MiB, 0 (one launch); 64 MiB batches"
    )
    alone()
    beside()
