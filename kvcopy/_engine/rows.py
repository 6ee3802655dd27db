"""Issues a copy_rows plan (kvcopy._plans.rows): the layout kernel where the policy
gives the batch to the kernel or its indices are on the GPU, else the plan's rows as
pointer copies by the path the policy picks (the copy engines, or the pointer path
under capture, whose descriptors a graph keeps by value).

The kernel takes the whole job by value (kvcopy._cuda.rows): each launch is safe to
capture, and GPU-resident indices are read in place when it runs, so a captured
transfer replayed after the index tensor is updated moves the new indices' rows.
Host indices go to the GPU first, through a descriptor ring slot (uploaded on the
stream, fenced behind the launch).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from kvcopy._cuda import classify, driver, launch, plan_arrays, rows
from kvcopy._cuda.rows_repeat import GpuRowsRepeat
from kvcopy._cuda.plan_arrays import row_slots_ok
from kvcopy._engine.repeats import decided_for_repeats, issue_repeat, note_again, noted_traffic
from kvcopy._engine.decide import (
    MemoryClasses,
    Target,
    classify_sides,
    decide,
    memory_owner,
    note_decision,
)
from kvcopy._engine.dispatch import execute_copies, issue_dma, kept_or_classified
from kvcopy._plans.rows import Indices, RowsPlan, expand, layouts_apart
from kvcopy._runtime import kept_memory, kernels, ring
from kvcopy._runtime.kernels import KernelUnavailable
from kvcopy._runtime.context import ContextScope
from kvcopy.config import config
from kvcopy.errors import IndexOutOfRange
from kvcopy.interop.streams import effective_handle
from kvcopy import policy
from kvcopy.policy import Decision


def _classify(plan: RowsPlan, src_view: np.ndarray, dst_view: np.ndarray) -> MemoryClasses:
    """Each plane's memory, its base as the device sees it written to the views."""
    return classify_sides(
        plan.src.bases,
        np.full(plan.src.num_planes, plan.src.extent, np.uint64),
        plan.dst.bases,
        np.full(plan.dst.num_planes, plan.dst.extent, np.uint64),
        src_view,
        dst_view,
    )


def _launches(
    plan: RowsPlan,
    target: Target,
    src_view: np.ndarray,
    dst_view: np.ndarray,
    src_indices: int,
    dst_indices: int,
    context: int = 0,
) -> rows.RowsLaunches:
    kernel = kernels.kernel_for_current_context(*target.info.cc, target.info.driver_version)
    return rows.RowsLaunches(
        kernel.function_rows,
        plan.side(plan.src, src_indices),
        plan.side(plan.dst, dst_indices),
        src_view,
        dst_view,
        plan.rows,
        plan.pieces,
        plan.piece_bytes,
        target.rows_ctas(),
        config.threads_per_cta,
        target.handle,
        context,
    )


def _launch(
    plan: RowsPlan,
    target: Target,
    src_view: np.ndarray,
    dst_view: np.ndarray,
    src_indices: int,
    dst_indices: int,
) -> None:
    _launches(plan, target, src_view, dst_view, src_indices, dst_indices).launch()


def host_indices_bytes(sides: Sequence[tuple[Indices | None, int]]) -> int:
    """The ring-slot bytes indices_for_device() copies for ``sides`` ((indices, rows) each)."""
    return sum(8 * rows for indices, rows in sides if indices is not None and indices.host is not None)


def indices_for_device(
    slot: ring.Slot, sides: Sequence[tuple[Indices | None, int]], in_place: bool = False
) -> tuple[list[int], int]:
    """Each side's indices as the device reads them (0: none): GPU indices in place, host
    values copied into the pinned ``slot`` and read at ``slot.device`` (or, ``in_place``,
    where the device sees the slot itself, ``slot.mapped``); and the bytes copied, which
    the caller uploads on its stream before the launches that read them (unless read in
    place) and fences the slot behind."""
    where, offset = [], 0
    base = slot.mapped if in_place else slot.device
    for indices, count in sides:
        if indices is not None and indices.host is not None:
            plan_arrays.write_indices(slot.host + offset, indices.host)
            where.append(base + offset)
            offset += 8 * count
        else:
            where.append(indices.device if indices is not None else 0)
    return where, offset


class ring_indices:  # noqa: N801 - (used as a function: ``with ring_indices(...)``)
    """Each side's indices as the device reads them (indices_for_device), host values
    copied into a ring slot of their own: read there by the layout kernel, each by
    ``readers`` of its units, where the policy says (policy.indices_in_place: never
    with 0 readers), else uploaded on ``handle``; the work the block queues on
    ``handle`` reads them. The slot is fenced on
    ``handle`` when the block ends, raised or not: the upload or the launches reading it
    are queued either way. (A class: a generator's context manager costs a microsecond
    a call, and repeated calls use it.)"""

    __slots__ = ("sides", "handle", "readers", "reserved", "slot")

    def __init__(self, sides: Sequence[tuple[Indices | None, int]], handle: int, readers: int = 0) -> None:
        self.sides, self.handle, self.readers = sides, handle, readers

    def __enter__(self) -> list[int]:
        nbytes = host_indices_bytes(self.sides)
        in_place = policy.indices_in_place(nbytes, self.readers)
        self.reserved = ring.ring_for_current_context().reserve(nbytes)
        slot = self.slot = self.reserved.__enter__()
        try:
            where, nbytes = indices_for_device(slot, self.sides, in_place)
            if not in_place:
                launch.upload(slot.device, slot.host, nbytes, self.handle)
        except BaseException as exc:
            self.reserved.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return where

    def __exit__(self, *exc: Any) -> None:
        try:
            ring.DescriptorRing.fence(self.slot, self.handle)
        finally:
            self.reserved.__exit__(*exc)


def _readers(plan: RowsPlan) -> int:
    """How many of the layout kernel's units read each of a plan's indices: a row's
    pieces in every plane."""
    return plan.pieces * plan.src.num_planes


def _launch_uploading(plan: RowsPlan, target: Target, src_view: np.ndarray, dst_view: np.ndarray) -> None:
    """Host indices copied into a ring slot (uploaded on the stream unless read in
    place: ring_indices), then the launch."""
    sides = ((plan.src_indices, plan.rows), (plan.dst_indices, plan.rows))
    with ring_indices(sides, target.handle, _readers(plan)) as where:
        _launch(plan, target, src_view, dst_view, *where)


_UNREACHABLE = (
    classify.KIND_HOST_UNMAPPED | classify.KIND_MANAGED | classify.KIND_PEER_UNMAPPED | classify.KIND_STRADDLE
)


def settle(
    scope: ContextScope, plan: RowsPlan, handle: int, method: str, prepared: bool = False
) -> tuple[Target, np.ndarray, np.ndarray, bool]:
    """The plan's memory classified (the scope following it to its device, peer access
    enabled where the layout kernel will run), the policy's answer, and the planes'
    bases as the device sees them. ``prepared``: built for kvcopy.PreparedRows, whose
    calls are not noted as traffic."""
    kernel_only = prepared or plan.device_indices
    asked = "kernel" if kernel_only else method
    src, dst = plan.src, plan.dst
    # (a pair of held layouts keeps its memory's classes with the pair, found at once;
    # layouts made again over the same tensors find them by the tensors)
    found, src_view, dst_view = kept_or_classified(
        scope,
        lambda: ("rows", src.bases.tobytes(), src.extent, dst.bases.tobytes(), dst.extent, asked),
        (*src.keep, *dst.keep),
        (src.bases, dst.bases),
        lambda src_view, dst_view: _classify(plan, src_view, dst_view),
        asked,
        lambda: kept_memory.holds_planes(src) and kept_memory.holds_planes(dst),
        kept_memory.layout_store(src, dst, asked),
    )
    if found.kinds & _UNREACHABLE:
        if plan.device_indices:
            raise ValueError(
                "indices on the GPU need both layouts in memory the GPU can read "
                "and write (GPU or pinned host memory); pass them on the host "
                "for pageable memory"
            )
        if prepared:
            raise ValueError(
                "prepare_rows: the layout kernel needs both layouts in memory the "
                "GPU can read and write (GPU or pinned host memory); call "
                "copy_rows for pageable memory"
            )
    capturing = driver.stream_capture_status(handle) != 0
    target = decide(
        handle, method, plan.copies, plan.total_bytes, found, capturing, note_traffic=not prepared
    )
    return target, src_view, dst_view, capturing


def _kernel_decision(target: Target, why: str) -> Decision:
    """What ran where only the layout kernel can run the plan."""
    if target.decision.method == "kernel":
        return target.decision
    return Decision("kernel", why, "registers")


class HostRepeat:
    """A copy_rows call by the layout kernel with its indices on the host (or none),
    built: calling it with the next call's indices (read, not yet checked; as many as
    the first call's) checks their values as plan_rows does, copies them into a ring
    slot (uploaded unless read in place: ring_indices) and launches the first call's
    jobs reading them there. Returns
    None, having enqueued nothing, where the call must be planned instead: an index out
    of range or a destination slot twice (planning names it), another context current
    on the stream, or a stream capturing a graph (whose launches keep no ring slot).
    Built only for layouts that share no memory (no row can read what another writes,
    whatever the indices) and a decision that holds whatever the other direction's
    traffic; it holds no layout (the memo keeps layouts weakly)."""

    __slots__ = ("context", "owner", "launches", "slots", "rows", "readers", "handle", "decision", "traffic")

    def __init__(self, plan: RowsPlan, target: Target, src_view: np.ndarray, dst_view: np.ndarray) -> None:
        self.context = driver.current_context_key()
        self.owner = memory_owner(*target.request.devices)
        # the first call's jobs, each side's indices given at every call (launch_indexed)
        self.launches = _launches(plan, target, src_view, dst_view, 0, 0)
        self.slots = (plan.src.slots, plan.dst.slots)
        self.rows, self.readers = plan.rows, _readers(plan)
        self.handle = target.handle
        self.decision, self.traffic = target.decision, noted_traffic(target, plan.total_bytes)

    def usable(self) -> bool:
        """Always: the context is compared at each call (a reset one has another key)."""
        return True

    def __call__(self, src_indices: Indices | None, dst_indices: Indices | None) -> str | None:
        checks = ((src_indices, self.slots[0], False), (dst_indices, self.slots[1], True))
        for indices, slots, unique in checks:
            if indices is not None and (
                indices.host is None or not row_slots_ok(indices.host, slots, unique)
            ):
                return None
        sides = ((src_indices, self.rows), (dst_indices, self.rows))
        issued = issue_repeat(
            self.handle, self.owner, self.context, self.decision, self.traffic, lambda: self._launch(sides)
        )
        return "kernel" if issued else None

    def _launch(self, sides: tuple) -> None:
        """The first call's jobs, reading ``sides``' indices ((indices, rows) each)."""
        if not host_indices_bytes(sides):  # (rows by number on both sides)
            self.launches.launch_indexed(0, 0)
        else:
            with ring_indices(sides, self.handle, self.readers) as where:
                self.launches.launch_indexed(*where)


def _may_repeat(plan: RowsPlan, target: Target, method: str) -> bool:
    """Whether a HostRepeat may issue the plan's next calls: its layouts hold their
    memory (kept_memory.held: what was found of it stays true), share none (no indices
    can make a row read what another writes), and the decision holds whatever the other
    direction's traffic (the policy's only input a repeat does not have) while the
    guard is not timing batches."""
    if not (kept_memory.held(plan.src) and kept_memory.held(plan.dst)):
        return False
    if not layouts_apart(plan.src, plan.dst):
        return False
    return decided_for_repeats(target, method)


def execute_rows(
    plan: RowsPlan,
    stream_handle: int,
    method: str = "auto",
    remember: Callable[["GpuRowsRepeat | HostRepeat"], None] | None = None,
) -> str:
    """Issue ``plan`` on the stream (a raw handle; 0: the default stream); returns the
    method that ran ('kernel', 'batch', 'loop', or 'none' for no rows). Where the layout
    kernel ran the plan (its indices on the GPU; or on the host, the layouts apart and
    the decision one a repeat may keep: HostRepeat), ``remember`` is given what repeats
    the call (kvcopy._engine.rows_memo keeps it)."""
    if plan.rows == 0:
        return "none"
    handle = effective_handle(stream_handle)
    with ContextScope(handle) as scope:
        target, src_view, dst_view, capturing = settle(scope, plan, handle, method)
        if plan.device_indices:
            launches = _launches(
                plan, target, src_view, dst_view, *_device_addresses(plan), context=driver.current_context()
            )
            again = GpuRowsRepeat(
                launches,
                _kernel_decision(target, _GPU_INDICES),
                noted_traffic(target, plan.total_bytes),
                note_decision,
                note_again,
            )
            again()
            if remember is not None:
                remember(again)
            return "kernel"
        if target.decision.method == "kernel" and not capturing:
            try:
                if plan.host_indices:
                    _launch_uploading(plan, target, src_view, dst_view)
                else:
                    _launch(plan, target, src_view, dst_view, 0, 0)
                note_decision(target.decision)
                if remember is not None and _may_repeat(plan, target, method):
                    remember(HostRepeat(plan, target, src_view, dst_view))
                return "kernel"
            except KernelUnavailable:
                pass  # NVRTC missing: the rows go as pointer copies
        src, dst, sizes = expand(plan)
        if target.decision.method == "kernel":
            # under capture: the pointer path passes descriptors by value
            return execute_copies(scope, handle, src, dst, sizes, method, False, False, None)
        issue_dma(src, dst, sizes, True, target, False)
        note_decision(target.decision)
        return target.decision.method


def prepare_launches(plan: RowsPlan, stream_handle: int) -> tuple[rows.RowsLaunches | None, Decision]:
    """The layout kernel's launches for ``plan`` on the stream (None for no rows), built
    once for kvcopy.PreparedRows: its memory classified and its CTAs decided now, its
    indices (on the GPU, or none) read by every launch when it runs. Host indices are
    refused: they would have to be checked and uploaded at each call."""
    if plan.host_indices:
        raise ValueError(
            "prepare_rows: indices on the host are checked and uploaded at each "
            "copy; pass them on the GPU (read when each copy runs), or call "
            "copy_rows"
        )
    if plan.rows == 0:
        return None, Decision("kernel", "no rows: nothing to launch")
    handle = effective_handle(stream_handle)
    with ContextScope(handle) as scope:
        target, src_view, dst_view, _ = settle(scope, plan, handle, "auto", prepared=True)
        launches = _launches(
            plan, target, src_view, dst_view, *_device_addresses(plan), context=driver.current_context()
        )
        return launches, _kernel_decision(target, _PREPARED)


_GPU_INDICES = "indices on the GPU: only the layout kernel reads them"
_PREPARED = "a prepared transfer: the layout kernel, launched as built"


def _device_addresses(plan: RowsPlan) -> tuple[int, int]:
    return tuple(
        i.device if i is not None else 0  # type: ignore[return-value]
        for i in (plan.src_indices, plan.dst_indices)
    )


def check_indices(stream_handle: int | None) -> None:
    """Wait for the stream (None: all work in the context), then raise IndexOutOfRange
    where the layout kernel skipped rows for an out-of-range GPU-resident index in this
    context since the last check, and clear the count."""
    handle = effective_handle(stream_handle or 0)
    with ContextScope(handle):
        kernel = kernels.loaded_kernel()
        if kernel is None or not kernel.rows_report:
            return  # no layout kernel ran in this context
        skipped, first = rows.take_report(kernel.rows_report, handle, stream_handle is None)
    if skipped:
        raise IndexOutOfRange(skipped, first)
