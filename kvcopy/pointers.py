"""The pointer family: copy_batch copies raw (src, dst, size) triples, and
copy_both_ways a store and a load of them at once. Every argument is checked before
anything is enqueued; the engine issues the batch."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcopy._engine import both_ways, dispatch
from kvcopy._plans.races import refuse_crossing
from kvcopy.arguments import require_bool, require_int, require_triple
from kvcopy.interop.arrays import as_u64_array
from kvcopy._cuda.plan_arrays import copies_ok
from kvcopy.interop.streams import current_framework_stream, resolve_stream
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
    one issued before (same stream, method, kinds of memory, copies after
    merging and bytes, under the same settings) goes straight to what was issued
    for it (kvcopy._engine.replay): the kernel's launch, or, where the copy engines
    took one cuMemcpyAsync a copy of memory the device reaches, the caller's copies
    one cuMemcpyAsync each; still checked copy by copy, several microseconds of CPU
    sooner.

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
        refuse_order_dependence(src, dst, size_arr)
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


def refuse_unless_apart(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
    """ValueError for a bad copy or a batch whose copies depend on their order (as
    copy_batch refuses them with check_overlap); nothing for a batch shown apart."""
    if not copies_ok(src, dst, sizes):
        refuse_order_dependence(src, dst, sizes)


def refuse_order_dependence(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
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


def _triple(batch: Any, name: str) -> tuple:
    require_triple(batch, name, "src_ptrs, dst_ptrs, sizes")
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
                refuse_unless_apart(*side)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
    refuse_crossing(first, second)
    handle = resolve_stream(stream) if stream is not None else current_framework_stream(*store, *load)
    return both_ways.execute_both(first, second, handle, method, ("store", "load"))


__all__ = ["copy_batch", "copy_both_ways"]
