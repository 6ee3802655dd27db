"""Which copies touch the same bytes: the checks behind every refusal of a batch whose
result would depend on the order its copies run in.

Everything here works on byte ranges (start, size) held in uint64 arrays, sorts
the batch at most once per check (O(n log n) in the batch, never in the pool it
addresses) and ignores zero-size ranges.
"""

from __future__ import annotations

import numpy as np


def _live(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Indices of the ranges to compare: non-empty, and not wrapping the address space
    (such a copy is refused by the planner, which names it)."""
    return np.flatnonzero((sizes != 0) & (starts + sizes >= starts))


def first_overlap(starts: np.ndarray, sizes: np.ndarray) -> tuple[int, int] | None:
    """Indices (i, j), i < j, of two non-empty ranges of one set that overlap, or None."""
    live = _live(starts, sizes)
    if live.size < 2:
        return None
    order = live[np.argsort(starts[live], kind="stable")]
    ends = starts[order] + sizes[order]
    # with ranges sorted by start, some range overlaps a later one exactly where the
    # largest end so far passes the next start
    reach = np.maximum.accumulate(ends[:-1])
    clash = reach > starts[order[1:]]
    if not clash.any():
        return None
    k = int(np.argmax(clash))
    first = int(order[int(np.argmax(ends[: k + 1] == reach[k]))])
    return tuple(sorted((first, int(order[k + 1]))))  # type: ignore[return-value]


def _first_hit_packed(a_lo: np.ndarray, a_hi: np.ndarray, b_lo: np.ndarray, b_hi: np.ndarray) -> int | None:
    """One sweep over both sets sorted together by start: an a range and a b range
    overlap exactly where, for the one of them that starts later (or second at equal
    starts), the largest end among the other set's ranges started before it passes its
    start. Each start and its range's index in the two sets laid end to end are packed
    into one uint64 key, so that one plain (SIMD) sort orders everything, and the sweep
    is arithmetic (no data-dependent branches). Returns the position in ``a`` of an
    a range in some overlap, -1 where there is none, or None where the keys do not fit."""
    n = a_lo.size
    total = n + b_lo.size
    shift = max(int(total - 1).bit_length(), 1)
    if int(max(a_lo.max(), b_lo.max())) >= 1 << (64 - shift):
        return None
    keys = np.concatenate([a_lo, b_lo]) << np.uint64(shift)
    keys |= np.arange(total, dtype=np.uint64)
    keys.sort()
    index = (keys & np.uint64((1 << shift) - 1)).astype(np.intp)
    starts = keys >> np.uint64(shift)
    ends = np.concatenate([a_hi, b_hi])[index]
    in_b = (index >= n).astype(np.uint64)
    in_a = np.uint64(1) - in_b
    # the largest end so far of each set, before each position
    a_reach = np.empty_like(ends)
    b_reach = np.empty_like(ends)
    a_reach[0] = b_reach[0] = 0
    np.maximum.accumulate((ends * in_a)[:-1], out=a_reach[1:])
    np.maximum.accumulate((ends * in_b)[:-1], out=b_reach[1:])
    hit = (a_reach * in_b + b_reach * in_a) > starts
    if not hit.any():
        return -1
    k = int(np.argmax(hit))
    if index[k] < n:
        return int(index[k])
    # a b range overlaps an a range that started before it: the first such a
    return int(np.flatnonzero((a_lo < ends[k]) & (a_hi > starts[k]))[0])


# Up to this many (a, b) pairs, every pair is compared in Python: a layout's few
# planes per side cost less so than the sorts' NumPy calls.
_FEW_PAIRS = 16
_U64_END = 1 << 64  # a range reaching it wraps the address space: not compared (as _live)


def _overlap_between_few(
    a_starts: list[int], a_sizes: list[int], b_starts: list[int], b_sizes: list[int]
) -> tuple[int, int] | None:
    """overlap_between, pair by pair (the first overlapping pair in (i, j) order)."""
    for i, (s, x) in enumerate(zip(a_starts, a_sizes)):
        if x == 0 or s + x >= _U64_END:
            continue
        for j, (t, y) in enumerate(zip(b_starts, b_sizes)):
            if y and t + y < _U64_END and s < t + y and t < s + x:
                return i, j
    return None


def overlap_between(
    a_starts: np.ndarray, a_sizes: np.ndarray, b_starts: np.ndarray, b_sizes: np.ndarray
) -> tuple[int, int] | None:
    """Indices (i, j) of a non-empty range a[i] and a non-empty range b[j] that
    overlap, or None. Ranges within one set may overlap each other."""
    if a_starts.size * b_starts.size <= _FEW_PAIRS:
        return _overlap_between_few(a_starts.tolist(), a_sizes.tolist(), b_starts.tolist(), b_sizes.tolist())
    a_live, b_live = _live(a_starts, a_sizes), _live(b_starts, b_sizes)
    if a_live.size == 0 or b_live.size == 0:
        return None
    a_lo, b_lo = a_starts[a_live], b_starts[b_live]
    a_hi, b_hi = a_lo + a_sizes[a_live], b_lo + b_sizes[b_live]
    if int(a_hi.max()) <= int(b_lo.min()) or int(b_hi.max()) <= int(a_lo.min()):
        return None  # the two sets lie apart: the usual case, two memories
    found = _first_hit_packed(a_lo, a_hi, b_lo, b_hi)
    if found is None:  # addresses too wide to pack: sort b by index instead
        order = np.argsort(b_lo, kind="stable")
        reach = np.maximum.accumulate(b_hi[order])
        count = np.searchsorted(b_lo[order], a_hi, side="left")
        has = count > 0
        hit = np.zeros(a_lo.size, dtype=bool)
        hit[has] = reach[count[has] - 1] > a_lo[has]
        found = int(np.argmax(hit)) if hit.any() else -1
    if found < 0:
        return None
    partner = np.flatnonzero((b_lo < a_hi[found]) & (b_hi > a_lo[found]))
    return int(a_live[found]), int(b_live[int(partner[0])])


__all__ = ["first_overlap", "overlap_between"]
