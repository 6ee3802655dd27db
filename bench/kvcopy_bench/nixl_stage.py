"""The benchmark's NIXL stage, where NIXL is installed: one engine request (80 layers x
K/V x 118 blocks, 18,880 rows) from this process's GPU cache into another process's
pinned host cache, every way bench/nixl_two_processes.py moves it (a descriptor per
row as engines post it, kvcopy's strided descriptors, one contiguous descriptor,
packed, the same-host leg by CUDA IPC) beside a local contiguous GPU-to-host copy of
the same bytes, at 2 and 32 KiB blocks, the bytes checked after every way."""

from __future__ import annotations

import sys
from typing import Any

BLOCKS_KIB = (2, 32)


def nixl_rows(
    repeats: int, cpu: bool = False, blocks_kib: tuple[int, ...] = BLOCKS_KIB
) -> list[dict[str, Any]]:
    """The stage's rows at each of ``blocks_kib`` (``cpu``: both caches in host memory,
    gathers and scatters on the CPU: a check of the stage, not a measurement); none,
    with a note on stderr, where NIXL is not installed."""
    try:
        import nixl_two_processes as two  # (bench/nixl_two_processes.py)
        from nixl_transfer import make_agent

        make_agent("probe")
    except ImportError:
        print(
            "benchmark: NIXL is not installed here; its stage is left out (pip install nixl-cu13)",
            file=sys.stderr,
        )
        return []
    rows = []
    for kib in blocks_kib:
        for block, way, posted, prepare, post, wall, rate in two.one_block_size(
            kib << 10, "host", repeats, cpu
        ):
            rows.append(
                {
                    "block_bytes": block,
                    "way": way,
                    "descriptors": posted,
                    "prepare_ms": round(prepare * 1e3, 3),
                    "post_ms": round(post * 1e3, 3),
                    "wall_ms": round(wall * 1e3, 3),
                    "gbps": round(rate, 3),
                }
            )
    return rows
