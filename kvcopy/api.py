"""The public copy functions: argument checks, the stream to use, then the engine.

copy_batch copies raw pointer triples; swap_blocks copies blocks of paged KV
caches by block id; copy_both_ways and swap_blocks_both_ways take a store and a
load at once. All validate everything before anything is enqueued.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcopy._engine import both_ways, dispatch
from kvcopy._engine.rows import check_indices as rows_check_indices, execute_rows
from kvcopy._engine import rows_memo
from kvcopy._plans.rows import Indices, RowsPlan, plan_rows, read_indices, rows_stream
from kvcopy.layouts import Layout
from kvcopy._plans.races import race_between, refuse_crossing
from kvcopy._plans.blocks import BlockGeometry, BlockPlan, geometry_and_reverse, plan_blocks
from kvcopy.arguments import require_bool, require_int
from kvcopy._engine.decide import last_decision
from kvcopy.interop.arrays import as_list, as_u64_array
from kvcopy._cuda import driver
from kvcopy._cuda.plan_arrays import copies_ok
from kvcopy._runtime.context import ContextScope
from kvcopy.interop.streams import (
    current_framework_stream,
    current_framework_streams,
    effective_handle,
    resolve_stream,
)
from kvcopy._plans.copies import find_overlap, find_read_of_written
from kvcopy.policy import RequestedMethod, check_method

_ACCESS_ORDERS = ("stream", "any")
_MAX_GRID = 2**31 - 1  # the driver's limit on a launch's x dimension


def _check_options(
    method: str, src_access_order: str, max_ctas: int | None, check_overlap: bool, allow_batch: bool
) -> None:
    check_method(method)
    if not isinstance(src_access_order, str):
        raise TypeError(f"src_access_order must be 'stream' or 'any'; got {type(src_access_order).__name__}")
    if src_access_order not in _ACCESS_ORDERS:
        raise ValueError(f"src_access_order must be 'stream' or 'any'; got {src_access_order!r}")
    if max_ctas is not None:
        require_int(max_ctas, "max_ctas", minimum=1, maximum=_MAX_GRID)
    require_bool(check_overlap, "check_overlap")
    require_bool(allow_batch, "allow_batch")
    if method == "batch" and not allow_batch:
        raise ValueError("method='batch' contradicts allow_batch=False")


def copy_batch(
    src_ptrs: Any,
    dst_ptrs: Any,
    sizes: Any,
    *,
    stream: Any = None,
    method: RequestedMethod = "auto",
    src_access_order: str = "stream",
    max_ctas: int | None = None,
    check_overlap: bool = True,
    allow_batch: bool = True,
) -> str:
    """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every i, asynchronously.

    Pointers may be device memory, pinned host memory or pageable host memory,
    in any mix; they and the sizes may be sequences of ints, NumPy integer
    arrays, CPU torch tensors or buffers. Everything is validated before any
    copy is enqueued; zero-size copies are dropped and copies that continue
    each other on both sides are merged. A batch of up to 127 copies shaped like
    one launched before (same stream, method, kinds of memory, copies after
    merging and bytes, under the same settings) goes straight to the launch
    recorded for it (kvcopy._engine.replay): still checked copy by copy, several
    microseconds of CPU sooner.

    Args:
        stream: any stream kvcopy.resolve_stream accepts. None means the
            current stream of the framework whose tensors were passed, else
            the default stream.
        method: 'auto' (the policy picks), 'batch' (cuMemcpyBatchAsync),
            'loop' (one cuMemcpyAsync per copy) or 'kernel' (kvcopy's copy
            kernel). 'batch' on the legacy default stream runs as 'loop', since
            the driver rejects that stream; on a capturing stream it raises.
        src_access_order: 'stream' (safe default) or 'any', which lets the
            driver read the sources at any time after the call: unsafe when
            work on the GPU may still be writing them (e.g. GPU-to-host right
            after compute).
        max_ctas: CTAs for the copy kernel (default: kvcopy.config).
        check_overlap: raise ValueError, before anything is enqueued, where two
            copies write overlapping bytes or a copy reads bytes a copy writes
            (a copy onto exactly itself changes nothing and passes): the copies
            of one batch run in no defined order, so such a batch would give
            unspecified bytes. On by default; it costs one expected-linear
            pass over the batch (a sort only where copies of very unequal sizes
            crowd one place, and to name the copies of a refusal). False leaves
            the guarantee to a caller that makes it.
        allow_batch: False keeps cuMemcpyBatchAsync out ('auto' then picks
            the kernel or one cuMemcpyAsync per copy), for drivers or GPUs
            where the batch API misbehaves.

    Returns:
        The method that ran: 'batch', 'loop' or 'kernel' ('none' for an empty
        batch), or 'staged': with 'auto', a batch of 64 MiB and more between host
        and GPU whose host side is a few long spans (an LMCache chunk, a host
        pool handed out in order) goes through a GPU staging buffer, each span
        whole by the copy engines and the blocks scattered inside the GPU by
        the copy kernel (kvcopy._engine.staged; config.staging_bytes, 0 turns it off).

    Raises:
        TypeError, ValueError: bad arguments, named in the message.
        CudaError: the driver failed; ``.index`` is the failing copy where known.
        CaptureError: method='batch' on a capturing stream.
    """
    if not (
        method == "auto"
        and src_access_order == "stream"
        and max_ctas is None
        and check_overlap is True
        and allow_batch is True
    ):  # defaults need no checks
        _check_options(method, src_access_order, max_ctas, check_overlap, allow_batch)
    src = as_u64_array(src_ptrs, "src_ptrs")
    dst = as_u64_array(dst_ptrs, "dst_ptrs")
    size_arr = as_u64_array(sizes, "sizes")
    # (bad copies are refused here, before the driver; order dependence where asked)
    if len(src) == len(dst) == len(size_arr) and not copies_ok(src, dst, size_arr) and check_overlap:
        _refuse_order_dependence(src, dst, size_arr)
    handle = (
        resolve_stream(stream) if stream is not None else current_framework_stream(src_ptrs, dst_ptrs, sizes)
    )
    return dispatch.execute_arrays(
        src,
        dst,
        size_arr,
        handle,
        method,
        src_access_order == "any",
        None if max_ctas is None else int(max_ctas),
        allow_batch,
    )


def _refuse_order_dependence(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
    """ValueError where two copies of a batch of valid copies write one byte, or a copy
    reads a byte a copy writes (compared exactly: copies_ok's glance was not enough)."""
    clash = find_overlap(dst, sizes)
    if clash:
        raise ValueError(
            f"dst_ptrs[{clash[0]}] and dst_ptrs[{clash[1]}] write overlapping "
            "bytes; the copies of one batch run in no defined order"
        )
    moved = src != dst  # (a copy onto exactly itself changes nothing)
    crossing = find_read_of_written(src, dst, sizes, moved)
    if crossing:
        i, j = crossing
        what = (
            f"copy {i} reads bytes that it writes itself"
            if i == j
            else f"src_ptrs[{i}] reads bytes that dst_ptrs[{j}] writes"
        )
        raise ValueError(f"{what}; the copies of one batch run in no defined order")


def _require_triple(batch: Any, name: str, parts: str) -> None:
    """Raise TypeError unless ``batch`` is a tuple or list of three."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 3:
        what = (
            f"a {type(batch).__name__} of {len(batch)}"
            if isinstance(batch, (tuple, list))
            else type(batch).__name__
        )
        raise TypeError(f"{name} must be a ({parts}) triple; got {what}")


def _triple(batch: Any, name: str) -> tuple:
    _require_triple(batch, name, "src_ptrs, dst_ptrs, sizes")
    return tuple(
        as_u64_array(a, f"{name}: {part}") for part, a in zip(("src_ptrs", "dst_ptrs", "sizes"), batch)
    )


def copy_both_ways(
    store: Any, load: Any, *, stream: Any = None, method: RequestedMethod = "auto"
) -> tuple[str, str]:
    """Copy two batches at once, typically a store (GPU to host) and a load (host to GPU).

    Each is a ``(src_ptrs, dst_ptrs, sizes)`` triple as copy_batch takes. Where the
    copy kernel runs both, they go out as one launch whose CTAs are split by
    direction (Thresholds.both_ways_ctas), so neither direction starves the
    other on the PCIe link; where a side goes by DMA, it runs on a stream of
    kvcopy's own forked from ``stream`` and joined back. Either way the copies
    start after the work already queued on ``stream`` and work queued on it
    afterwards starts after both. Both batches are validated before either is
    issued; a side whose copies write one byte twice or read what another writes
    is refused as copy_batch refuses it, and so is a pair of them in which one side
    writes bytes the other reads or writes (ValueError naming both copies): the two
    run in no order.

    Where each side's host side is a few long spans (as copy_batch's 'staged'),
    both go through GPU staging buffers, which keeps both directions near the
    link's limit where the kernel pair stops near 0.8 of it.

    Returns the method each side ran with, e.g. ('kernel', 'kernel') or
    ('staged', 'staged').

    Raises:
        TypeError, ValueError: bad arguments, named with the side ('store' or 'load').
        CaptureError: method='batch' on a capturing stream.
    """
    check_method(method)
    first, second = _triple(store, "store"), _triple(load, "load")
    for side, name in ((first, "store"), (second, "load")):
        if len(side[0]) == len(side[1]) == len(side[2]):
            try:
                if not copies_ok(*side):
                    _refuse_order_dependence(*side)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
    refuse_crossing(first, second)
    handle = resolve_stream(stream) if stream is not None else current_framework_stream(*store, *load)
    return both_ways.execute_both(first, second, handle, method, ("store", "load"))


def swap_blocks(
    src: Any,
    dst: Any,
    block_mapping: Any,
    *,
    stream: Any = None,
    method: RequestedMethod = "auto",
    split_blocks: bool = False,
) -> str:
    """Copy blocks ``block_mapping[k, 0]`` of ``src`` to blocks ``block_mapping[k, 1]`` of ``dst``.

    ``src`` and ``dst`` are a tensor/array or equal-length sequences of them
    (one per layer, or K and V views), of any framework: torch (CUDA, pinned or
    plain CPU), CuPy, NumPy (pinned with kvcopy.pinned_empty or registered, or
    pageable), JAX (as sources), DLPack or array-interface producers. Dimension
    0 is the block index and each block must be contiguous. All copies of all
    tensors go out as one batch. With ``split_blocks``, a side whose blocks
    are k times larger is addressed in sub-blocks: its ids count sub-blocks,
    so id ``b * k + j`` is the j-th part of block b (vLLM's block_size_factor).

    Ordering: the copy runs on ``stream``. Pending writes of DLPack producers
    (JAX, CuPy via DLPack) and of ``__cuda_array_interface__`` producers that
    name a stream (CuPy, Numba) are waited for on the GPU first, as those
    protocols define; torch tensors follow torch's rule (the caller orders
    streams; None means torch's current stream of the first CUDA tensor's
    device). Between two GPUs with ``stream=None``, as torch's ``copy_``
    does: the copy runs on the source GPU's current stream after the work
    queued on the destination GPU's current stream, which then waits for it.

    The copies of one call run in no defined order, so a call in which one pair
    writes memory another pair reads, or two destination tensors reach the same
    memory, is refused (a block copied onto itself is allowed).

    Returns the method that ran ('kernel', 'batch', 'loop', or 'none').

    Raises:
        TypeError, ValueError: bad tensors or ids, or racing pairs, before anything
            is copied.
    """
    check_method(method)
    if stream is not None:
        streams = [(resolve_stream(stream), -1)]
    else:
        srcs, dsts = as_list(src), as_list(dst)
        streams = current_framework_streams(srcs[0] if srcs else None, dsts[0] if dsts else None)
    handle = effective_handle(streams[0][0])
    plan = plan_blocks(
        src, dst, block_mapping, split_blocks=split_blocks, stream=dispatch.producer_stream_once(handle)
    )
    if len(streams) == 1:
        return dispatch.execute_blocks(plan, handle, method)
    return _between_devices(plan, streams, method)


def _block_side(
    side: Any, name: str, split_blocks: bool, handle: int, geometry: BlockGeometry | None = None
) -> BlockPlan:
    """One side of swap_blocks_both_ways, validated (its tensors read again unless
    ``geometry`` is given); errors named after the side."""
    try:
        if geometry is not None:
            return geometry.with_mapping(side[2])
        return plan_blocks(*side, split_blocks=split_blocks, stream=dispatch.producer_stream_once(handle))
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


def swap_blocks_both_ways(
    store: Any, load: Any, *, stream: Any = None, method: RequestedMethod = "auto", split_blocks: bool = False
) -> tuple[str, str]:
    """swap_blocks of a store and a load at once, as one copy_both_ways.

    Each side is a ``(src, dst, block_mapping)`` triple as swap_blocks takes,
    typically the store from a GPU cache to a host cache and the load back.
    Both sides' block copies go out together: below 128 KiB blocks as one kernel
    launch whose CTAs are split by direction, so neither direction starves the
    other on the PCIe link as two swap_blocks calls on two streams do, from
    there on the copy engines, both sides started at once (see copy_both_ways).

    Ordering as copy_both_ways: after the work queued on ``stream`` (None: the
    framework's current stream of the first tensors' device) and the pending
    writes array-interface producers declared, before the work queued there
    next. Both sides are validated before either is issued; where one side writes
    memory the other reads or writes (compared by memory, not by tensor), the
    call is refused with a ValueError naming both pairs.

    Returns the method each side ran with, e.g. ('kernel', 'kernel').

    Raises:
        TypeError, ValueError: bad tensors or ids, named with the side
            ('store' or 'load'), before anything is copied.
    """
    check_method(method)
    require_bool(split_blocks, "split_blocks")
    for side, name in ((store, "store"), (load, "load")):
        _require_triple(side, name, "src, dst, block_mapping")
    # None: the stream of the first tensor of each side's src and dst, as swap_blocks
    tensors = [parts[0] for side in (store, load) for parts in map(as_list, side[:2]) if parts]
    handle = effective_handle(
        resolve_stream(stream) if stream is not None else current_framework_stream(*tensors)
    )
    # the load usually goes back between the store's caches: read them once
    both = geometry_and_reverse(store[0], store[1]) if load[0] is store[1] and load[1] is store[0] else None
    plans = [
        _block_side(side, name, split_blocks, handle, both and both[k])
        for k, (side, name) in enumerate(((store, "store"), (load, "load")))
    ]
    race = race_between(plans[0], plans[1], ("store: block_mapping", "load: block_mapping"))
    if race:
        raise ValueError(
            f"{race}: a store and a load at once run in no order with each "
            "other; issue them one after the other to order them"
        )
    producers = [p for plan in plans for p in plan.geometry.producer_streams]
    if producers:
        with ContextScope(handle):
            if driver.stream_capture_status(handle) == 0:  # a graph cannot wait outside it
                dispatch.wait_for_streams(handle, producers)
    return both_ways.execute_plans_both(plans[0], plans[1], handle, method, ("store", "load"))


def _between_devices(plan: Any, streams: list[tuple[int, int]], method: str) -> str:
    """swap_blocks between two GPUs on torch's current streams, ordered as torch's
    copy_ orders a copy between devices (see swap_blocks)."""
    (first, device), others = streams[0], streams[1:]
    handle = effective_handle(first)
    driver.init()
    for other, other_device in others:
        driver.stream_wait_stream(handle, effective_handle(other), other_device, device)
    ran = dispatch.execute_blocks(plan, handle, method)
    for other, other_device in others:
        driver.stream_wait_stream(effective_handle(other), handle, device, other_device)
    return ran


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
    on the CPU, as kvcopy.prepare_rows gives. Indices on the host are checked at every
    call. Indices are on the GPU for both sides or on the host for both (ValueError).

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
    check_method(method)
    a, b, handle = src_indices, dst_indices, None
    known = rows_memo.entry(src, dst)
    if known is not None:
        # (these layouts were checked against each other: their indices are read next)
        a, b = read_indices(a, "src_indices"), read_indices(b, "dst_indices")
        if _gpu_only(a, b):
            handle = rows_stream(stream, (src, dst), (src_indices, dst_indices))
            again = rows_memo.repeat(known, rows_memo.call_key(a, b, rows, handle, method))
            if again is not None:
                return again()
    plan = plan_rows(src, dst, a, b, rows)
    if handle is None:
        handle = rows_stream(stream, (src, dst), (src_indices, dst_indices))
    # (execute_rows hands over what repeats the call only where its indices are on the GPU)
    key = rows_memo.call_key(plan.src_indices, plan.dst_indices, rows, handle, method)
    return execute_rows(
        plan, handle, method, remember=lambda again: rows_memo.remember((src, dst), key, again)
    )


def copy_planned_rows(plan: RowsPlan, stream: Any) -> str:
    """Issue ``plan`` (plan_rows' answer, every check made) on ``stream`` (any stream
    kvcopy.resolve_stream accepts) as copy_rows issues its own, for a drop-in that plans
    every part of a transfer before it issues any; nothing is kept to repeat the call.
    Returns the method that ran, as copy_rows."""
    return execute_rows(plan, resolve_stream(stream), "auto")


def _gpu_only(a: Indices | None, b: Indices | None) -> bool:
    """Indices on the GPU for one side at least, none on the host."""
    if a is None:
        return b is not None and b.host is None
    return a.host is None and (b is None or b.host is None)


def check_indices(stream: Any = None) -> None:
    """Wait for ``stream`` (None: the whole device), then raise IndexOutOfRange where
    the copy kernel skipped rows for an out-of-range GPU-resident index in the current
    context since the last check (the count is then cleared). The count is the
    context's, over every stream: check where no other copy_rows call is in flight."""
    rows_check_indices(resolve_stream(stream) if stream is not None else None)


__all__ = [
    "check_indices",
    "copy_batch",
    "copy_both_ways",
    "copy_rows",
    "last_decision",
    "swap_blocks",
    "swap_blocks_both_ways",
]
