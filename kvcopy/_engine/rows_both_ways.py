"""A store and a load at once in layout form (copy_rows_both_ways), where a side's
indices are on the GPU: each side is a layout-kernel launch of its own, the first on
the caller's stream, the second on kvcopy's side stream forked from it and joined
back, so that both directions share the link at once. Under capture both go on the
caller's stream, one after the other (a graph keeps them in order). A store and a load
of host rows back to back go through GPU staging buffers where the policy says so
(kvcopy._engine.rows_staged), whether their indices are on the GPU or the host
(try_staged_rows_both). Sides whose indices are all on the host and are not staged go
as pointer copies through kvcopy._engine.both_ways instead (its fused kernel pair, or
the copy engines from long rows)."""

from __future__ import annotations

from typing import Callable

from kvcopy._cuda import driver
from kvcopy._engine import rows_staged
from kvcopy._engine.rows import execute_rows, settle
from kvcopy._plans.rows import RowsPlan
from kvcopy._runtime import side_streams
from kvcopy._runtime.context import ContextScope
from kvcopy.interop.streams import effective_handle


def execute_rows_both(
    first: RowsPlan,
    second: RowsPlan,
    stream_handle: int,
    method: str = "auto",
    remember: Callable[[rows_staged.StagedPair], None] | None = None,
) -> tuple[str, str]:
    """Issue both plans at once, after the work queued on the stream and before the
    work queued there next; returns the method each ran with. Where the pair is staged,
    ``remember`` is given what repeats it (kvcopy._engine.rows_memo keeps it;
    repeat_staged runs it)."""
    handle = effective_handle(stream_handle)
    with ContextScope(handle) as scope:
        if driver.stream_capture_status(handle) != 0:
            return execute_rows(first, handle, method), execute_rows(second, handle, method)
        found = rows_staged.wanted(first, second, method)
        if found is not None:
            both = rows_staged.try_staged(
                first, second, handle, found, lambda plan: settle(scope, plan, handle, method)[:3], remember
            )
            if both is not None:
                return both
        side = side_streams.for_caller(handle)
        driver.stream_wait_stream(side, handle)
        try:
            ran = execute_rows(first, handle, method)
            return ran, execute_rows(second, side, method)
        finally:
            driver.stream_wait_stream(handle, side)


def try_staged_rows_both(
    first: RowsPlan,
    second: RowsPlan,
    stream_handle: int,
    method: str = "auto",
    remember: Callable[[rows_staged.StagedPair], None] | None = None,
) -> tuple[str, str] | None:
    """Both plans through GPU staging buffers where the policy stages them, outside
    capture; None where not, nothing issued. Asked of the plans first, so that a pair
    that is not staged costs no driver call here. ``remember``: as execute_rows_both's."""
    found = rows_staged.wanted(first, second, method)
    if found is None:
        return None
    handle = effective_handle(stream_handle)
    with ContextScope(handle) as scope:
        if driver.stream_capture_status(handle) != 0:
            return None
        return rows_staged.try_staged(
            first, second, handle, found, lambda plan: settle(scope, plan, handle, method)[:3], remember
        )


def repeat_staged(
    again: rows_staged.StagedPair, stream_handle: int, plans: tuple[RowsPlan, RowsPlan] | None = None
) -> tuple[str, str] | None:
    """A remembered staged pair issued again on the stream, outside capture (``plans``:
    the call's, checked, where its indices are on the host); None, nothing issued, where
    it cannot run (the caller then plans the call afresh)."""
    handle = effective_handle(stream_handle)
    with ContextScope(handle):
        if driver.stream_capture_status(handle) != 0:
            return None
        return again(plans)
