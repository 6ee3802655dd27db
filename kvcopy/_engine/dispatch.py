"""Runs a batch of pointer copies (copy_batch's family): enters its context, has it
described and decided (kvcopy._engine.decide), and issues it by the chosen path: the
copy kernel (kvcopy._engine.kernel), batched or per-copy DMA, or staging
(kvcopy._engine.staged). Also what the families share: the copy engines' issue of a
batch, memory kept or classified for a call's tensors, producers' streams."""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from kvcopy import policy
from kvcopy._cuda import describe, dma, driver, launch
from kvcopy._cuda.describe import DescribedBatch
from kvcopy._engine import guard, replay, staged
from kvcopy._engine.decide import (
    MemoryClasses,
    Target,
    decide,
    note_decision,
    reach_peers,
    settled_classes,
)
from kvcopy._engine.kernel import HostScratch, launch_kernel
from kvcopy._engine.repeats import decided_for_repeats
from kvcopy._runtime import device, kept_memory, ring, side_streams
from kvcopy._runtime.context import ContextScope
from kvcopy.arguments import require_same_length
from kvcopy.config import config
from kvcopy.errors import CudaError, NoDriverError
from kvcopy.interop.streams import STREAM_LEGACY, effective_handle
from kvcopy.policy import Decision
from kvcopy._plans.copies import CopyPlan, plan_copies


def run_staged(handle: int, batches: list[staged.StagedBatch], info: device.DeviceInfo) -> str:
    """Issue planned staged batches (kvcopy._engine.staged) on ``handle`` and record their
    decision as the calling thread's last; returns "staged"."""
    staged.run(handle, batches, info.cc, info.driver_version)
    note_decision(batches[0].decision)
    return "staged"


_FIRST_ONLY = np.zeros(1, np.int64)  # (a one-copy plan's copy is the caller's first)


def issue_dma(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, merge: bool, target: Target, access_any: bool
) -> None:
    """Plan the batch for the DMA engines (merged only inside allocations, pageable
    pointers checked against this process's mappings) and issue it. One copy of memory
    the device reaches (``target``'s classes: no pageable, managed or unmapped peer
    memory, no copy past its allocation's end) has nothing to merge or check: it goes
    as given, without asking the driver about its pointers again."""
    if len(sizes) == 1 and target.request.device_accessible:
        plan = CopyPlan(src, dst, sizes, _FIRST_ONLY)
    else:
        plan = CopyPlan(*dma.plan_dma(src, dst, sizes, merge))
    try:
        if target.decision.method == "batch":
            dma.memcpy_batch(plan.dst, plan.src, plan.sizes, target.handle, access_any, config.batch_chunk)
        else:
            dma.memcpy_loop(plan.dst, plan.src, plan.sizes, target.handle)
    except CudaError as exc:
        message = exc.message
        if target.request.unreachable and target.request.direction == "p2p":
            # the driver refuses copies with another GPU's memory not mapped for this one
            message += (
                f"; the batch has {target.request.unreachable}, which the driver's copy "
                "engines refuse as well"
            )
        raise type(exc)(exc.code, exc.name, message, plan.caller_index(exc.index)) from None


def execute_copies(
    scope: ContextScope,
    handle: int,
    src: np.ndarray,
    dst: np.ndarray,
    sizes: np.ndarray,
    method: str,
    merge: bool,
    access_any: bool,
    max_ctas: int | None,
    allow_batch: bool = True,
    described: DescribedBatch | None = None,
) -> str:
    """Describe, decide and issue a batch in the scope's context, by exactly one path.

    One pass (describe_copies) validates and plans the batch, classifies its
    memory and writes the kernel's descriptors straight into a pinned descriptor
    slot (or, for batches of one launch by value, into thread-local scratch), so
    the kernel path touches each copy once. ``described``: that pass already made
    into this thread's scratch (replay.replay's, for a small batch no record
    matched). Large batches of one block size in one allocation per side get
    16-byte entries instead of 32-byte ones (describe_compact): the pass is bound by
    its writes to pinned memory. The DMA paths plan the batch for the copy engines
    as they issue it (dma.plan_dma), staging as it issues each chunk (its choice
    reads the host spans the describe pass counted).
    While the stream captures a graph, nothing here queries or waits on an
    event or a stream, and nothing is allocated on the device.
    """
    capturing = driver.stream_capture_status(handle) != 0
    nbytes = len(sizes) * describe.DESCRIPTOR_BYTES
    # batches too large to pass by value are described in half the bytes where they can be
    compact = not capturing and len(sizes) > launch.INLINE_MAX
    while True:
        space = (
            HostScratch(nbytes)
            if capturing or len(sizes) <= launch.INLINE_MAX_SMALL
            else ring.ring_for_current_context().reserve(nbytes)
        )
        with space as slot:
            batch = (
                described
                if described is not None and described.table == slot.host
                else (describe.describe_compact if compact else describe.describe_copies)(
                    src, dst, sizes, slot.host, merge
                )
            )
            described = None  # (described again below, where the device changes)
            if batch.count == 0:
                return "none"
            found = MemoryClasses.of(batch)
            if scope.on_default_stream and scope.follow_memory(found.owner):
                continue  # switched device: host memory may be mapped elsewhere there
            if reach_peers(found, method):
                continue  # peer access enabled: another GPU's memory is now reachable
            target = decide(
                handle,
                method,
                batch.count,
                batch.total_bytes,
                found,
                capturing,
                allow_batch,
                note_traffic=True,
            )
            if target.decision.method != "kernel":
                break
            # (a caller's CTA limit asks for the kernel itself)
            staging = (
                None
                if max_ctas is not None
                else staged.plan_batch(
                    target.request, target.decision, batch, method, device.thresholds(target.info.ordinal)
                )
            )
            if staging is None:
                with guard.timed(target):
                    launched = launch_kernel(batch, target, slot, max_ctas)
                if launched and merge and policy.may_replay(method, max_ctas, allow_batch, capturing):
                    # (copy_batch's next call like this one is replayed)
                    replay.record(target, batch, method, launched)
                return "kernel"
        # staged batches' descriptors go to a slot of their own, once this one is free
        return run_staged(handle, [staging], target.info)
    with guard.timed(target):
        issue_dma(src, dst, sizes, merge, target, access_any)
    if (
        merge  # (copy_batch's own arrays: a replay issues the caller's copies as given)
        and target.decision.method == "loop"
        and target.request.device_accessible
        and policy.may_replay(method, max_ctas, allow_batch, capturing)
        and decided_for_repeats(target, method)
    ):
        replay.record_copies(target, batch, method)  # (copy_batch's next call like it)
    return target.decision.method


def execute(
    plan: CopyPlan,
    stream_handle: int,
    method: str = "auto",
    access_any: bool = False,
    max_ctas: int | None = None,
) -> str:
    """Issue a planned batch on the stream (a raw handle; 0 means the default stream)."""
    if plan.count == 0:
        return "none"
    handle = effective_handle(stream_handle)
    with ContextScope(handle) as scope:
        return execute_copies(
            scope, handle, plan.src, plan.dst, plan.sizes, method, False, access_any, max_ctas
        )


def execute_arrays(
    src: np.ndarray,
    dst: np.ndarray,
    sizes: np.ndarray,
    stream_handle: int,
    method: str = "auto",
    access_any: bool = False,
    max_ctas: int | None = None,
    allow_batch: bool = True,
) -> str:
    """Validate and issue three uint64 arrays (copy_batch's path: no CopyPlan is built
    unless a DMA method runs). Raises ValueError for a bad copy before issuing any."""
    require_same_length(src, dst, sizes)
    if len(sizes) == 0:
        return "none"
    handle = effective_handle(stream_handle)
    described = None
    # (only a batch a record could match is worth scratch memory for its description)
    if len(sizes) <= replay.MAX_COPIES and policy.may_replay(method, max_ctas, allow_batch):
        scratch = HostScratch(len(sizes) * describe.DESCRIPTOR_BYTES)
        answer = replay.replay(src, dst, sizes, handle, method, scratch.host)
        if isinstance(answer, Decision):
            note_decision(answer)
            return answer.method
        described = answer
    try:
        with ContextScope(handle) as scope:
            return execute_copies(
                scope, handle, src, dst, sizes, method, True, access_any, max_ctas, allow_batch, described
            )
    except NoDriverError:
        # without a GPU, bad input is still reported as such, and empty copies need none
        if plan_copies(src, dst, sizes).count == 0:
            return "none"
        raise
    except CudaError:
        # a driver failure before or during the describe pass (a stream of a destroyed
        # context, say) must not hide a bad argument: that is reported first
        plan_copies(src, dst, sizes)
        raise


def wait_for_streams(handle: int, streams: Iterable[int]) -> None:
    """Make the stream ``handle`` wait (on the GPU) for the work queued so far on each of
    ``streams``, once each: the streams array-interface producers declared."""
    for stream in dict.fromkeys(streams):
        driver.stream_wait_stream(handle, stream)


def producer_stream(handle: int) -> int:
    """The stream to hand DLPack producers of a copy on ``handle``, so that they order
    their pending writes before it: ``handle`` itself, or where it captures a graph, a
    side stream of kvcopy's that does not. A graph waits for nothing outside it
    (array-interface producers' streams are not waited for under capture either): a
    producer handed the capturing stream makes it wait for its own work, which ends
    the capture (JAX does, its array ready or not), and what a replay reads is the
    caller's to order when it replays. The DLPack value for no ordering, -1, is
    refused by JAX (CUDA_ERROR_INVALID_HANDLE), so the producer's wait goes to a
    stream no copy runs on. Asked only where such a producer is met (a driver call)."""
    if handle == STREAM_LEGACY:  # (the legacy stream never captures)
        return handle
    try:
        with ContextScope(handle):
            if driver.stream_capture_status(handle) == 0:
                return handle
            return side_streams.for_caller(handle, _PRODUCERS)
    except CudaError:  # (the copy itself will name what is wrong with the stream)
        return handle


def producer_stream_once(handle: int) -> Callable[[], int]:
    """producer_stream(handle) as a function for planning (interop.tensors.
    ConsumerStream), asking the driver at the first DLPack producer of GPU memory only:
    a list of a layer's arrays hands every one the same stream."""
    found: list[int] = []

    def stream() -> int:
        if not found:
            found.append(producer_stream(handle))
        return found[0]

    return stream


# The caller's side stream (index) for DLPack producers' waits under capture (not a
# staged path's, nor swap_blocks' id uploads': kvcopy._engine.blocks)
_PRODUCERS = 4


def stored_or_classified(
    store: kept_memory.MemoryStore,
    bases: tuple[np.ndarray, np.ndarray],
    classify: Callable[[np.ndarray, np.ndarray], MemoryClasses],
) -> tuple[MemoryClasses, np.ndarray, np.ndarray, bool]:
    """Memory classes and each side's ``bases`` as the device sees them, as kept in
    ``store`` for the current context, else ``classify(src_view, dst_view)`` now and
    kept there; and whether they came from the store. The context is read before
    classifying, which may move the call to the memory's device."""
    context = driver.current_context_key()
    kept = kept_memory.find_in(store, context)
    if kept is not None:
        return kept.found, kept.src_view, kept.dst_view, True
    src_view, dst_view = np.empty_like(bases[0]), np.empty_like(bases[1])
    found = classify(src_view, dst_view)
    if context:
        kept_memory.keep_in(store, context, found, src_view, dst_view)
    return found, src_view, dst_view, False


def kept_or_classified(
    scope: ContextScope,
    key_of: Callable[[], object],
    owners: tuple,
    bases: tuple[np.ndarray, np.ndarray],
    classify_again: Callable[[np.ndarray, np.ndarray], MemoryClasses],
    method: str,
    hold_it_all: Callable[[], bool] = lambda: True,
    store: kept_memory.MemoryStore | None = None,
) -> tuple[MemoryClasses, np.ndarray, np.ndarray]:
    """Memory classes and each side's ``bases`` as the device sees them, in the context
    the call entered: as kept in ``store`` (where the memory is known to be held for as
    long as the store lives: a plan's owners found unchanged, a pair of held layouts),
    else as kept for the same live ``owners`` under ``key_of()`` (worked out only where
    owners may be kept: kvcopy._runtime.kept_memory), else classified now by
    ``classify_again(src_view, dst_view)``; what was not in the store is put there, and
    kept for the owners where ``hold_it_all()`` says they hold all of that memory. A
    default stream's call moves to the memory's device either way, as classification
    moves it."""
    # (only torch tensors are kept: the first owner says whether to look; a hit is the
    # same objects, and keep() checks every owner)
    keyed = kept_memory.may_be_kept(owners)
    context = driver.current_context_key() if keyed or store is not None else 0
    kept = kept_memory.find_in(store, context) if store is not None else None
    keyed = keyed and bool(context)
    key = key_of() if keyed and kept is None else None
    if kept is None and keyed:
        kept = kept_memory.find(key, context, owners)
        if kept is not None and store is not None:
            kept_memory.keep_in(store, context, kept.found, kept.src_view, kept.dst_view)
    if kept is not None:
        scope.follow_memory(kept.found.owner)  # (classification moves the call itself)
        return kept.found, kept.src_view, kept.dst_view
    src_view, dst_view = np.empty_like(bases[0]), np.empty_like(bases[1])
    found = settled_classes(scope, method, lambda: classify_again(src_view, dst_view))
    if context and store is not None:
        kept_memory.keep_in(store, context, found, src_view, dst_view)
    if keyed and hold_it_all():
        kept_memory.keep(key, context, owners, found, src_view, dst_view)
    return found, src_view, dst_view
