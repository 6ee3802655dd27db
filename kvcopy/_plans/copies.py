"""Validated copy lists -> the descriptors kvcopy issues.

Planning drops zero-size copies, merges copies that continue each other on both
sides, checks bounds, and remembers where each planned copy came from so that
driver errors can name the caller's index. The loop itself is in kvcopy/_cuda/plan_arrays.pyx.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvcopy._cuda.plan_arrays import plan_arrays
from kvcopy._plans.overlaps import first_overlap, overlap_between


@dataclass(frozen=True)
class CopyPlan:
    """Copies ready to issue: parallel uint64 arrays plus each one's first caller index."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    origin: np.ndarray

    @property
    def count(self) -> int:
        return int(self.sizes.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum(dtype=np.uint64)) if self.count else 0

    def caller_index(self, planned_index: int | None) -> int | None:
        """Index in the caller's batch of the planned copy ``planned_index``."""
        if planned_index is None or not 0 <= planned_index < self.count:
            return None
        return int(self.origin[planned_index])


def plan_copies(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, *, merge: bool = True) -> CopyPlan:
    """Validate three uint64 arrays and turn them into a :class:`CopyPlan`.

    Zero-size copies are dropped (their pointers may be null); with ``merge``,
    a copy that starts where the previous one ended, on both sides, is merged
    into it.

    Raises:
        ValueError: lengths differ, a size is too large, a pointer is null or
            a copy wraps the address space; the message names the index.
    """
    return CopyPlan(*plan_arrays(src, dst, sizes, merge))


def find_overlap(dst: np.ndarray, sizes: np.ndarray) -> tuple[int, int] | None:
    """Indices (i, j) of two non-empty copies whose destinations overlap, or None
    (kvcopy._plans.overlaps; O(n log n))."""
    return first_overlap(dst, sizes)


def find_read_of_written(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, compared: np.ndarray | None = None
) -> tuple[int, int] | None:
    """Indices (i, j) where copy i reads bytes that copy j writes (i may equal j: a
    copy onto itself, in part), or None; ``compared`` (a mask) leaves copies out."""
    if compared is None or bool(compared.all()):
        return overlap_between(src, sizes, dst, sizes)
    kept = np.flatnonzero(compared)
    found = overlap_between(src[kept], sizes[kept], dst[kept], sizes[kept])
    return None if found is None else (int(kept[found[0]]), int(kept[found[1]]))
