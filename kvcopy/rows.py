"""The row family: copy_rows copies rows between two layouts by index (token slots,
runs of a layout's planes), check_indices reports GPU indices that were out of range.
A call that repeats the last one with GPU indices repeats its launches
(kvcopy._engine.rows_memo); the engine plans and issues the rest."""

from __future__ import annotations

from typing import Any

from kvcopy._cuda.rows_repeat import GpuRowsRepeat
from kvcopy._engine.rows import check_indices as rows_check_indices, execute_rows
from kvcopy._engine import rows_memo
from kvcopy._plans.rows import RowsPlan, plan_rows, read_indices, rows_stream
from kvcopy.layouts import Layout
from kvcopy.interop.streams import resolve_stream
from kvcopy.policy import RequestedMethod, check_method


def copy_rows(
    src: Layout,
    dst: Layout,
    src_indices: Any = None,
    dst_indices: Any = None,
    *,
    rows: int | None = None,
    stream: Any = None,
    method: RequestedMethod = "auto",
) -> str:
    """Copy rows between two layouts (kvcopy.Layout), asynchronously: row r goes from
    slot ``src_indices[r]`` of every source plane to slot ``dst_indices[r]`` of the
    same destination plane, every piece of it.

    Indices are int64 slots, one per row: on the GPU (a CUDA tensor or any
    ``__cuda_array_interface__`` producer), read in place when the copy runs, so a
    captured copy replayed after the indices are updated in place moves the new
    rows; or on the host (NumPy, CPU tensors, sequences), checked whole first: each
    below its layout's slots, no destination slot twice, and where the layouts share
    memory no row reading what another writes. None: slot = row (then ``rows`` or the
    other side's indices give the count). A negative index skips its row. An
    out-of-range GPU index skips its row too (nothing is written for it) and is
    counted: kvcopy.check_indices raises IndexOutOfRange for it. GPU indices are not
    read on the host, so that no destination slot appears twice, and that no row
    reads what another writes, is the caller's to guarantee (as with SGLang's and
    LMCache's kernels).

    With GPU indices, a call that repeats the last one between the same two layouts
    (index tensors at the same addresses and of the same length, the same stream,
    method and settings) repeats its launches: no planning, one launch per 128 planes
    on the CPU, as kvcopy.prepare_rows gives. With host indices, such a call (as many
    indices as the last, on the same stream) between layouts that share no memory and
    hold it in their own torch tensors has its indices checked and uploaded, and the
    last call's launches made again reading them: its memory is not classified nor the
    policy asked again. Host indices are checked at every call. Indices are on the GPU
    for both sides or on the host for both (ValueError).

    The copy kernel computes every address itself (no descriptor per row). Where the
    policy gives the batch to the copy engines (few long rows) and the indices are on
    the host, the rows go as pointer copies, as copy_batch's; so do they under capture
    with host indices, and where the kernel cannot be built.

    Args:
        stream: any stream kvcopy.resolve_stream accepts; None means the current
            stream of the framework whose index tensors were passed, else the
            default stream.
        method: 'auto', 'kernel', 'batch' or 'loop', as copy_batch's; with indices on
            the GPU only the kernel can read them, and it runs whatever is asked.

    Returns:
        The method that ran ('kernel', 'batch', 'loop'; 'none' for no rows).

    Raises:
        TypeError, ValueError: bad arguments, named in the message.
        CudaError: the driver failed.
    """
    ran = rows_memo.repeat_gpu(src, dst, src_indices, dst_indices, rows, stream, method)
    if ran is not None:  # (the same call with GPU indices again: issued from C)
        return ran
    check_method(method)
    a, b, handle = src_indices, dst_indices, None
    known = rows_memo.entry(src, dst)
    if known is not None:
        # (these layouts were checked against each other: their indices are read next,
        # and host indices' values checked by the repeat)
        a = read_indices(a, "src_indices")
        # (one index array for both sides, as SGLang's ops often pass: read once)
        b = a if b is src_indices and b is not None else read_indices(b, "dst_indices")
        handle = rows_stream(stream, (src, dst), (src_indices, dst_indices))
        again = rows_memo.repeat(known, rows_memo.call_key(a, b, rows, handle, method))
        if again is not None:
            ran = again(a, b)
            if ran is not None:
                return ran
    plan = plan_rows(src, dst, a, b, rows)
    if handle is None:
        handle = rows_stream(stream, (src, dst), (src_indices, dst_indices))
    # (execute_rows hands over what repeats the call where the layout kernel ran it)
    key = rows_memo.call_key(plan.src_indices, plan.dst_indices, rows, handle, method)

    def remember(again: Any) -> None:
        if isinstance(again, GpuRowsRepeat):  # (named so that the same call finds it in C)
            again.expect(
                src_indices,
                dst_indices,
                rows,
                stream,
                method,
                handle,
                key[-1],
                rows_memo.EPOCH_SOURCES,
                resolve_stream,
                rows_stream,
            )
        rows_memo.remember((src, dst), key, again)

    return execute_rows(plan, handle, method, remember=remember)


def copy_planned_rows(plan: RowsPlan, stream: Any) -> str:
    """Issue ``plan`` (plan_rows' answer, every check made) on ``stream`` (any stream
    kvcopy.resolve_stream accepts) as copy_rows issues its own, for a drop-in that plans
    every part of a transfer before it issues any; nothing is kept to repeat the call.
    Returns the method that ran, as copy_rows."""
    return execute_rows(plan, resolve_stream(stream), "auto")


def check_indices(stream: Any = None) -> None:
    """Wait for ``stream`` (None: the whole device), then raise IndexOutOfRange where
    the copy kernel skipped rows for an out-of-range GPU-resident index in the current
    context since the last check (the count is then cleared). The count is the
    context's, over every stream: check where no other copy_rows call is in flight."""
    rows_check_indices(resolve_stream(stream) if stream is not None else None)


__all__ = ["check_indices", "copy_planned_rows", "copy_rows"]
