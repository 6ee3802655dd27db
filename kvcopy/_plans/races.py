"""Block copies whose result would depend on the order they run in, found from memory.

A swap_blocks call, or a store and a load issued at once, runs its copies in no
defined order. Two of them race where one writes memory the other reads or
writes. Tensors are compared by the memory they span, never by identity, so the
same cache passed twice, K and V views of one allocation, or two views of one
buffer are all seen for what they are. The cost follows the call: tensors whose
extents lie apart cost one sort of the tensors; tensors laid out alike (same
base, stride and split) compare block ids, once per call; tensors whose blocks
interleave but never meet (K and V in one block) cost nothing more; only other
overlapping tensors are compared copy by copy, by kvcopy._plans.overlaps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcopy._cuda.plan_arrays import block_addresses
from kvcopy._plans.overlaps import first_overlap, overlap_between
from kvcopy.arguments import require_same_length
from kvcopy.kept import make_room


@dataclass(frozen=True)
class Side:
    """The tensors one column of a plan addresses, and the ids it reads or writes."""

    label: str  # how messages name the side's pairs, e.g. 'block_mapping'
    role: str  # 'reads' or 'writes'
    tensors: str  # 'src' or 'dst', for messages
    base: np.ndarray
    extent: np.ndarray
    stride: np.ndarray
    factor: np.ndarray
    block_bytes: int
    ids: np.ndarray  # (n,) int64

    def addresses(self, tensor: int) -> np.ndarray:
        t = slice(tensor, tensor + 1)
        return block_addresses(self.ids, self.base[t], self.stride[t], self.factor[t], self.block_bytes)


def side_of(plan: object, column: int, label: str) -> Side:
    """One column of a BlockPlan as a Side."""
    g = plan.geometry  # type: ignore[attr-defined]
    if column == 0:
        return Side(
            label,
            "reads",
            "src",
            g.src_base,
            g.src_extent,
            g.src_stride,
            g.src_factor,
            g.block_bytes,
            plan.mapping[:, 0],  # type: ignore[attr-defined]
        )
    return Side(
        label,
        "writes",
        "dst",
        g.dst_base,
        g.dst_extent,
        g.dst_stride,
        g.dst_factor,
        g.block_bytes,
        plan.mapping[:, 1],  # type: ignore[attr-defined]
    )


def _overlapping_tensors(a: Side, b: Side, distinct: bool) -> list[tuple[int, int]]:
    """(x, y) for every tensor x of a and y of b whose extents overlap (x < y when
    ``distinct``: a and b are one side, compared with itself)."""
    if distinct:
        if a.base.size < 2 or first_overlap(a.base, a.extent) is None:
            return []
    elif overlap_between(a.base, a.extent, b.base, b.extent) is None:
        return []
    lo_a, lo_b = a.base, b.base
    hi_a, hi_b = a.base + a.extent, b.base + b.extent
    found = []
    for x in range(lo_a.size):  # reached only where some tensors do overlap
        ys = np.flatnonzero((lo_b < hi_a[x]) & (hi_b > lo_a[x]) & (a.extent[x] > 0) & (b.extent > 0))
        found += [(x, int(y)) for y in ys if not distinct or y > x]
    return found


_PAIRS_KEPT = 2048  # (a few a geometry: as many geometries as blocks keeps)
_pairs: dict[tuple, list] = {}  # geometry keys -> overlapping tensor pairs


def _pairs_for(a: Side, b: Side, distinct: bool, key: tuple | None) -> list[tuple[int, int]]:
    """_overlapping_tensors, remembered for geometries that carry a key (the uniform
    per-layer caches, read afresh on every call from the same tensors)."""
    if key is None:
        return _overlapping_tensors(a, b, distinct)
    full = (key, a.tensors, b.tensors, distinct)
    found = _pairs.get(full)
    if found is None:
        found = _overlapping_tensors(a, b, distinct)
        make_room(_pairs, _PAIRS_KEPT)
        _pairs[full] = found
    return found


def _never_meet(a: Side, x: int, b: Side, y: int) -> bool:
    """Blocks of two tensors with one stride and no split that interleave without ever
    overlapping (K and V in one block of a [blocks, 2, ...] cache)."""
    s = int(a.stride[x])
    if s != int(b.stride[y]) or a.factor[x] != 1 or b.factor[y] != 1 or s == 0:
        return False
    offset = (int(b.base[y]) - int(a.base[x])) % s
    return a.block_bytes <= offset <= s - b.block_bytes


def _alike(a: Side, x: int, b: Side, y: int) -> bool:
    return (
        a.base[x] == b.base[y]
        and a.stride[x] == b.stride[y]
        and a.factor[x] == b.factor[y]
        and a.block_bytes == b.block_bytes
    )


def _common_id(a: Side, b: Side, same_pair_ok: bool) -> tuple[int, int] | None:
    """Pair indices (i, j) where a's id i equals b's id j (i != j when
    ``same_pair_ok``: a pair copying within one tensor is no race with itself)."""
    if a.ids.size == 0 or b.ids.size == 0:
        return None
    _, ia, ib = np.intersect1d(a.ids, b.ids, return_indices=True)
    for i, j in zip(ia.tolist(), ib.tolist()):
        if not (same_pair_ok and i == j):
            return int(i), int(j)
    if same_pair_ok and ia.size:
        # intersect1d names one occurrence per id; another pair may still share it
        for i in ia.tolist():
            value = a.ids[i]
            others = np.flatnonzero(b.ids == value)
            others = others[others != i]
            if others.size:
                return int(i), int(others[0])
    return None


def _describe(a: Side, i: int, x: int, b: Side, j: int, y: int, multi: bool) -> str:
    def where(side: Side, pair: int, tensor: int) -> str:
        name = f"{side.tensors}[{tensor}]" if multi else side.tensors
        return f"{side.label}[{pair}] {side.role} block {int(side.ids[pair])} of {name}"

    return f"{where(a, i, x)}, memory that {where(b, j, y)} too"


def first_race(
    a: Side,
    b: Side,
    *,
    same_side: bool = False,
    same_plan: bool = False,
    key: tuple | None = None,
    harmless: Any = None,
) -> str | None:
    """A message naming two copies of which one writes memory the other touches, or None.

    ``a`` and ``b`` are sides of one or two plans; ``same_side``: they are one side
    compared with itself (a destination tensor list that reaches one memory twice);
    ``same_plan``: they belong to one plan, where a pair copying a block onto itself
    is no race; ``key``: identifies the geometries, to remember which tensors overlap;
    ``harmless``: tensor pairs (x, y) of a same-side comparison whose double writes
    are the same bytes."""
    pairs = _pairs_for(a, b, same_side, key)
    if not pairs:
        return None
    multi = max(a.base.size, b.base.size) > 1
    by_ids: dict[bool, tuple[int, int] | None] = {}  # one mapping per plan: once each
    for x, y in pairs:
        if _never_meet(a, x, b, y) or _never_meet(b, y, a, x):
            continue
        if _alike(a, x, b, y):
            if same_side:  # the same destination memory twice: every pair writes it twice
                if a.ids.size and not (harmless and harmless((x, y))):
                    return _describe(a, 0, x, b, 0, y, multi)
                continue
            itself_ok = same_plan and x == y
            if itself_ok not in by_ids:
                by_ids[itself_ok] = _common_id(a, b, same_pair_ok=itself_ok)
            found = by_ids[itself_ok]
            if found:
                return _describe(a, found[0], x, b, found[1], y, multi)
            continue
        sizes_a = np.full(a.ids.size, a.block_bytes, dtype=np.uint64)
        sizes_b = np.full(b.ids.size, b.block_bytes, dtype=np.uint64)
        clash = overlap_between(a.addresses(x), sizes_a, b.addresses(y), sizes_b)
        if clash:
            return _describe(a, clash[0], x, b, clash[1], y, multi)
    return None


def _duplicate_copies(plan: object, race_pair: tuple[int, int]) -> bool:
    """Whether destination tensors x and y, laid out alike, are fed by sources laid out
    alike too: then every pair copies the same bytes to the same place twice, which no
    order can change (a layer list that names one cache several times)."""
    g = plan.geometry  # type: ignore[attr-defined]
    x, y = race_pair
    return bool(
        g.src_base[x] == g.src_base[y]
        and g.src_stride[x] == g.src_stride[y]
        and g.src_factor[x] == g.src_factor[y]
    )


def tensors_apart(plan: object) -> bool:
    """Whether no destination tensor of a swap_blocks plan's layout overlaps a source
    tensor or another destination tensor, as an earlier check of it found: then no
    mapping over that layout can race (unique destination ids aside, which planning
    checks). False where no check of the layout is remembered."""
    key = plan.geometry.key  # type: ignore[attr-defined]
    return (
        key is not None
        and _pairs.get((key, "dst", "src", False)) == []
        and _pairs.get((key, "dst", "dst", True)) == []
    )


def race_in_plan(plan: object, label: str = "block_mapping") -> str | None:
    """Within one swap_blocks call: a block read by one pair and written by another, a
    pair whose source and destination overlap through two different views, or one
    memory written through two destination tensors. A pair copying a block onto itself
    within one tensor is allowed: the bytes are the same whatever the order."""
    if tensors_apart(plan):
        return None  # no tensors of this layout overlap: the usual case, kept cheap
    key = plan.geometry.key  # type: ignore[attr-defined]
    reads, writes = side_of(plan, 0, label), side_of(plan, 1, label)
    return first_race(writes, reads, same_plan=True, key=key) or first_race(
        writes, writes, same_side=True, key=key, harmless=lambda pair: _duplicate_copies(plan, pair)
    )


def race_between(first: object, second: object, labels: tuple[str, str]) -> str | None:
    """Between two plans issued at once: one's writes against the other's reads and writes."""
    k1, k2 = first.geometry.key, second.geometry.key  # type: ignore[attr-defined]
    key = None if k1 is None or k2 is None else (k1, k2)
    if key is not None and all(
        _pairs.get(((key, k), "dst", t, False)) == [] for k, t in ((1, "src"), (2, "src"), (3, "dst"))
    ):
        return None  # no tensors of these layouts overlap: the usual case, kept cheap
    r1, w1 = side_of(first, 0, labels[0]), side_of(first, 1, labels[0])
    r2, w2 = side_of(second, 0, labels[1]), side_of(second, 1, labels[1])
    return (
        first_race(w1, r2, key=key and (key, 1))
        or first_race(w2, r1, key=key and (key, 2))
        or first_race(w1, w2, key=key and (key, 3))
    )


__all__ = ["first_race", "race_between", "race_in_plan", "tensors_apart"]


def refuse_crossing(store: tuple, load: tuple) -> None:
    """ValueError where a store and a load issued at once would touch the same bytes
    with at least one of them writing: the result would depend on which ran first."""
    for name, (src, dst, sizes) in (("store", store), ("load", load)):
        require_same_length(src, dst, sizes, prefix=f"{name}: ")
    checks = (
        ("store: dst_ptrs", store[1], store[2], "writes", "load: src_ptrs", load[0], load[2], "reads"),
        ("load: dst_ptrs", load[1], load[2], "writes", "store: src_ptrs", store[0], store[2], "reads"),
        ("store: dst_ptrs", store[1], store[2], "writes", "load: dst_ptrs", load[1], load[2], "writes"),
    )
    for name_a, a, a_sizes, verb_a, name_b, b, b_sizes, verb_b in checks:
        clash = overlap_between(a, a_sizes, b, b_sizes)
        if clash:
            raise ValueError(
                f"{name_a}[{clash[0]}] {verb_a} bytes that {name_b}[{clash[1]}] "
                f"{verb_b}; a store and a load at once run in no order with each "
                "other: issue them one after the other to order them"
            )
