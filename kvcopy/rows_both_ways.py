"""copy_rows_both_ways: a store and a load at once in layout form (a serving step)."""

from __future__ import annotations

from typing import Any

from kvcopy._engine import both_ways, rows_memo
from kvcopy._engine.rows_both_ways import execute_rows_both, repeat_staged, try_staged_rows_both
from kvcopy._plans.rows_races import refuse_rows_crossing
from kvcopy._plans.rows import RowsPlan, expand, plan_rows, read_indices, rows_stream
from kvcopy.interop.frameworks import type_name
from kvcopy.policy import RequestedMethod, check_method

_SIDE = "(src, dst[, src_indices[, dst_indices[, rows]]])"


def _plan_side(side: Any, name: str) -> RowsPlan:
    if not isinstance(side, (tuple, list)) or not 2 <= len(side) <= 5:
        what = f"{len(side)} items" if isinstance(side, (tuple, list)) else type_name(side)
        raise TypeError(f"{name} must be a {_SIDE} tuple, as copy_rows takes; got {what}")
    try:
        return plan_rows(*side)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


def copy_rows_both_ways(
    store: Any, load: Any, *, stream: Any = None, method: RequestedMethod = "auto"
) -> tuple[str, str]:
    """Copy rows between layouts both ways at once, typically a store (GPU to host) and
    a load (host to GPU) of a serving step, asynchronously.

    Each side is a ``(src, dst[, src_indices[, dst_indices[, rows]]])`` tuple of
    copy_rows' arguments, checked as copy_rows checks them, both before either is
    issued. Where each side's host rows lie back to back without indices, its GPU side
    has indices (on the GPU, or on the host) and both sides are large
    (policy.choose_rows_staging), the copy engines move the host rows in chunks
    through GPU staging buffers and the layout kernel gathers and scatters them inside
    the GPU ('staged'); a row an index skips still keeps its bytes (in a store, the
    bytes its host row held when its chunk was gathered are written back to it).
    Otherwise, where a side's indices are on the GPU, each side is a layout-kernel
    launch: the store on ``stream``, the load on a stream of kvcopy's own forked from
    it and joined back (both on ``stream``, in order, under capture); where every index
    is on the host, both sides go as pointer copies, as copy_both_ways issues them: one
    kernel launch whose CTAs are split by direction, or both on the copy engines from
    long rows. Either way both start after the work queued on ``stream`` and the work
    queued on it afterwards starts after both.

    A staged call is remembered per four layouts: the same call again (the same
    layouts, index tensors at the same addresses, or host indices, of the same lengths,
    the same stream, method and settings) issues its chunks again without classifying
    or building them, GPU indices' new values read when the kernels run; host indices
    are checked at every call, as at first, and uploaded anew.

    The two run in no order with each other: with host indices, a store and a load
    touching the same bytes with one writing them are refused (ValueError naming
    both); GPU indices are not read on the host, so that is then the caller's to
    guarantee, as copy_rows' own duplicates are.

    Returns the method each side ran with, e.g. ('kernel', 'kernel') or ('staged',
    'staged').

    Raises:
        TypeError, ValueError: bad arguments, named with the side ('store' or 'load').
        CudaError: the driver failed.
    """
    check_method(method)
    ran = _repeat(store, load, stream, method)
    if ran is not None:
        return ran
    plans = [_plan_side(store, "store"), _plan_side(load, "load")]
    layouts = tuple(layout for p in plans for layout in (p.src, p.dst))
    handle = rows_stream(
        stream, layouts, tuple(i.keep for p in plans for i in (p.src_indices, p.dst_indices) if i is not None)
    )
    key = rows_memo.pair_key(
        *(
            rows_memo.call_key(p.src_indices, p.dst_indices, _rows_given(side), handle, method)
            for p, side in zip(plans, (store, load))
        )
    )
    if not any(p.device_indices for p in plans):
        refuse_rows_crossing(plans[0], plans[1])
    if any(p.host_indices for p in plans):
        # (checked above: a staged pair remembered for these layouts takes the new values)
        ran = _repeat_with_host_indices(layouts, key, plans, handle)
        if ran is not None:
            return ran
    remember = lambda again: rows_memo.remember(layouts, key, again)  # noqa: E731
    if any(p.device_indices for p in plans):
        return execute_rows_both(plans[0], plans[1], handle, method, remember)
    staged = try_staged_rows_both(plans[0], plans[1], handle, method, remember)
    if staged is not None:
        return staged
    return both_ways.execute_both(expand(plans[0]), expand(plans[1]), handle, method, ("store", "load"))


def _repeat_with_host_indices(
    layouts: tuple, key: tuple, plans: list[RowsPlan], handle: int
) -> tuple[str, str] | None:
    """The staged pair remembered for these layouts and this key, issued again with the
    plans' host indices; None where there is none, or it cannot run."""
    known = rows_memo.entry(*layouts)
    again = None if known is None else rows_memo.repeat(known, key)
    if again is None:
        return None
    return repeat_staged(again, handle, (plans[0], plans[1]))


def _rows_given(side: Any) -> Any:
    return side[4] if len(side) == 5 else None


def _repeat(store: Any, load: Any, stream: Any, method: str) -> tuple[str, str] | None:
    """The same staged call with GPU indices as the last one between these four
    layouts (kvcopy._engine.rows_memo), issued again without planning; None where
    there is none, or it cannot run (the call is then planned afresh)."""
    if not all(isinstance(side, (tuple, list)) and 2 <= len(side) <= 5 for side in (store, load)):
        return None
    layouts = (store[0], store[1], load[0], load[1])
    known = rows_memo.entry(*layouts)
    if known is None or getattr(known.repeat, "host", False):
        return None  # (a pair with host indices is repeated once they are checked)
    # (these layouts were checked against each other: only the indices are read again)
    given = [tuple(side[2:4]) + (None,) * (4 - min(len(side), 4)) for side in (store, load)]
    try:
        read = [
            (read_indices(a, f"{name}: src_indices"), read_indices(b, f"{name}: dst_indices"))
            for (a, b), name in zip(given, ("store", "load"))
        ]
    except (TypeError, ValueError):
        return None  # (planned afresh, which names the argument)
    if any(i is not None and i.host is not None for pair in read for i in pair):
        return None  # (host indices are checked at every call)
    handle = rows_stream(stream, layouts, tuple(i for pair in given for i in pair if i is not None))
    key = rows_memo.pair_key(
        *(
            rows_memo.call_key(a, b, _rows_given(side), handle, method)
            for (a, b), side in zip(read, (store, load))
        )
    )
    again = rows_memo.repeat(known, key)
    return None if again is None else repeat_staged(again, handle)
