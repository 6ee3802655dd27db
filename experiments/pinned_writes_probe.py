"""Writing ids into pinned memory that cycles like a descriptor ring (64 MiB, each
write at the next offset, so that its lines are not in the CPU's cache): the ids of
32,768 swap_blocks pairs split into two arrays, and 512 KiB of copy_rows indices
copied, each with plain stores (NumPy; memmove) against kvcopy's writers, which put
the aligned body out with streaming stores (kvcopy/_cuda/pinned_writes.h). Median
microseconds of 400 writes each, the variants alternating.

    python3 experiments/pinned_writes_probe.py"""

from __future__ import annotations

import ctypes
import statistics
import time

import numpy as np

import kvcopy
from kvcopy.testing import cuda

PAIRS, RING = 32768, 64 << 20
ring = kvcopy.pinned_empty(RING, dtype=np.uint8)
mapping = np.random.default_rng(1).integers(0, 1 << 20, size=(PAIRS, 2), dtype=np.int64)
indices = np.ascontiguousarray(mapping.ravel())
nbytes = 16 * PAIRS
offset = 0


def next_slot() -> int:
    global offset
    offset = (offset + nbytes) % (RING - nbytes)
    return ring.ctypes.data + offset


def split_plain(at: int) -> None:
    out = np.frombuffer((ctypes.c_int64 * (2 * PAIRS)).from_address(at), np.int64)
    out[:PAIRS] = mapping[:, 0]
    out[PAIRS:] = mapping[:, 1]


def split_streaming(at: int) -> None:
    cuda.plan_arrays.split_block_ids(mapping, at)


def copy_plain(at: int) -> None:
    ctypes.memmove(at, indices.ctypes.data, nbytes)


def copy_streaming(at: int) -> None:
    cuda.plan_arrays.write_indices(at, indices)


variants = {
    "split, plain stores": split_plain,
    "split, streaming": split_streaming,
    "copy, memmove": copy_plain,
    "copy, streaming": copy_streaming,
}
spent: dict[str, list[float]] = {name: [] for name in variants}
for _ in range(400):
    for name, write in variants.items():
        at = next_slot()
        start = time.perf_counter()
        write(at)
        spent[name].append(time.perf_counter() - start)
check = next_slot()
split_streaming(check)
written = np.frombuffer((ctypes.c_int64 * (2 * PAIRS)).from_address(check), np.int64)
assert (written[:PAIRS] == mapping[:, 0]).all() and (written[PAIRS:] == mapping[:, 1]).all()
for name, times in spent.items():
    print(f"{name:<22} {statistics.median(times) * 1e6:6.1f} us  (min {min(times) * 1e6:6.1f})")
