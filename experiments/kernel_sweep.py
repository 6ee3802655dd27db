"""Tuning sweep for the copy kernel: unroll (compile-time) x threads per CTA x CTAs.

Each configuration runs in a subprocess, because the unroll factor is baked
into the cubin that a process loads once.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

KiB, MiB = 1 << 10, 1 << 20
CASES = [
    ("h2d", 2 * KiB),
    ("h2d", 16 * KiB),
    ("h2d", 4 * MiB),
    ("d2h", 16 * KiB),
    ("d2h", 4 * MiB),
    ("d2d", 16 * KiB),
]


def child(ctas: int) -> None:
    import torch

    import bench_package  # noqa: F401 - kvcopy_bench's place
    from kvcopy_bench.scenarios import block_copy_rows

    for direction, block in CASES:
        total = 256 * MiB if direction == "d2d" else 64 * MiB
        rows = list(block_copy_rows(direction, block, total, "torch", ["kernel"], False, 5))
        if direction == "d2d":
            ctas_used = "sm"
        else:
            ctas_used = ctas
        print(
            json.dumps(
                {
                    "direction": direction,
                    "block": block,
                    "ctas": ctas_used,
                    "ceiling": rows[0]["gbps"] if isinstance(rows[0], dict) else rows[0].gbps,
                    "kernel": rows[1].gbps,
                    "fraction": rows[1].fraction_of_ceiling,
                }
            )
        )
        torch.cuda.empty_cache()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(os.environ["KVCOPY_HOST_CTAS"]))
        return
    for unroll, threads, ctas in itertools.product((4, 8), (256, 512), (16,)):
        env = dict(
            os.environ, KVCOPY_UNROLL=str(unroll), KVCOPY_THREADS=str(threads), KVCOPY_HOST_CTAS=str(ctas)
        )
        out = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True)
        for line in out.stdout.splitlines():
            r = json.loads(line)
            print(
                f"unroll={unroll} threads={threads} ctas={r['ctas']} {r['direction']} "
                f"{r['block'] // KiB:>5}KiB kernel={r['kernel']:7.1f} GB/s "
                f"ceiling={r['ceiling']:7.1f} fraction={r['fraction']:.2f}"
            )
        if out.returncode:
            print(out.stderr[-2000:])


if __name__ == "__main__":
    main()
