"""Whether a layout's rows overlap: a destination whose rows share bytes would be
written in no defined order (copy_rows refuses it).

A plane's rows form a lattice: pages, slots within a page and pieces within a row,
each a stride and a count. Where the strides nest (sorted by stride, each dimension's
whole extent fits below the next stride) no two pieces of a plane can meet, in
O(dimensions); every engine layout nests, heads interleaved by token included. Planes
evenly spaced (layers, K and V interleaved by block) are one more dimension; other
planes are compared pair by pair where their spans meet, each pair by whether the
distance between them is a difference of two points of the lattice. Anything else is
settled exactly by listing its pieces, up to a bound beyond which the layout is
refused as unprovable.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcopy._plans.overlaps import first_overlap

# Pieces listed one by one where the strides do not nest (16 MiB of addresses at most).
_LISTED_PIECES = 1 << 20


def _nests(dims: list[tuple[int, int]], innermost: int) -> bool:
    """Whether pieces of ``innermost`` bytes at every combination of (stride, count)
    dimensions are pairwise disjoint because the strides nest."""
    extent = innermost
    for stride, count in sorted(d for d in dims if d[1] > 1):
        if extent > stride:
            return False
        extent += (count - 1) * stride
    return True


def _evenly_spaced(bases: np.ndarray) -> list[tuple[int, int]] | None:
    """The planes as one more lattice dimension (step, count) where their bases are
    evenly spaced (layers or K and V of one tensor), else None."""
    if len(bases) < 2:
        return []
    steps = np.diff(np.sort(bases))
    if int(steps.min()) > 0 and bool((steps == steps[0]).all()):
        return [(int(steps[0]), len(bases))]
    return None


def _meets(shift: int, dims: list[tuple[int, int]], innermost: int) -> bool:
    """Whether a nested lattice and itself moved by ``shift`` bytes share a byte: whether
    ``shift`` is a difference of two of its points within ``innermost`` bytes. The
    strides nest (so each is at least ``innermost``, never 0), and each dimension
    leaves at most two multiples to try."""
    if not dims:
        return abs(shift) < innermost
    (stride, count), inner = dims[-1], dims[:-1]
    low = shift // stride
    return any(-count < m < count and _meets(shift - m * stride, inner, innermost) for m in (low, low + 1))


# Pairs of planes whose spans meet, each tried against the lattice, at most.
_PAIRS_TRIED = 1 << 16


def _planes_meet(layout: Any, dims: list[tuple[int, int]]) -> tuple[int, int] | None | str:
    """Two planes that share a byte, None where none do, "unsettled" where too many
    pairs of planes would have to be tried."""
    order = np.argsort(layout.bases, kind="stable")
    bases = layout.bases[order].tolist()
    nested = sorted(d for d in dims if d[1] > 1)
    extent, tried = layout.extent, 0
    for i, base in enumerate(bases):
        for j in range(i + 1, len(bases)):
            if bases[j] >= base + extent:
                break
            tried += 1
            if tried > _PAIRS_TRIED:
                return "unsettled"
            if _meets(bases[j] - base, nested, layout.piece_bytes):
                return int(order[i]), int(order[j])
    return None


def _listed(layout: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every piece of every row: its start, plane and slot."""
    slots = np.arange(layout.slots, dtype=np.int64)
    rows = layout.row_addresses(slots)  # (planes, slots)
    piece = np.arange(layout.pieces, dtype=np.uint64) * np.uint64(layout.piece_stride)
    starts = (rows[:, :, None] + piece[None, None, :]).ravel()
    plane = np.repeat(np.arange(layout.num_planes), layout.slots * layout.pieces)
    slot = np.tile(np.repeat(slots, layout.pieces), layout.num_planes)
    return starts, plane, slot


def overlapping_rows(layout: Any) -> str | None:
    """None where no two pieces of distinct rows (or planes) of ``layout`` (a
    kvcopy.Layout) share a byte, else what overlaps, for an error message."""
    pages = -(-layout.slots // layout.page_size)
    dims = [
        (layout.piece_stride, layout.pieces),
        (layout.slot_stride, min(layout.page_size, layout.slots)),
        (layout.page_stride, pages),
    ]
    if _nests(dims, layout.piece_bytes):
        planes = _evenly_spaced(layout.bases)
        if planes is not None and _nests(dims + planes, layout.piece_bytes):
            return None
        met = _planes_meet(layout, dims)
        if met is None:
            return None
        if isinstance(met, tuple):
            return f"plane {met[0]} and plane {met[1]} share bytes"
    total = layout.num_planes * layout.slots * layout.pieces
    if total > _LISTED_PIECES:
        return (
            f"its strides (page {layout.page_stride}, slot {layout.slot_stride}, piece "
            f"{layout.piece_stride}) and plane bases do not nest, and its {total} pieces "
            "are too many to show apart one by one"
        )
    starts, plane, slot = _listed(layout)
    clash = first_overlap(starts, np.full(starts.size, layout.piece_bytes, np.uint64))
    if clash is None:
        return None
    (p, s), (q, t) = ((int(plane[i]), int(slot[i])) for i in clash)
    return f"plane {p} slot {s} and plane {q} slot {t} share bytes"


__all__ = ["overlapping_rows"]
