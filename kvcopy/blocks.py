"""The block family: swap_blocks copies blocks of paged KV caches by block id, and
swap_blocks_both_ways a store and a load of them at once. Every argument is checked
before anything is enqueued; the engine issues the plan."""

from __future__ import annotations

from typing import Any

from kvcopy._engine import both_ways, dispatch, repeats
from kvcopy._engine.blocks import execute_blocks
from kvcopy._plans.races import race_between
from kvcopy._plans.blocks import BlockPlan, GeometryAndMemory, geometry_and_reverse, plan_blocks
from kvcopy.arguments import require_bool, require_triple
from kvcopy.interop.arrays import as_list
from kvcopy._cuda import driver
from kvcopy._runtime.context import ContextScope
from kvcopy.interop.streams import (
    current_framework_stream,
    current_framework_streams,
    effective_handle,
    resolve_stream,
)
from kvcopy.policy import RequestedMethod, check_method


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
    split_blocks = require_bool(split_blocks, "split_blocks")
    if stream is not None:
        streams = [(resolve_stream(stream), -1)]
    else:
        srcs, dsts = as_list(src), as_list(dst)
        streams = current_framework_streams(srcs[0] if srcs else None, dsts[0] if dsts else None)
    handle = effective_handle(streams[0][0])
    if len(streams) == 1:
        # (an engine's call of every step: the same caches, as many pairs)
        ran = repeats.repeat_blocks(src, dst, block_mapping, handle, method, split_blocks)
        if ran is not None:
            return ran
    plan = plan_blocks(
        src, dst, block_mapping, split_blocks=split_blocks, stream=dispatch.producer_stream_once(handle)
    )
    if len(streams) == 1:
        return execute_blocks(plan, handle, method)
    return _between_devices(plan, streams, method)


def _block_side(
    side: Any, name: str, split_blocks: bool, handle: int, read: GeometryAndMemory | None = None
) -> BlockPlan:
    """One side of swap_blocks_both_ways, validated (its tensors read again unless
    their geometry and memory store are given, ``read``); errors named after the side."""
    try:
        if read is not None:
            return read[0].with_mapping(side[2], (*as_list(side[0]), *as_list(side[1])), read[1])
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
        require_triple(side, name, "src, dst, block_mapping")
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
    ran = execute_blocks(plan, handle, method)
    for other, other_device in others:
        driver.stream_wait_stream(effective_handle(other), handle, device, other_device)
    return ran


__all__ = ["swap_blocks", "swap_blocks_both_ways"]
