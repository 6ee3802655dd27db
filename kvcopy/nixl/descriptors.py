"""NIXL's descriptor lists built from kvcopy layouts and indices, and the memory a
layout needs registered (see kvcopy.nixl).

Rows that are back to back at both ends merge into one descriptor, and rows evenly
spaced at both ends (a block's planes of one cache tensor, runs of blocks) become one
entry of NIXL's strided form (address, length, device, stride, count). Several
orders are tried (plane by plane, row by row, runs across planes) and the one with
fewer descriptors kept; a local descriptor and the remote one at its position always
hold the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcopy._plans.rows import expand, plan_rows
from kvcopy.arguments import require_int
from kvcopy.layouts import Layout

OPERATIONS = ("WRITE", "READ")


@dataclass(frozen=True)
class Descriptors:
    """A transfer's descriptors: ``local`` and ``remote`` are (n, 3) uint64 arrays
    (address, bytes, device) or, where ``strided``, (n, 5) ones (address, bytes,
    device, stride, count); entry i of each holds the same bytes. ``copies``: the
    descriptors one per row and piece would have been; ``nbytes``: the bytes moved."""

    local: np.ndarray
    remote: np.ndarray
    copies: int
    nbytes: int
    strided: bool

    @property
    def posted(self) -> int:
        """Descriptors NIXL is given a side."""
        return len(self.local)

    @property
    def expanded(self) -> int:
        """Descriptors NIXL works through a side (a strided entry counts its rows)."""
        return int(self.local[:, 4].sum()) if self.strided else len(self.local)


def regions(layout: Layout, device: int = 0) -> np.ndarray:
    """The memory ``layout`` addresses, as few (n, 3) uint64 rows (address, bytes,
    ``device``) as it allows: each plane from its base to its last row's end, planes
    that touch or overlap joined. Register them with ``agent.register_memory(rows,
    "DRAM" or "VRAM")`` (each in one allocation, as NIXL's backends want)."""
    if not isinstance(layout, Layout):
        raise TypeError(f"regions: layout must be a kvcopy.Layout, got {type(layout).__name__}")
    device = require_int(device, "regions: device", minimum=0)
    starts = np.unique(layout.bases.astype(np.uint64))
    ends = starts + np.uint64(layout.extent)
    # a plane starts a region where it begins past every earlier plane's end
    reach = np.maximum.accumulate(ends)
    first = np.ones(len(starts), dtype=bool)
    first[1:] = starts[1:] > reach[:-1]
    begin = starts[first]
    end = reach[np.r_[np.flatnonzero(first)[1:] - 1, len(starts) - 1]]
    return np.stack([begin, end - begin, np.full(len(begin), device, np.uint64)], axis=1)


def _merge_back_to_back(
    local: np.ndarray, remote: np.ndarray, sizes: np.ndarray, planes: np.ndarray | None = None
) -> tuple:
    """Copies that continue the one before at both ends joined into one (not across
    two ``planes``, where given); the fourth array is the plane of each copy left."""
    if planes is None:
        planes = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) < 2:
        return local, remote, sizes, planes
    joins = (local[1:] == local[:-1] + sizes[:-1]) & (remote[1:] == remote[:-1] + sizes[:-1])
    joins &= planes[1:] == planes[:-1]
    starts = np.flatnonzero(np.r_[True, ~joins])
    return local[starts], remote[starts], np.add.reduceat(sizes, starts), planes[starts]


def _orders(ours: np.ndarray, theirs: np.ndarray, sizes: np.ndarray, shape: tuple) -> list[tuple]:
    """The copies in the orders worth trying, each merged: plane by plane; row by
    row; and merged plane by plane, then taken run by run across the planes (where
    every plane has as many runs). Any order will do: a copy keeps its two ends."""
    plane_of = np.broadcast_to(np.arange(shape[0])[:, None, None], shape).ravel()
    found = []
    for order in ((0, 1, 2), (1, 2, 0)):
        arrays = [a.reshape(shape).transpose(order).ravel() for a in (ours, theirs, sizes)]
        found.append(_merge_back_to_back(*arrays)[:3])
    local, remote, merged, planes = _merge_back_to_back(ours, theirs, sizes, plane_of)
    runs = len(merged) // max(shape[0], 1)
    if len(merged) == runs * shape[0] and np.array_equal(planes, np.repeat(np.arange(shape[0]), runs)):
        found.append(tuple(a.reshape(shape[0], runs).T.ravel() for a in (local, remote, merged)))
    return found


def _strided_groups(local: np.ndarray, remote: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The first copy of each group of evenly spaced copies of one size (spaced at
    least their size apart at both ends), taken greedily from the left: group ids
    per copy, non-decreasing."""
    n = len(sizes)
    if n < 3:
        return np.arange(n)
    step_l = (local[1:] - local[:-1]).view(np.int64)  # (exact below 2**63 apart)
    step_r = (remote[1:] - remote[:-1]).view(np.int64)
    size = sizes[:-1].astype(np.int64)
    ok = (sizes[1:] == sizes[:-1]) & (step_l >= size) & (step_r >= size)
    same = np.zeros(n - 1, dtype=bool)
    same[1:] = ok[1:] & ok[:-1] & (step_l[1:] == step_l[:-1]) & (step_r[1:] == step_r[:-1])
    stretch = np.cumsum(ok & ~same)  # the stretch of equal steps each step is in
    # a copy belongs to the stretch of the step before it, else of the step after it
    # (the first copy of a stretch no earlier stretch holds)
    owner = np.full(n, -1, dtype=np.int64)
    has_after, has_before = np.r_[ok, False], np.r_[False, ok]
    owner[has_after] = stretch[np.flatnonzero(has_after)]
    owner[has_before] = stretch[np.flatnonzero(has_before) - 1]
    starts = np.r_[True, (owner[1:] != owner[:-1]) | (owner[1:] < 0)]
    return np.cumsum(starts) - 1


def _strided(local: np.ndarray, remote: np.ndarray, sizes: np.ndarray, local_device: int, remote_device: int):
    """Each side as NIXL's strided entries (address, bytes, device, stride, count)."""
    if len(sizes) == 0:  # (every row skipped)
        empty = np.zeros((0, 5), np.uint64)
        return empty, empty.copy()
    group = _strided_groups(local, remote, sizes)
    firsts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    counts = np.diff(np.r_[firsts, len(sizes)]).astype(np.uint64)
    seconds = np.minimum(firsts + 1, len(sizes) - 1)

    def side(addresses: np.ndarray, device: int) -> np.ndarray:
        stride = np.where(counts > 1, addresses[seconds] - addresses[firsts], sizes[firsts])
        return np.stack(
            [addresses[firsts], sizes[firsts], np.full(len(firsts), device, np.uint64), stride, counts],
            axis=1,
        )

    return side(local, local_device), side(remote, remote_device)


def descriptors(
    operation: str,
    local: Layout,
    remote: Layout,
    local_indices: Any = None,
    remote_indices: Any = None,
    *,
    rows: int | None = None,
    local_device: int = 0,
    remote_device: int = 0,
    strided: bool = False,
) -> Descriptors:
    """The descriptors of moving rows between a local and a remote layout, paired as
    ``copy_rows`` pairs them (the source's ``*_indices``-th rows into the
    destination's; a negative index skips its row): ``operation`` 'WRITE' copies
    local rows into the remote layout, 'READ' remote rows into the local one.
    Indices are on the host (any framework's CPU array, a list, a NumPy array).
    ``*_device``: the device column of each side (0 for host memory). ``strided``:
    NIXL's strided form where it is shorter.

    Raises TypeError or ValueError naming a bad argument, as copy_rows does (the
    destination's rows must not overlap, the indices be in range)."""
    if operation not in OPERATIONS:
        raise ValueError(f"descriptors: operation must be 'WRITE' or 'READ', got {operation!r}")
    local_device = require_int(local_device, "local_device", minimum=0)
    remote_device = require_int(remote_device, "remote_device", minimum=0)
    if operation == "WRITE":
        plan = plan_rows(local, remote, local_indices, remote_indices, rows)
    else:
        plan = plan_rows(remote, local, remote_indices, local_indices, rows)
    if plan.device_indices:
        raise ValueError("descriptors: the indices must be on the host, not on a GPU")
    ours, theirs, sizes = expand(plan)
    if operation == "READ":
        ours, theirs = theirs, ours
    copies, nbytes = len(sizes), int(sizes.sum())
    shape = (plan.src.num_planes, len(sizes) // max(plan.src.num_planes * plan.pieces, 1), plan.pieces)
    best = None
    for merged in _orders(ours, theirs, sizes, shape):
        if strided:
            found = _strided(merged[0], merged[1], merged[2], local_device, remote_device)
        else:
            found = tuple(
                np.stack([addresses, merged[2], np.full(len(addresses), device, np.uint64)], axis=1)
                for addresses, device in ((merged[0], local_device), (merged[1], remote_device))
            )
        if best is None or len(found[0]) < len(best[0]):
            best = found
    assert best is not None
    return Descriptors(best[0], best[1], copies, nbytes, strided)
