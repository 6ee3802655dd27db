"""calibrate() on this host, then copy_both_ways with what it found (and with the
shipped default, 128 KiB) against the contiguous pair: where a store and a load at
once go to the copy engines depends on the host's CPU cost per copy.
Run on a GPU: python3 experiments/both_ways_calibration.py"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import torch

import kvcopy
from kvcopy.testing import engine

device = engine.device
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.extra import bidirectional
from kvcopy.policy import BOTH_WAYS_BATCH_MIN_BYTES

KiB = 1 << 10


def main() -> None:
    torch.cuda.init()
    os.environ["KVCOPY_CACHE_DIR"] = tempfile.mkdtemp()
    found = kvcopy.calibrate()
    path = device.thresholds_path(device.device_info(0))
    measured = json.loads(path.read_text())["measurements"]
    for key in sorted(
        (k for k in measured if k.startswith("both_ways/")), key=lambda k: int(k.split("/")[1])
    ):
        gbps = measured[key]
        print(
            f"calibrate both ways {int(key.split('/')[1]) // KiB:>4} KiB: kernel pair "
            f"{gbps['kernel']:.1f} GB/s, engines {gbps['batch']:.1f} GB/s",
            flush=True,
        )
    print(
        f"calibrated crossover: {found.both_ways_batch_min_bytes / KiB:.0f} KiB "
        f"(default {BOTH_WAYS_BATCH_MIN_BYTES // KiB} KiB)",
        flush=True,
    )
    for label, crossover in (
        ("calibrated", found.both_ways_batch_min_bytes),
        ("default", BOTH_WAYS_BATCH_MIN_BYTES),
    ):
        device.set_thresholds(0, dataclasses.replace(found, both_ways_batch_min_bytes=crossover))
        for row in bidirectional(blocks=(32 * KiB, 64 * KiB, 128 * KiB)):
            if row["method"] == "copy_both_ways":
                print(
                    f"{label:<10} copy_both_ways {row['block_bytes'] // KiB:>4} KiB "
                    f"chose {row['chose']:<6} of pair GPU {row['of_contiguous_pair']:.2f} "
                    f"wall {row['wall_of_contiguous_pair']:.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
