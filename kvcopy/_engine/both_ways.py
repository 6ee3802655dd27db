"""A store and a load at once: two batches in one kernel launch, each with its own
CTAs, or each by DMA on a stream of its own.

Over PCIe, a GPU-to-host copy kernel's writes and a host-to-GPU kernel's read
requests share the upstream link, and which one gets it depends on how many SMs
issue each: launched separately with equal footprints, the writes win and the
reads starve. One launch with CTAs split by direction (policy.BOTH_WAYS_CTAS,
calibratable per device) keeps the two balanced, and the caller needs one stream.
From 128 KiB blocks (policy.choose_both_ways) both sides go to the copy engines
instead, issued in chunks that alternate between the two sides, so that both
directions start at once and neither waits for the CPU to issue the other.
Wherever the sides run apart, the second runs on a stream of kvcopy's own (one per
caller's stream) that forks from the caller's stream and joins it again.
Where both sides' host memory is a few long spans, both go through GPU staging
buffers instead (kvcopy._engine.staged): the copy engines move the spans, the kernel
scatters inside the GPU, and both directions stay near the link's limit.
swap_blocks_both_ways' sides, where both go to the kernel, are one launch of the
block kernel instead (execute_blocks_both): it computes each block's addresses from
the tensor tables and ids, so no copy is described on the CPU.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from kvcopy import policy
from kvcopy._engine import blocks, decide, dispatch, staged
from kvcopy._runtime import device, kernels, ring, side_streams
from kvcopy._cuda import describe, dma, driver, launch
from kvcopy.config import config
from kvcopy._runtime.context import ContextScope
from kvcopy.errors import CudaError, NoDriverError
from kvcopy.interop.streams import effective_handle
from kvcopy._plans.blocks import BlockPlan
from kvcopy._plans.copies import CopyPlan, plan_copies
from kvcopy.policy import Decision

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]


def _describe(batch: Arrays, out: int, name: str) -> describe.DescribedBatch:
    """describe_copies of one side, its errors named after the side."""
    try:
        return describe.describe_copies(*batch, out, True)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _one_owner(found: Iterable[decide.MemoryClasses]) -> int | None:
    """The one device whose memory both sides hold (-1: no device memory); None where
    they hold memory of several devices."""
    owners = {f.owner for f in found if f.owner != -1}
    if len(owners) > 1 or -2 in owners:
        return None
    return owners.pop() if owners else -1


Side = tuple[int, int, decide.MemoryClasses]  # copies, bytes, memory


def _kernel_pair(
    handle: int, method: str, sides: Iterable[Side], thresholds: policy.Thresholds | None
) -> tuple[decide.Target, decide.Target] | Decision | None:
    """Each side's target, from its (copies, bytes, MemoryClasses), and their joint
    choice: a Decision where both go to the copy engines together
    (policy.choose_both_ways), both targets where the kernel takes both, else None
    (each side apart, as the policy says)."""
    a, b = (decide.decide(handle, method, count, nbytes, found, False) for count, nbytes, found in sides)
    joint = policy.choose_both_ways(
        a.request, b.request, a.info.caps, thresholds or device.thresholds(a.info.ordinal), method
    )
    if joint is not None:
        return joint
    if a.decision.method != "kernel" or b.decision.method != "kernel":
        return None
    return a, b


def _fused(
    scope: ContextScope,
    handle: int,
    first: Arrays,
    second: Arrays,
    method: str,
    names: tuple[str, str],
    thresholds: policy.Thresholds | None,
) -> tuple[str, str] | Decision | list[staged.StagedBatch] | None:
    """Describe (so validate) both batches into one slot and, where the policy picks
    the kernel for both, launch them as one. A Decision: both go to the copy
    engines together (policy.choose_both_ways). Staged batches: both go through
    GPU staging buffers (the caller issues them). None: run them apart (another
    method, memory of several devices, or an empty side)."""
    nbytes = (len(first[2]) + len(second[2])) * describe.DESCRIPTOR_BYTES
    while True:
        with ring.ring_for_current_context().reserve(nbytes) as slot:
            batch_a = _describe(first, slot.host, names[0])
            offset = slot.host + batch_a.count * describe.DESCRIPTOR_BYTES
            batch_b = _describe(second, offset, names[1])
            count_a, bytes_a, tiles_a = batch_a.count, batch_a.total_bytes, batch_a.tiles
            count_b, bytes_b, tiles_b = batch_b.count, batch_b.total_bytes, batch_b.tiles
            found_a, found_b = decide.MemoryClasses.of(batch_a), decide.MemoryClasses.of(batch_b)
            owner = _one_owner((found_a, found_b))
            if owner is None or not count_a or not count_b:
                return None
            if scope.follow_memory(owner):
                continue  # switched device: describe again there
            joint = _kernel_pair(
                handle, method, ((count_a, bytes_a, found_a), (count_b, bytes_b, found_b)), thresholds
            )
            if not isinstance(joint, tuple):
                return joint
            a, b = joint
            both_staged = _staged_pair((a, b), (batch_a, batch_b), method, names, thresholds)
            if both_staged:
                return both_staged  # issued once the slot is given back
            kernel = kernels.kernel_for_current_context(*a.info.cc, a.info.driver_version)
            in_place = tiles_a == count_a and policy.descriptors_in_place(
                tiles_b, count_b, (a.request.direction, b.request.direction)
            )
            ctas = (a.ctas(None, both_ways=True), b.ctas(None, both_ways=True))
            if in_place:
                launches = policy.both_ways_launches(bytes_a, bytes_b, config.launch_bytes)
                _launch_in_slices(kernel.function_both, slot, count_a, count_b, ctas, launches, handle)
            else:
                launch.launch_both(
                    kernel.function_both,
                    slot.device,
                    count_a,
                    tiles_a,
                    ctas[0],
                    count_b,
                    tiles_b,
                    ctas[1],
                    config.threads_per_cta,
                    handle,
                    slot.host,
                )
            ring.DescriptorRing.fence(slot, handle)
            return "kernel", "kernel"


def _staged_pair(
    targets: tuple[decide.Target, decide.Target],
    batches: tuple[describe.DescribedBatch, describe.DescribedBatch],
    method: str,
    names: tuple[str, str],
    thresholds: policy.Thresholds | None,
) -> list[staged.StagedBatch]:
    """Both sides as staged batches, where the policy stages both (kvcopy._engine.staged); else
    none: one side staged beside the kernel pair's other side falls below the kernel
    pair."""
    found = []
    for target, batch, name in zip(targets, batches, names):
        side = staged.plan_batch(
            target.request,
            target.decision,
            batch,
            method,
            thresholds or device.thresholds(target.info.ordinal),
            name,
        )
        if side is None:
            return []
        found.append(side)
    return found


def _launch_in_slices(
    function: int,
    slot: ring.Slot,
    count_a: int,
    count_b: int,
    ctas: tuple[int, int],
    launches: int,
    handle: int,
) -> None:
    """The fused kernel over two batches of one-tile copies described back to back in
    ``slot``, read in place, as ``launches`` launches in a row: slice k of both
    batches in each (one-tile copies ignore tile_start: any slice is a batch)."""
    step_a, step_b = -(-count_a // launches), -(-count_b // launches)
    entry = describe.DESCRIPTOR_BYTES
    for k in range(launches):
        n_a = max(min(step_a, count_a - k * step_a), 0)
        n_b = max(min(step_b, count_b - k * step_b), 0)
        launch.launch_both(
            function,
            slot.mapped + k * step_a * entry,
            n_a,
            n_a,
            ctas[0],
            n_b,
            n_b,
            ctas[1],
            config.threads_per_cta,
            handle,
            0,
            slot.mapped + (count_a + k * step_b) * entry,
        )


def execute_both(
    first: Arrays,
    second: Arrays,
    stream_handle: int,
    method: str = "auto",
    names: tuple[str, str] = ("first", "second"),
    thresholds: policy.Thresholds | None = None,
) -> tuple[str, str]:
    """Issue two batches together, ordered after the work on ``stream_handle`` and
    before the work enqueued there next (see the module doc); returns the method
    each ran with. Raises ValueError (prefixed with the side's name) for a bad copy
    of either batch before either is issued. ``thresholds``: the joint choice's, in
    place of the device's (calibrate measures both paths without changing what
    other threads' calls decide)."""
    handle = effective_handle(stream_handle)
    try:
        return _execute_both(handle, first, second, method, names, thresholds)
    except NoDriverError:
        # without a GPU, bad input is still reported as such
        for (src, dst, sizes), name in zip((first, second), names):
            try:
                plan_copies(src, dst, sizes)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        raise


def _execute_both(
    handle: int,
    first: Arrays,
    second: Arrays,
    method: str,
    names: tuple[str, str],
    thresholds: policy.Thresholds | None,
) -> tuple[str, str]:
    with ContextScope(handle) as scope:
        capturing = driver.stream_capture_status(handle) != 0
        ran = None
        if not capturing and method in ("auto", "kernel"):
            ran = _fused(scope, handle, first, second, method, names, thresholds)
            if isinstance(ran, tuple):
                return ran
            if isinstance(ran, list):
                dispatch.run_staged(handle, ran, device.device_info(driver.context_device()))
                return "staged", "staged"
        # apart: both are checked as the DMA paths check (host memory readable or
        # writable by this process) before either is issued
        plans = []
        for batch, name in zip((first, second), names):
            try:
                plans.append(CopyPlan(*dma.plan_dma(*batch, True)))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        if isinstance(ran, Decision):
            decide.note_decision(ran)
            _interleave_batches(handle, plans[0], plans[1], names)
            return "batch", "batch"
        if capturing:  # one stream: the graph keeps the two in order
            return (
                dispatch.execute_copies(scope, handle, *first, method, True, False, None),
                dispatch.execute_copies(scope, handle, *second, method, True, False, None),
            )
        side = side_streams.for_caller(handle)
        driver.stream_wait_stream(side, handle)
        ran_a = dispatch.execute_copies(scope, handle, *first, method, True, False, None)
        # the side stream is a created stream of this context: its scope never moves
        ran_b = dispatch.execute_copies(ContextScope(side), side, *second, method, True, False, None)
        driver.stream_wait_stream(handle, side)
        return ran_a, ran_b


def _interleave_batches(handle: int, first: CopyPlan, second: CopyPlan, names: tuple[str, str]) -> None:
    """cuMemcpyBatchAsync of two planned batches, policy.BOTH_WAYS_DMA_CHUNK copies at a time in
    turn: the first on ``handle``, the second on the side stream (forked from
    ``handle`` before, joined into it after, even when a call fails)."""
    side = side_streams.for_caller(handle)
    driver.stream_wait_stream(side, handle)
    try:
        for start in range(0, max(first.count, second.count), policy.BOTH_WAYS_DMA_CHUNK):
            stop = start + policy.BOTH_WAYS_DMA_CHUNK
            for plan, stream, name in ((first, handle, names[0]), (second, side, names[1])):
                if start >= plan.count:
                    continue
                try:
                    dma.memcpy_batch(
                        plan.dst[start:stop],
                        plan.src[start:stop],
                        plan.sizes[start:stop],
                        stream,
                        False,
                        policy.BOTH_WAYS_DMA_CHUNK,
                    )
                except CudaError as exc:
                    index = None if exc.index is None else exc.index + start
                    raise type(exc)(
                        exc.code, exc.name, f"{name}: {exc.message}", plan.caller_index(index)
                    ) from None
    finally:
        driver.stream_wait_stream(handle, side)


def execute_blocks_both(
    first: BlockPlan, second: BlockPlan, stream_handle: int, method: str = "auto"
) -> tuple[str, str] | None:
    """Two validated swap_blocks plans as one launch of the block kernel, CTAs split by
    direction as execute_both splits them, ordered as execute_both orders its work.
    Memory is classified per tensor, as swap_blocks classifies it. Returns None,
    having issued nothing, where this does not apply: a method other than auto or
    kernel, an empty side, stream capture (the block kernel's tables live in the
    descriptor ring), memory of several devices or of a peer, no driver, or the
    policy choosing anything but the kernel for either side (the copy engines for
    both from 128 KiB blocks); the caller then runs execute_both over every copy."""
    if method not in ("auto", "kernel") or not first.num_pairs or not second.num_pairs:
        return None
    handle = effective_handle(stream_handle)
    try:
        with ContextScope(handle) as scope:
            return _blocks_both(scope, handle, first, second, method)
    except NoDriverError:
        return None


def execute_plans_both(
    first: BlockPlan, second: BlockPlan, stream_handle: int, method: str, names: tuple[str, str]
) -> tuple[str, str]:
    """Two validated swap_blocks plans together (swap_blocks_both_ways, a TransferQueue
    job with ``back``): one launch of the block kernel where execute_blocks_both
    applies, else every block copy of both through execute_both, its errors prefixed
    with ``names``. Returns the method each ran with."""
    ran = execute_blocks_both(first, second, stream_handle, method)
    if ran is not None:
        return ran
    return execute_both(first.copy_arrays(), second.copy_arrays(), stream_handle, method, names)


def _classified(plan: BlockPlan) -> tuple[decide.MemoryClasses, tuple[np.ndarray, np.ndarray]]:
    """A plan's memory classes and each side's bases as the device sees them: kept in
    its store where its tensors were found unchanged (dispatch.stored_or_classified),
    else classified now."""
    bases = (plan.geometry.src_base, plan.geometry.dst_base)
    if plan.memory is not None:
        found, src_view, dst_view, _ = dispatch.stored_or_classified(
            plan.memory, bases, lambda src, dst: blocks.classify_tensors(plan, src, dst)
        )
        return found, (src_view, dst_view)
    views = (np.empty_like(bases[0]), np.empty_like(bases[1]))
    return blocks.classify_tensors(plan, *views), views


def _blocks_both(
    scope: ContextScope, handle: int, first: BlockPlan, second: BlockPlan, method: str
) -> tuple[str, str] | None:
    if driver.stream_capture_status(handle) != 0:
        return None
    while True:
        found, views = zip(*(_classified(p) for p in (first, second)))
        owner = _one_owner(list(found))
        if owner is None:
            return None
        if not scope.follow_memory(owner):
            break  # else switched device: classify again there
    joint = _kernel_pair(
        handle, method, [(p.num_copies, p.total_bytes, f) for p, f in zip((first, second), found)], None
    )
    if not isinstance(joint, tuple):
        return None  # the copy engines for both, or either side apart
    a, b = joint
    if {a.request.direction, b.request.direction} - {"h2d", "d2h", "d2d"}:
        return None
    kernel = kernels.kernel_for_current_context(*a.info.cc, a.info.driver_version)
    tables = [p.tensor_table(*v) for p, v in zip((first, second), views)]
    nbytes = launch.blocks_both_upload_bytes(
        tables[0].shape[0], first.num_pairs, tables[1].shape[0], second.num_pairs
    )
    with ring.ring_for_current_context().reserve(nbytes) as slot:
        launch.launch_blocks_both_uploaded(
            kernel.function_blocks_both,
            slot.host,
            slot.device,
            tables[0],
            first.mapping,
            first.geometry.block_bytes,
            a.ctas(None, both_ways=True),
            tables[1],
            second.mapping,
            second.geometry.block_bytes,
            b.ctas(None, both_ways=True),
            config.threads_per_cta,
            handle,
        )
        ring.DescriptorRing.fence(slot, handle)
    return "kernel", "kernel"
