"""Validated copy lists -> the descriptors kvcopy issues.

Planning drops zero-size copies, merges copies that continue each other on both
sides, checks bounds, and remembers where each planned copy came from so that
driver errors can name the caller's index. Everything is vectorised.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MAX_SIZE = 2**63 - 1
_U64_MAX = np.uint64(2**64 - 1)


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


def _check_pointers(ptrs: np.ndarray, sizes: np.ndarray, name: str) -> None:
    live = sizes != 0
    null = live & (ptrs == 0)
    if null.any():
        index = int(np.argmax(null))
        raise ValueError(f"{name}[{index}] is a null pointer with size {int(sizes[index])}")
    wraps = live & (ptrs > _U64_MAX - sizes)
    if wraps.any():
        index = int(np.argmax(wraps))
        raise ValueError(f"{name}[{index}] + sizes[{index}] runs past the end of the address space")


def plan_copies(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, *, merge: bool = True) -> CopyPlan:
    """Validate three uint64 arrays and turn them into a :class:`CopyPlan`.

    Raises:
        ValueError: lengths differ, a size is too large, a pointer is null or
            a copy wraps the address space.
    """
    if not (src.shape == dst.shape == sizes.shape):
        raise ValueError(f"src_ptrs, dst_ptrs and sizes differ in length: "
                         f"{src.shape[0]}, {dst.shape[0]}, {sizes.shape[0]}")
    if sizes.size and sizes.max() > _MAX_SIZE:
        index = int(np.argmax(sizes > _MAX_SIZE))
        raise ValueError(f"sizes[{index}] = {int(sizes[index])} is larger than 2**63 - 1 bytes")
    _check_pointers(src, sizes, "src_ptrs")
    _check_pointers(dst, sizes, "dst_ptrs")
    origin = np.arange(src.shape[0], dtype=np.int64)
    if not sizes.all():
        keep = sizes != 0
        src, dst, sizes, origin = src[keep], dst[keep], sizes[keep], origin[keep]
    if merge and sizes.shape[0] > 1:
        src, dst, sizes, origin = _merge_adjacent(src, dst, sizes, origin)
    return CopyPlan(src, dst, sizes, origin)


def _merge_adjacent(src, dst, sizes, origin):
    """Merge runs where copy i+1 starts where copy i ends, on both sides."""
    follows = (src[:-1] + sizes[:-1] == src[1:]) & (dst[:-1] + sizes[:-1] == dst[1:])
    if not follows.any():
        return src, dst, sizes, origin
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    merged = np.add.reduceat(sizes, starts).astype(np.uint64, copy=False)
    return src[starts], dst[starts], merged, origin[starts]
