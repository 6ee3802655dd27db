"""Runs a batch: picks the context, classifies memory, asks the policy (its answers
remembered per question), and issues the batch by the chosen method."""
from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Iterable, NamedTuple

import numpy as np

from kvcopy import policy
from kvcopy._engine import replay, staged, traffic_window
from kvcopy._runtime import device, kernels, peers, ring
from kvcopy._cuda import classify, describe, dma, driver, launch
from kvcopy.blocks import BlockPlan
from kvcopy.arguments import require_same_length
from kvcopy.config import config
from kvcopy._runtime.context import ContextScope
from kvcopy._engine.descriptor_tables import number_tiles_per_slice
from kvcopy.errors import CudaError, NoDriverError
from kvcopy.interop.streams import effective_handle, stream_kind
from kvcopy.plan import CopyPlan, plan_copies
from kvcopy.policy import CopyRequest, Decision, choose_method

log = logging.getLogger("kvcopy")
_HOST = classify.KIND_HOST_MAPPED | classify.KIND_HOST_UNMAPPED
_PEER = classify.KIND_PEER | classify.KIND_PEER_UNMAPPED
_DEVICE = classify.KIND_DEVICE | classify.KIND_MANAGED | _PEER
_DMA_ONLY = (classify.KIND_HOST_UNMAPPED | classify.KIND_MANAGED | classify.KIND_STRADDLE
             | classify.KIND_PEER_UNMAPPED)
_last = threading.local()


def last_decision() -> Decision | None:
    """The method the calling thread's last copy used, and why."""
    return getattr(_last, "decision", None)


def note_decision(decision: Decision) -> None:
    """Record ``decision`` as the calling thread's last (for a path decided outside
    decide(), such as copy_both_ways' joint one)."""
    _last.decision = decision


def run_staged(handle: int, batches: list[staged.StagedBatch], info: device.DeviceInfo) -> str:
    """Issue planned staged batches (kvcopy._engine.staged) on ``handle`` and record their
    decision as the calling thread's last; returns "staged"."""
    staged.run(handle, batches, info.cc, info.driver_version)
    note_decision(batches[0].decision)
    return "staged"


def memory_owner(src_device: int, dst_device: int) -> int:
    """The one device that owns a batch's device memory; -1 for none, -2 for several.

    Arguments are classify_pointers' ordinals (-1: no device memory, -2: several).
    """
    owners = {o for o in (src_device, dst_device) if o != -1}
    if not owners:
        return -1
    return owners.pop() if len(owners) == 1 else -2


def _direction(src_kinds: int, dst_kinds: int) -> str:
    src = "h" if not src_kinds & _DEVICE else "d" if not src_kinds & _HOST else "m"
    dst = "h" if not dst_kinds & _DEVICE else "d" if not dst_kinds & _HOST else "m"
    if "m" in (src, dst):
        return "mixed"
    if src == dst == "d" and (src_kinds | dst_kinds) & _PEER:
        return "p2p"
    return f"{src}2{dst}"


class MemoryClasses(NamedTuple):
    """What classify_pointers found on each side of a batch."""

    src_kinds: int
    src_device: int
    dst_kinds: int
    dst_device: int

    @property
    def owner(self) -> int:
        return memory_owner(self.src_device, self.dst_device)

    @property
    def kinds(self) -> int:
        return self.src_kinds | self.dst_kinds


def reach_peers(found: MemoryClasses, method: str) -> bool:
    """Enable peer access for a batch with another GPU's memory that the kernel could
    reach once it is enabled (config.enable_peer_access). True: memory must be
    classified again."""
    if not found.kinds & classify.KIND_PEER_UNMAPPED or method not in ("auto", "kernel"):
        return False
    here = driver.context_device()
    return peers.enable_for(here, peers.peers_of((found.src_device, found.dst_device), here))


def unreachable(found: MemoryClasses, here: int) -> str:
    """What, in a batch, the device ``here`` cannot dereference (for error messages)."""
    kinds = found.kinds
    if kinds & classify.KIND_PEER_UNMAPPED:
        return peers.why_unreachable(here, peers.peers_of((found.src_device, found.dst_device),
                                                          here))
    if kinds & classify.KIND_MANAGED:
        return "managed memory"
    if kinds & classify.KIND_HOST_UNMAPPED:
        return "pageable or unmapped host memory"
    if kinds & classify.KIND_STRADDLE:
        return "a copy that runs past the end of its allocation"
    return ""


@dataclass(frozen=True)
class Target:
    """Where and how a batch runs, once its memory is classified and the policy asked
    (shared by every call that asks the same question: never changed)."""

    handle: int
    info: "device.DeviceInfo"
    request: CopyRequest
    decision: Decision
    host_ctas: int = policy.HOST_CTAS["h2d"]        # the device's, for this direction
    both_ways_ctas: int = policy.BOTH_WAYS_CTAS["h2d"]   # the same, beside the other way
    # the same decision whichever way the other direction's traffic was answered
    # (kvcopy._engine.replay replays only such batches' launches); None: not asked,
    # as for batches too large ever to be recorded
    traffic_free: bool | None = True

    def launch_shape(self, max_ctas: int | None) -> tuple[int, int]:
        """CTAs and threads per CTA of a scatter launch by the decided copier."""
        if self.decision.variant == "bulk":
            return (max_ctas or config.bulk_ctas or policy.BULK_STORE_CTAS,
                    launch.BULK_THREADS)
        return self.ctas(max_ctas), config.threads_per_cta

    def ctas(self, max_ctas: int | None, both_ways: bool = False) -> int:
        if max_ctas:
            return max_ctas
        if self.request.direction == "d2d":
            return config.device_ctas or policy.device_ctas(self.info.caps)
        if self.request.direction == "p2p":
            return config.peer_ctas or policy.peer_ctas(self.info.caps)
        if both_ways:
            return self.both_ways_ctas
        return config.host_ctas or self.host_ctas


_targets: dict[tuple, Target] = {}
_TARGETS_KEPT = 256


def decide(handle: int, method: str, count: int, total_bytes: int, found: MemoryClasses,
           capturing: bool | None = None, allow_batch: bool = True,
           note_traffic: bool = False) -> Target:
    """Ask the policy for a method, given the classified memory of a batch
    (``capturing``: the stream's capture state, asked of the driver when None).
    With ``note_traffic`` (copy_batch's one-sided calls) and
    config.traffic_window_ms set (the default), the batch's direction, stream and
    bytes are noted in kvcopy._engine.traffic_window, and whether the other direction copied a
    comparable batch lately on another stream is part of the question (outside
    capture).

    The policy is a pure function of what is in the key below, and engines
    repeat the same batch shapes step after step, so its answers are
    remembered (per device.generation: a calibration or a capability change
    starts afresh)."""
    ordinal = driver.context_device()
    if capturing is None:
        capturing = driver.stream_capture_status(handle) != 0
    recent, direction = False, None
    if note_traffic and config.traffic_window_ms and not capturing:
        direction = _direction(found.src_kinds, found.dst_kinds)
        # (only 'auto' asks: an explicit method's answer does not depend on it)
        recent = method == "auto" and traffic_window.other_way_recent(
            ordinal, direction, config.traffic_window_ms / 1000, handle, total_bytes)
        traffic_window.note(ordinal, direction, handle, total_bytes)
    key = (ordinal, device.generation, handle, method, found, count, total_bytes, capturing,
           allow_batch, config.stores_by_dma, config.bulk_stores, recent)
    target = _targets.get(key)
    if target is None:
        target = ask_policy(ordinal, handle, method, count, total_bytes, found, capturing,
                            allow_batch, recent, direction)
        # (traffic was part of the question; asked again only where a replay could follow)
        if method == "auto" and direction is not None:
            if count > replay.MAX_COPIES:
                target = dataclasses.replace(target, traffic_free=None)
            else:
                other = ask_policy(ordinal, handle, method, count, total_bytes, found, capturing,
                                   allow_batch, not recent, direction)
                if (other.decision != target.decision
                        or other.launch_shape(None) != target.launch_shape(None)):
                    target = dataclasses.replace(target, traffic_free=False)
        if len(_targets) >= _TARGETS_KEPT:
            _targets.clear()
        _targets[key] = target
    _last.decision = target.decision
    log.debug("kvcopy: %d copies, %d bytes, %s -> %s (%s)", count, total_bytes,
              target.request.direction, target.decision.method, target.decision.reason)
    return target


def ask_policy(ordinal: int, handle: int, method: str, count: int, total_bytes: int,
               found: MemoryClasses, capturing: bool, allow_batch: bool,
               other_way_recent: bool = False, direction: str | None = None) -> Target:
    """The policy's answer for a classified batch (``direction``: where the caller
    already derived it from ``found``)."""
    info = device.device_info(ordinal)
    # classify's kinds are relative to this context's device: another device's memory
    # is KIND_PEER only where this device may access it
    accessible = not found.kinds & _DMA_ONLY
    if direction is None:
        direction = _direction(found.src_kinds, found.dst_kinds)
    request = CopyRequest(direction=direction, count=count,
                          total_bytes=total_bytes, device_accessible=accessible,
                          stream_kind=stream_kind(handle), capturing=capturing,
                          batch_allowed=allow_batch,
                          devices=(found.src_device, found.dst_device),
                          unreachable="" if accessible else unreachable(found, ordinal),
                          stores_by_dma=config.stores_by_dma, bulk_stores=config.bulk_stores,
                          other_way_recent=other_way_recent)
    thresholds = device.thresholds(ordinal)
    decision = choose_method(request, info.caps, thresholds, method)
    return Target(handle, info, request, decision, thresholds.ctas_for(request.direction),
                  thresholds.ctas_for(request.direction, both_ways=True))


def launch_kernel(count: int, tiles: int, target: Target, slot: "ring.Slot | _HostScratch",
                  max_ctas: int | None, pair_size: int = 0) -> tuple[int, int, int, int] | None:
    """Launch the copy kernel over the ``count`` descriptors described into ``slot``
    (kvcopy_pair entries of copies of ``pair_size`` bytes each, where not 0).

    Large batches: one launch. Where every copy is one tile, the kernel reads
    the descriptors where they were written (pinned, mapped): each warp
    fetches its next 32 while it copies, so the fetch hides behind the copies
    instead of an upload running before the kernel. Multi-tile batches and copies between GPUs
    have their descriptors uploaded to the slot's device buffer first. Small batches and
    capture: descriptors by value, which graphs keep with the launch (and
    which leave the slot free at once); for those, returns what they were
    launched with: (function, descriptors per launch, CTAs, threads)."""
    info, handle = target.info, target.handle
    kernel = kernels.kernel_for_current_context(*info.cc, info.driver_version)
    functions = kernel.scatter(target.decision.variant)
    ctas, threads = target.launch_shape(max_ctas)
    # pairs come only from batches past one launch's inline descriptors (describe_compact)
    if pair_size or (count > kernel.per_launch and not target.request.capturing):
        assert isinstance(slot, ring.Slot)   # only capture and small batches use scratch memory
        in_place = policy.descriptors_in_place(tiles, count, (target.request.direction,))
        table, upload = (slot.mapped, 0) if in_place else (slot.device, slot.host)
        entry = describe.PAIR_BYTES if pair_size else describe.DESCRIPTOR_BYTES
        step = policy.copies_per_launch(target.request.direction, count,
                                        target.request.total_bytes, config.launch_bytes)
        if step >= count:
            slice_tiles = [tiles]
        elif pair_size:   # pairs have no tile_start: any slice is a batch
            slice_tiles = [min(step, count - start) for start in range(0, count, step)]
        else:
            slice_tiles = number_tiles_per_slice(slot.host, count, tiles,
                                                 np.arange(0, count, step))
        if upload and len(slice_tiles) > 1:
            # one upload ahead of all the launches: one per launch sat between each
            # two on the stream, a copy engine's round trip each
            launch.upload(table, upload, count * entry, handle)
            upload = 0
        for k, start in enumerate(range(0, count, step)):
            n, offset = min(step, count - start), start * entry
            # (an upload left here is a single launch's, at offset 0)
            if pair_size:
                launch.launch_pairs(functions.pairs, table + offset, n, pair_size, ctas,
                                    threads, handle, upload)
            else:
                launch.launch_descs(functions.staged, table + offset, n, slice_tiles[k], ctas,
                                    threads, handle, upload)
        ring.DescriptorRing.fence(slot, handle)
        return None
    # the smaller variants' parameters (1 or 4 KiB) cost the driver less to copy per launch
    if count <= launch.INLINE_MAX_TINY:
        function, per_launch = functions.tiny, launch.INLINE_MAX_TINY
    elif count <= launch.INLINE_MAX_SMALL or kernel.per_launch != launch.INLINE_MAX:
        function, per_launch = functions.small, launch.INLINE_MAX_SMALL
    else:
        function, per_launch = functions.inline, kernel.per_launch
    launch.launch_descs_inline(function, per_launch, slot.host, count, ctas, threads, handle)
    return function, per_launch, ctas, threads


def issue_dma(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, merge: bool, target: Target,
              access_any: bool) -> None:
    """Plan the batch for the DMA engines (merged only inside allocations, pageable
    pointers checked against this process's mappings) and issue it."""
    plan = CopyPlan(*dma.plan_dma(src, dst, sizes, merge))
    try:
        if target.decision.method == "batch":
            dma.memcpy_batch(plan.dst, plan.src, plan.sizes, target.handle, access_any,
                             config.batch_chunk)
        else:
            dma.memcpy_loop(plan.dst, plan.src, plan.sizes, target.handle)
    except CudaError as exc:
        message = exc.message
        if target.request.unreachable and target.request.direction == "p2p":
            # the driver refuses copies with another GPU's memory not mapped for this one
            message += (f"; the batch has {target.request.unreachable}, which the driver's copy "
                        "engines refuse as well")
        raise type(exc)(exc.code, exc.name, message, plan.caller_index(exc.index)) from None


class _HostScratch:
    """Where descriptors passed by value are described: plain host memory of the
    calling thread. Used under capture (the graph keeps the descriptors with its
    launch nodes, and the descriptor ring, whose events must not be queried
    during a capture, is left alone) and for small batches, whose one launch
    takes its descriptors by value anyway: nothing has to outlive the call."""

    _local = threading.local()

    def __init__(self, nbytes: int) -> None:
        local = self._local
        if getattr(local, "nbytes", 0) < nbytes:
            local.buffer = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
            # the address, kept: asking NumPy for it (.ctypes) costs microseconds per call
            local.nbytes, local.host = local.buffer.nbytes, local.buffer.ctypes.data
        self.host: int = local.host

    def __enter__(self) -> "_HostScratch":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def execute_copies(scope: ContextScope, handle: int, src: np.ndarray, dst: np.ndarray,
                   sizes: np.ndarray, method: str, merge: bool, access_any: bool,
                   max_ctas: int | None, allow_batch: bool = True) -> str:
    """Validate, classify, decide and issue a batch in the scope's context.

    One pass (describe_copies) plans the batch, classifies its memory and
    writes the kernel's descriptors straight into a pinned descriptor slot (or,
    for batches of one launch by value, into thread-local scratch), so the
    kernel path touches each copy once. Large batches of one block size in one
    allocation per side get 16-byte entries instead of 32-byte ones
    (describe_compact): the pass is bound by its writes to pinned memory. The DMA paths, which cost far
    more per copy anyway, plan the batch again for the DMA engines.
    While the stream captures a graph, nothing here queries or waits on an
    event or a stream, and nothing is allocated on the device.
    """
    capturing = driver.stream_capture_status(handle) != 0
    nbytes = len(sizes) * describe.DESCRIPTOR_BYTES
    # batches too large to pass by value are described in half the bytes where they can be
    compact = not capturing and len(sizes) > launch.INLINE_MAX
    target, staging = None, None
    while target is None:
        space = (_HostScratch(nbytes) if capturing or len(sizes) <= launch.INLINE_MAX_SMALL
                 else ring.ring_for_current_context().reserve(nbytes))
        with space as slot:
            if compact:
                count, total_bytes, *kinds, tiles, pair_size = describe.describe_compact(
                    src, dst, sizes, slot.host, merge)
            else:
                count, total_bytes, *kinds, tiles = describe.describe_copies(src, dst, sizes,
                                                                             slot.host, merge)
                pair_size = 0
            if count == 0:
                return "none"
            found = MemoryClasses(*kinds)
            if scope.on_default_stream and scope.follow_memory(found.owner):
                continue  # switched device: host memory may be mapped elsewhere there
            if reach_peers(found, method):
                continue  # peer access enabled: another GPU's memory is now reachable
            target = decide(handle, method, count, total_bytes, found, capturing, allow_batch,
                            note_traffic=True)
            if target.decision.method == "kernel":
                if max_ctas is None:   # (a caller's CTA limit asks for the kernel itself)
                    staging = staged.plan_batch(target.request, target.decision, src, dst,
                                                sizes, method,
                                                device.thresholds(target.info.ordinal))
                if staging is None:
                    launched = launch_kernel(count, tiles, target, slot, max_ctas, pair_size)
                    if launched and merge and max_ctas is None and allow_batch:
                        # (copy_batch's next call like this one launches in repeat)
                        replay.record(target, found, method, count, total_bytes, launched)
                    return "kernel"
    if staging is not None:   # (its descriptors go to a slot of their own)
        return run_staged(handle, [staging], target.info)
    issue_dma(src, dst, sizes, merge, target, access_any)
    return target.decision.method


def execute(plan: CopyPlan, stream_handle: int, method: str = "auto",
            access_any: bool = False, max_ctas: int | None = None) -> str:
    """Issue a planned batch on the stream (a raw handle; 0 means the default stream)."""
    if plan.count == 0:
        return "none"
    handle = effective_handle(stream_handle)
    with ContextScope(handle) as scope:
        return execute_copies(scope, handle, plan.src, plan.dst, plan.sizes, method, False,
                              access_any, max_ctas)


def execute_arrays(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream_handle: int,
                   method: str = "auto", access_any: bool = False,
                   max_ctas: int | None = None, allow_batch: bool = True) -> str:
    """Validate and issue three uint64 arrays (copy_batch's path: no CopyPlan is built
    unless a DMA method runs). Raises ValueError for a bad copy before issuing any."""
    require_same_length(src, dst, sizes)
    if len(sizes) == 0:
        return "none"
    handle = effective_handle(stream_handle)
    if max_ctas is None and allow_batch:
        decision = replay.launch_again(src, dst, sizes, handle, method)
        if decision is not None:
            _last.decision = decision
            return "kernel"
    try:
        with ContextScope(handle) as scope:
            return execute_copies(scope, handle, src, dst, sizes, method, True, access_any,
                                  max_ctas, allow_batch)
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


def classify_tensors(blocks: BlockPlan, src_view: np.ndarray,
                     dst_view: np.ndarray) -> MemoryClasses:
    """Classify a swap_blocks plan's memory per tensor, writing each tensor's base as
    the device sees it into ``src_view`` and ``dst_view``."""
    g = blocks.geometry
    return MemoryClasses(*classify.classify_pointers(g.src_base, g.src_extent, src_view),
                         *classify.classify_pointers(g.dst_base, g.dst_extent, dst_view))


def wait_for_streams(handle: int, streams: Iterable[int]) -> None:
    """Make the stream ``handle`` wait (on the GPU) for the work queued so far on each of
    ``streams``, once each: the streams array-interface producers declared."""
    for stream in dict.fromkeys(streams):
        driver.stream_wait_stream(handle, stream)


def execute_blocks(blocks: BlockPlan, stream_handle: int, method: str = "auto",
                   wait_for_producers: bool = True) -> str:
    """Issue a swap_blocks plan: memory is classified per tensor, not per block, and
    the kernel computes block addresses itself from the tensor table and the ids.
    Other paths (DMA, kernel under capture) run the pointer-level plan. The
    streams array-interface producers declared are waited for first, unless the
    caller already did (``wait_for_producers=False``)."""
    if blocks.num_pairs == 0:
        return "none"
    handle = effective_handle(stream_handle)
    with ContextScope(handle) as scope:
        src_view = np.empty_like(blocks.geometry.src_base)
        dst_view = np.empty_like(blocks.geometry.dst_base)
        found = classify_tensors(blocks, src_view, dst_view)
        if scope.follow_memory(found.owner):
            found = classify_tensors(blocks, src_view, dst_view)
        if reach_peers(found, method):
            found = classify_tensors(blocks, src_view, dst_view)
        target = decide(handle, method, blocks.num_copies, blocks.total_bytes, found,
                        note_traffic=True)
        # (a graph cannot wait for work outside it)
        if wait_for_producers and not target.request.capturing:
            wait_for_streams(handle, blocks.geometry.producer_streams)
        if target.decision.method != "kernel" or target.request.capturing:
            # the per-copy path checks and classifies every copy again (per tensor is
            # coarser) and asks the policy again, for the method decided here only
            src, dst, sizes = blocks.copy_arrays()
            return execute_copies(scope, handle, src, dst, sizes, target.decision.method,
                                  True, False, None)
        kernel = kernels.kernel_for_current_context(*target.info.cc, target.info.driver_version)
        table = blocks.tensor_table(src_view, dst_view)
        nbytes = launch.blocks_staging_bytes(table.shape[0], blocks.num_pairs)
        with ring.ring_for_current_context().reserve(nbytes) as slot:
            launch.launch_blocks_staged(kernel.function_blocks, slot.host, slot.device, table,
                                        blocks.mapping, blocks.geometry.block_bytes,
                                        target.ctas(None), config.threads_per_cta, handle)
            ring.DescriptorRing.fence(slot, handle)
        return "kernel"
