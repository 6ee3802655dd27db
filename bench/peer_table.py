"""The benchmark's GPU-to-GPU section alone, as a table (two GPUs):
python3 bench/peer_table.py [block KiB ...]"""

from __future__ import annotations

import json
import sys

from kvcopy_bench.gpu_pairs import gpu_pair_available, peer_rows

KiB = 1 << 10


def main(argv: list[str]) -> int:
    if not gpu_pair_available():
        print("peer_bench: needs two GPUs")
        return 2
    blocks = [int(k) * KiB for k in argv] or [2 * KiB, 16 * KiB, 256 * KiB, 4096 * KiB]
    for row in peer_rows(blocks):
        print(
            f"{row['direction']:>5} {row['block_bytes'] // KiB:>6}KiB {row['method']:>10} "
            f"{row['chose']:>7} {row['gbps']:7.1f} GB/s {row['fraction_of_ceiling']:5.2f}  "
            f"wall {row['wall_gbps']:6.1f} cpu {row['cpu_us']:7.1f}us",
            flush=True,
        )
        print(json.dumps(row), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
