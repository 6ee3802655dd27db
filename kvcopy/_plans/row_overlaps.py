"""Whether a layout's rows overlap: a destination whose rows share bytes would be
written in no defined order (copy_rows refuses it).

A layout's rows form a lattice: planes (bases), pages, slots within a page and pieces
within a row, each a stride and a count. Where the strides nest (sorted by stride,
each dimension's whole extent fits below the next stride) no two pieces can meet, in
O(dimensions); every engine layout nests, including K and V interleaved by block and
heads interleaved by token. Anything else is settled exactly by listing its pieces,
up to a bound beyond which the layout is refused as unprovable.
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


def _plane_dimension(bases: np.ndarray, extent: int) -> list[tuple[int, int]] | None:
    """The planes as one more lattice dimension: none where their spans lie apart,
    (step, count) where their bases are evenly spaced, None where they are neither."""
    if len(bases) < 2:
        return []
    ordered = np.sort(bases)
    steps = np.diff(ordered)
    if int(steps.min()) >= extent:
        return []
    if int(steps.min()) > 0 and bool((steps == steps[0]).all()):
        return [(int(steps[0]), len(bases))]
    return None


def _listed(layout: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every piece of every row: its start, plane and slot."""
    slots = np.arange(layout.slots, dtype=np.int64)
    rows = layout.row_addresses(slots)                          # (planes, slots)
    piece = np.arange(layout.pieces, dtype=np.uint64) * np.uint64(layout.piece_stride)
    starts = (rows[:, :, None] + piece[None, None, :]).ravel()
    plane = np.repeat(np.arange(layout.num_planes), layout.slots * layout.pieces)
    slot = np.tile(np.repeat(slots, layout.pieces), layout.num_planes)
    return starts, plane, slot


def overlapping_rows(layout: Any) -> str | None:
    """None where no two pieces of distinct rows (or planes) of ``layout`` (a
    kvcopy.Layout) share a byte, else what overlaps, for an error message."""
    pages = -(-layout.slots // layout.page_size)
    dims = [(layout.piece_stride, layout.pieces),
            (layout.slot_stride, min(layout.page_size, layout.slots)),
            (layout.page_stride, pages)]
    planes = _plane_dimension(layout.bases, layout.extent)
    if planes is not None and _nests(dims + planes, layout.piece_bytes):
        return None
    total = layout.num_planes * layout.slots * layout.pieces
    if total > _LISTED_PIECES:
        return (f"its strides (page {layout.page_stride}, slot {layout.slot_stride}, piece "
                f"{layout.piece_stride}) and plane bases do not nest, and its {total} pieces "
                "are too many to show apart one by one")
    starts, plane, slot = _listed(layout)
    clash = first_overlap(starts, np.full(starts.size, layout.piece_bytes, np.uint64))
    if clash is None:
        return None
    (p, s), (q, t) = ((int(plane[i]), int(slot[i])) for i in clash)
    return f"plane {p} slot {s} and plane {q} slot {t} share bytes"


__all__ = ["overlapping_rows"]
