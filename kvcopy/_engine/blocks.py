"""The block family's issue: a swap_blocks plan (kvcopy._plans.blocks) classified per
tensor, decided, and issued by the layout kernel (sides of one stride each), the block
kernel (a table of the tensors) or the copy engines; and what repeats it
(kvcopy._engine.repeats.BlockRepeat), built from the first call."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvcopy import policy
from kvcopy._cuda import describe, dma, driver, launch, plan_arrays, rows
from kvcopy._engine import guard, repeats
from kvcopy._engine.decide import MemoryClasses, Target, classify_sides, decide
from kvcopy._engine.dispatch import issue_dma, kept_or_classified, wait_for_streams
from kvcopy._engine.kernel import HostScratch, launch_kernel
from kvcopy._plans.blocks import BlockPlan
from kvcopy._plans.races import tensors_apart
from kvcopy._runtime import kernels, ring, side_streams
from kvcopy._runtime.context import ContextScope
from kvcopy.config import config
from kvcopy.interop.streams import STREAM_LEGACY, effective_handle

# The caller's side stream (index) for swap_blocks' id uploads (not a staged path's,
# nor DLPack producers': kvcopy._engine.dispatch)
_ID_UPLOADS = 3


def classify_tensors(blocks: BlockPlan, src_view: np.ndarray, dst_view: np.ndarray) -> MemoryClasses:
    """Classify a swap_blocks plan's memory per tensor, writing each tensor's base as
    the device sees it into ``src_view`` and ``dst_view``."""
    g = blocks.geometry
    return classify_sides(g.src_base, g.src_extent, g.dst_base, g.dst_extent, src_view, dst_view)


def _launch_as_rows(
    blocks: BlockPlan,
    sides: tuple[tuple[int, ...], tuple[int, ...]],
    kernel: kernels.CopyKernel,
    target: Target,
    src_view: np.ndarray,
    dst_view: np.ndarray,
    built: Sequence[rows.RowsLaunches] = (),
) -> None:
    """A swap_blocks plan whose sides have one stride each, by the layout kernel, the
    rest of the job passed by value (no tensor table), with the layout kernel's CTAs.
    The ids go up in chunks (policy.id_chunks), each as one array per side, each
    launched once written: the GPU starts on the first while the CPU writes the next.
    With more than one chunk the uploads go on a side stream, each launch waiting for
    its own chunk's ids only: no upload waits behind the launch before it, so the SMs
    go from one launch to the next without waiting. Ids of one chunk go as a repeat's
    do (_ids_launched: read where they were written where few enough). ``built``: each
    chunk's launches as an earlier call of as many pairs built them (its ids given at
    each launch), else built now."""
    n, handle, start = blocks.num_pairs, target.handle, 0
    chunks = policy.id_chunks(n)
    if len(chunks) == 1:
        views = (src_view, dst_view)
        launches = built[0] if built else _block_launches(blocks, sides, kernel, target, views, (0, 0), n)
        _ids_launched(blocks.mapping, launches, handle, blocks.geometry.num_tensors)
        return
    uploads = side_streams.for_caller(handle, _ID_UPLOADS)
    # (the ring hands out a slot its last readers are done with: no wait for them here)
    with ring.ring_for_current_context().reserve(16 * n) as slot:
        for k, count in enumerate(chunks):
            at = 16 * start
            nbytes = plan_arrays.split_block_ids(blocks.mapping, slot.host + at, start, count)
            launch.upload(slot.device + at, slot.host + at, nbytes, uploads)
            if uploads != handle:
                driver.stream_wait_stream(handle, uploads)
            ids = (slot.device + at, slot.device + at + 8 * count)
            if built:
                built[k].launch_indexed(*ids)
            else:
                _block_launches(blocks, sides, kernel, target, (src_view, dst_view), ids, count).launch()
            start += count
        ring.DescriptorRing.fence(slot, handle)


def _rows_repeat(
    blocks: BlockPlan, sides: tuple, kernel: kernels.CopyKernel, target: Target, views: tuple
) -> repeats.BlockRepeat:
    """The repeat of a plan _launch_as_rows issued (``views``: each side's bases as the
    device sees them): where its ids go up in one chunk, its launches built once, each
    call's ids written (and uploaded where they are many) and read by them there; with
    more than one chunk of ids, _launch_as_rows again with each chunk's launches built
    once."""
    chunks = policy.id_chunks(blocks.num_pairs)
    built = tuple(_block_launches(blocks, sides, kernel, target, views, (0, 0), count) for count in chunks)
    if len(chunks) > 1:

        def launch_again(plan: BlockPlan, target: Target, views: tuple) -> None:
            _launch_as_rows(plan, sides, kernel, target, views[0], views[1], built)

        return repeats.BlockRepeat(target, views, launch_again)
    again = repeats.BlockRepeat(target, built, _rows_again)
    if tensors_apart(blocks):  # (no mapping over these tensors can race: from the ids alone)
        geometry = blocks.geometry
        again.direct = _RowsAgain(built[0], geometry.id_limits, target.handle, geometry.num_tensors)
    return again


def _block_launches(
    blocks: BlockPlan,
    sides: tuple[tuple[int, ...], tuple[int, ...]],
    kernel: kernels.CopyKernel,
    target: Target,
    views: tuple[np.ndarray, np.ndarray],
    ids: tuple[int, int],
    count: int,
) -> rows.RowsLaunches:
    """The layout kernel's launches of ``count`` pairs of a swap_blocks plan, each side's
    ids read at ``ids`` (a block a row, a tensor a plane)."""
    return rows.RowsLaunches(
        kernel.function_rows,
        (ids[0], *sides[0]),
        (ids[1], *sides[1]),
        *views,
        count,
        1,
        blocks.geometry.block_bytes,
        target.rows_ctas(),
        config.threads_per_cta,
        target.handle,
    )


def _rows_again(plan: BlockPlan, target: Target, views: tuple) -> None:
    """A plan's ids, one chunk, read by the first call's launches (``views``: them,
    rows.RowsLaunches), as _launch_as_rows would issue it (_ids_launched)."""
    _ids_launched(plan.mapping, views[0], target.handle, plan.geometry.num_tensors)


def _ids_launched(mapping: np.ndarray, launches: rows.RowsLaunches, handle: int, readers: int) -> None:
    """One chunk of ids (``mapping``, checked) written to a ring slot, uploaded unless
    the layout kernel reads them in place, each id by ``readers`` of its units (a
    tensor each: policy.indices_in_place), and read there by ``launches``; the slot
    fenced behind them."""
    n = mapping.shape[0]
    with ring.ring_for_current_context().reserve(16 * n) as slot:
        try:
            nbytes = plan_arrays.split_block_ids(mapping, slot.host, 0, n)
            if policy.indices_in_place(16 * n, readers):
                launches.launch_indexed(slot.mapped, slot.mapped + 8 * n)
            else:
                launch.upload(slot.device, slot.host, nbytes, handle)
                launches.launch_indexed(slot.device, slot.device + 8 * n)
        finally:
            ring.DescriptorRing.fence(slot, handle)


class _RowsAgain:
    """A swap_blocks call of one chunk of ids by the layout kernel between tensors that
    cannot race, issued again from its ids alone (BlockRepeat.direct): the ids checked
    as planning checks them (each side's range, no destination twice), then written
    and launched by the first call's launches (_ids_launched), with no plan made.
    False, nothing issued, where the ids fail (planning names them)."""

    __slots__ = ("launches", "limits", "handle", "readers")

    def __init__(
        self, launches: rows.RowsLaunches, limits: tuple[int, int], handle: int, readers: int
    ) -> None:
        self.launches, self.limits, self.handle, self.readers = launches, limits, handle, readers

    def __call__(self, mapping: np.ndarray) -> bool:
        mapping = np.ascontiguousarray(mapping)  # (as planning reads it)
        if not plan_arrays.block_ids_ok(mapping, *self.limits):
            return False
        _ids_launched(mapping, self.launches, self.handle, self.readers)
        return True


def _dma_again(plan: BlockPlan, target: Target, views: tuple) -> None:
    """A swap_blocks plan to the copy engines, as target says (BlockRepeat's launch;
    ``views``: the first call's tensor table, BlockPlan.tensor_table of its bases)."""
    issue_dma(
        *plan_arrays.block_copies(plan.mapping, views[0], plan.geometry.block_bytes), True, target, False
    )


def _one_copy_again(plan: BlockPlan, target: Target, table: np.ndarray) -> dma.BlockCopyAgain | None:
    """A plan of one block copy that the copy engines took as given (issue_dma: memory the
    device reaches, nothing to merge or check), between tensors that cannot race, as
    issued again from each call's ids in one compiled call (BlockRepeat.direct); else
    None."""
    if plan.num_copies != 1 or not target.request.device_accessible or not tensors_apart(plan):
        return None
    batch = target.decision.method == "batch"
    if batch and target.handle in (0, STREAM_LEGACY):
        return None
    return dma.BlockCopyAgain(
        table, plan.geometry.block_bytes, *plan.geometry.id_limits, target.handle, batch, False
    )


def execute_blocks(
    blocks: BlockPlan, stream_handle: int, method: str = "auto", wait_for_producers: bool = True
) -> str:
    """Issue a swap_blocks plan: memory is classified per tensor, not per block, and
    the kernel computes block addresses itself from the ids: the layout kernel where
    each side's tensors share one stride (the usual caches), else the block kernel
    from a table of the tensors. The copy engines, and the kernel under capture, take
    the plan's copies as pointers, by the method decided here. The streams
    array-interface producers declared are waited for first, unless the caller
    already did (``wait_for_producers=False``). A layout-kernel call over torch tensors
    whose reads are kept is remembered (kvcopy._engine.repeats.BlockRepeat): the next
    call of as many pairs on the same stream, with the same method and settings,
    launches the same way without classifying memory or asking the policy."""
    if blocks.num_pairs == 0:
        return "none"
    handle = effective_handle(stream_handle)
    # (a call over torch tensors whose reads are kept may repeat the last one like it)
    store, key = blocks.memory, None
    if store is not None and not blocks.geometry.producer_streams:
        key = (handle, method, blocks.num_pairs, *repeats.epoch_key())
        again = repeats.block_repeat(store, key)
        ran = again(blocks) if again is not None else None
        if ran is not None:
            return ran
    with ContextScope(handle) as scope:
        geometry = blocks.geometry
        found, src_view, dst_view = kept_or_classified(
            scope,
            lambda: geometry.key,
            blocks.owners,
            (geometry.src_base, geometry.dst_base),
            lambda src_view, dst_view: classify_tensors(blocks, src_view, dst_view),
            method,
            # (the geometry's store lives exactly as long as the tensors are unchanged)
            lambda: blocks.memory is None,
            blocks.memory,
        )
        target = decide(handle, method, blocks.num_copies, blocks.total_bytes, found, note_traffic=True)
        # (a graph cannot wait for work outside it)
        if wait_for_producers and not target.request.capturing:
            wait_for_streams(handle, blocks.geometry.producer_streams)
        if target.decision.method != "kernel":
            # the copy engines take pointers: the plan's copies, one each
            arrays = blocks.copy_arrays()
            with guard.timed(target):
                issue_dma(*arrays, True, target, False)
            if key is not None and repeats.decided_for_repeats(target, method):
                table = blocks.tensor_table(blocks.geometry.src_base, blocks.geometry.dst_base)
                again = repeats.BlockRepeat(target, (table,), _dma_again)
                again.direct = _one_copy_again(blocks, target, table)
                repeats.remember_blocks(store, key, again)
            return target.decision.method
        if target.request.capturing:
            # a graph keeps descriptors passed by value, not a ring slot: the plan's
            # copies are described into scratch and launched as such
            src, dst, sizes = blocks.copy_arrays()
            with HostScratch(len(sizes) * describe.DESCRIPTOR_BYTES) as scratch:
                batch = describe.describe_copies(src, dst, sizes, scratch.host, True)
                launch_kernel(batch, target, scratch, None)
            return "kernel"
        kernel = kernels.kernel_for_current_context(*target.info.cc, target.info.driver_version)
        sides = blocks.layout_sides()
        if sides is not None:
            with guard.timed(target):
                _launch_as_rows(blocks, sides, kernel, target, src_view, dst_view)
            if key is not None and repeats.decided_for_repeats(target, method):
                repeats.remember_blocks(
                    store, key, _rows_repeat(blocks, sides, kernel, target, (src_view, dst_view))
                )
            return "kernel"
        table = blocks.tensor_table(src_view, dst_view)
        nbytes = launch.blocks_upload_bytes(table.shape[0], blocks.num_pairs)
        with ring.ring_for_current_context().reserve(nbytes) as slot, guard.timed(target):
            launch.launch_blocks_uploaded(
                kernel.function_blocks,
                slot.host,
                slot.device,
                table,
                blocks.mapping,
                blocks.geometry.block_bytes,
                target.ctas(None),
                config.threads_per_cta,
                handle,
            )
            ring.DescriptorRing.fence(slot, handle)
        return "kernel"
