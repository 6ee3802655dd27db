"""Whether a store and a load in layout form, issued at once, would race: one writing
bytes the other reads or writes (copy_rows_both_ways with host indices).

Checked layout by layout, in time that follows the batch: layouts whose memory does
not meet cannot race; two sides on the same layout race exactly where they name a
common slot (distinct slots' rows never overlap: kvcopy.Layout's contract), found by
a set of slots (plan_arrays.first_common_slot); only layouts that meet in some other
way are expanded into their rows' bytes and compared.
"""

from __future__ import annotations

import numpy as np

from kvcopy._cuda.plan_arrays import first_common_slot
from kvcopy._plans.overlaps import overlap_between
from kvcopy._plans.rows import RowsPlan, expand, live_slots
from kvcopy.layouts import Layout

_NO_ORDER = (
    "a store and a load at once run in no order with each other: issue them one after the other to order them"
)


def _spans(layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    return layout.bases, np.full(layout.num_planes, layout.extent, np.uint64)


def _meet(x: Layout, y: Layout) -> bool:
    """Whether the two layouts' planes share a byte (their envelopes first: most
    layouts of a store and a load are apart)."""
    if int(x.bases.max()) + x.extent <= int(y.bases.min()) or int(y.bases.max()) + y.extent <= int(
        x.bases.min()
    ):
        return False
    return overlap_between(*_spans(x), *_spans(y)) is not None


def _same_rows(x: Layout, y: Layout) -> bool:
    """Whether two layouts put every slot's row at the same bytes."""

    def geometry(v: Layout) -> tuple[int, ...]:
        return (v.slots, v.row_bytes, v.page_size, v.page_stride, v.slot_stride, v.pieces, v.piece_stride)

    return geometry(x) == geometry(y) and np.array_equal(x.bases, y.bases)


def _live(plan: RowsPlan, side: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows, slots on ``side``) of the plan's rows that are copied."""
    rows, src, dst = live_slots(plan)
    return rows, np.ascontiguousarray(src if side == "src" else dst)


def _slots_as_given(plan: RowsPlan, side: str) -> np.ndarray | None:
    """The host indices of ``side`` where the other side has none: every row is then
    copied unless its own slot is negative, so row r names slot[r] (or nothing);
    else None."""
    mine, other = (
        (plan.src_indices, plan.dst_indices) if side == "src" else (plan.dst_indices, plan.src_indices)
    )
    return mine.host if other is None and mine is not None else None


def _first_common_as_given(
    a: RowsPlan, side_a: str, b: RowsPlan, side_b: str, slots: int
) -> tuple[int, int, int] | None | bool:
    """_common_slot's answer read from each side's indices as given, without listing
    the rows that are copied (a serving step's store and load: the host side of each
    has no indices); False where that does not apply."""
    slots_a, slots_b = _slots_as_given(a, side_a), _slots_as_given(b, side_b)
    if slots_a is None or slots_b is None:
        return False
    # (a negative slot is a huge unsigned one: first_common_slot passes it over)
    j = first_common_slot(slots_a, slots_b, slots)
    if j < 0:
        return None
    slot = int(slots_b[j])
    return int(np.argmax(slots_a == slot)), j, slot


def _common_slot(
    a: RowsPlan, side_a: str, b: RowsPlan, side_b: str, slots: int
) -> tuple[int, int, int] | None:
    """(row of a, row of b, slot) of the first slot both name, or None."""
    found = _first_common_as_given(a, side_a, b, side_b, slots)
    if found is not False:
        return found  # type: ignore[return-value]
    rows_a, slots_a = _live(a, side_a)
    rows_b, slots_b = _live(b, side_b)
    j = first_common_slot(slots_a, slots_b, slots)
    if j < 0:
        return None
    slot = int(slots_b[j])
    return int(rows_a[int(np.argmax(slots_a == slot))]), int(rows_b[j]), slot


def refuse_rows_crossing(store: RowsPlan, load: RowsPlan) -> None:
    """ValueError where ``store`` and ``load`` issued at once would touch the same
    bytes with at least one of them writing, naming both rows."""
    checks = (
        ("store", store, "dst", "writes", "load", load, "src", "reads"),
        ("load", load, "dst", "writes", "store", store, "src", "reads"),
        ("store", store, "dst", "writes", "load", load, "dst", "writes"),
    )
    expanded: dict[str, tuple] = {}
    for name_a, a, side_a, verb_a, name_b, b, side_b, verb_b in checks:
        x, y = getattr(a, side_a), getattr(b, side_b)
        if not _meet(x, y):
            continue
        if _same_rows(x, y):
            clash = _common_slot(a, side_a, b, side_b, x.slots)
            if clash:
                raise ValueError(
                    f"{name_a}: row {clash[0]} {verb_a} slot {clash[2]} of its "
                    f"{side_a}, which {name_b}: row {clash[1]} {verb_b} (its "
                    f"{side_b}); {_NO_ORDER}"
                )
            continue
        for name, plan in ((name_a, a), (name_b, b)):
            if name not in expanded:
                expanded[name] = expand(plan)
        ptrs_a = expanded[name_a][0 if side_a == "src" else 1]
        ptrs_b = expanded[name_b][0 if side_b == "src" else 1]
        hit = overlap_between(ptrs_a, expanded[name_a][2], ptrs_b, expanded[name_b][2])
        if hit:
            raise ValueError(
                f"{name_a}: {side_a}_ptrs[{hit[0]}] {verb_a} bytes that {name_b}: "
                f"{side_b}_ptrs[{hit[1]}] {verb_b} (the rows as pointer copies); "
                f"{_NO_ORDER}"
            )
