"""A store and a load at once in layout form with GPU indices (copy_rows_both_ways, as
the layouts benchmark's 'both ways' rows): the layout kernel's CTAs per side swept,
against the contiguous pair of the same bytes on two streams, GPU time and wall."""

from __future__ import annotations

import torch

from kvcopy import policy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.layouts import KiB, both_ways_rows
from kvcopy.testing import engine

SPLITS = [(16, 2), (8, 2), (4, 2), (8, 4), (16, 4), (32, 4), (16, 8), (32, 16), (64, 8)]
for h2d, d2h in SPLITS:
    policy.ROWS_HOST_CTAS.update(h2d=h2d, d2h=d2h)
    engine.rows_memo.forget()
    for r in both_ways_rows(torch, rows_bytes=(4 * KiB, 16 * KiB, 64 * KiB), repeats=9):
        if "gpu indices" in r["method"]:
            print(
                f"load {h2d:>3} store {d2h:>3} CTAs  {r['scenario']:<22} of pair "
                f"{r['of_contiguous_pair']:.2f} wall {r['wall_of_contiguous_pair']:.2f}",
                flush=True,
            )
