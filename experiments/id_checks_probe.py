"""The one-pass check of swap_blocks ids (bounds and repeated destinations), where
the destinations' range is dense (a bitmap of it) and where it is sparse (a hash
table of the batch), against a stable sort of the destinations in NumPy (what the
sparse case cost before). Needs no GPU. Median microseconds of 400 calls each.

    python3 experiments/id_checks_probe.py"""

from __future__ import annotations

import numpy as np

from kvcopy.testing import cuda
from cpu_timing import median_us


def sort_check(ids: np.ndarray) -> bool:
    order = np.argsort(ids, kind="stable")
    return not (ids[order[1:]] == ids[order[:-1]]).any()


rng = np.random.default_rng(3)
for pairs in (256, 4096, 32768):
    for name, limit in (("dense", 2 * pairs), ("sparse", 1 << 30)):
        ids = rng.choice(limit, pairs, replace=False).astype(np.int64)
        mapping = np.stack([np.zeros(pairs, np.int64), ids], axis=1)
        assert cuda.plan_arrays.block_ids_ok(mapping, 1, limit) and sort_check(ids)
        one_pass = median_us(lambda: cuda.plan_arrays.block_ids_ok(mapping, 1, limit))
        line = f"pairs {pairs:6d} {name:<6} one pass {one_pass:7.1f} us"
        if name == "sparse":
            line += f"  NumPy sort {median_us(lambda: sort_check(ids)):7.1f} us"
        print(line)
