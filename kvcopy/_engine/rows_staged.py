"""A store and a load at once in layout form, indices on each side's GPU side and its
host rows back to back (copy_rows_both_ways), through GPU staging buffers.

The layout kernel's pair stops near 0.8 of two contiguous copies: its SMs' requests to
host memory share the link less well than the copy engines' do. Here the copy engines
move each chunk's host rows whole (one span per plane) to or from a staging buffer,
and the layout kernel scatters (a load) or gathers (a store) the rows inside the GPU,
reading GPU indices in place, as copy_rows does. Host indices (checked when planned)
are copied into a descriptor-ring slot and uploaded once, on the caller's stream,
before any chunk: the chunks' launches read them there.

A row the GPU side's index skips (negative, or out of range: counted for
kvcopy.check_indices as copy_rows counts it) writes nothing in a load. In a store its
staging row is first filled from the host row it would go to (a second launch that
copies only the skipped rows), so that the copy engines write those host bytes back
unchanged.

Chunk k of a side uses its staging buffer k % 2 (kvcopy._engine.staged's buffers,
under their lock, with their events): its copy-engine work on a side stream, its
kernel on the caller's stream (the store) or another side stream (the load), so that
chunk k + 1 crosses the link while chunk k is gathered or scattered. The work starts
after what is queued on the caller's stream and what is queued there next waits for it.

A pair, once built, is a StagedPair: the same call again issues its chunks without
classifying or building them again (kvcopy._engine.rows_memo keeps it); host indices
are still checked at every call and uploaded anew.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kvcopy import policy
from kvcopy._cuda import driver, rows
from kvcopy._engine import staged
from kvcopy._engine.decide import note_decision
from kvcopy._engine.repeats import note_again, noted_traffic
from kvcopy._engine.rows import host_indices_bytes, ring_indices
from kvcopy._plans.rows import Indices, RowsPlan
from kvcopy._plans.rows_staging import StagedChunks, staging_side, why_not_staged
from kvcopy._runtime import kernels, side_streams
from kvcopy.config import config
from kvcopy.policy import Decision


def _orientation(plan: RowsPlan) -> tuple[bool, str | None]:
    """(load, why not staged): the plan as the direction its indices allow."""
    why_load = why_not_staged(plan, True, policy.ROWS_STAGING_MAX_PLANES)
    if why_load is None:
        return True, None
    return False, why_not_staged(plan, False, policy.ROWS_STAGING_MAX_PLANES)


class _Side:
    """One staged side: its plan, direction, streams and buffers, and its chunks as
    kvcopy._cuda.rows.StagedRowsSide issues them (``indices``: the GPU side's indices as
    the device reads them; the planes' bases as the device sees them: ``src_view``,
    ``dst_view``)."""

    def __init__(
        self,
        plan: RowsPlan,
        load: bool,
        indices: int,
        src_view: np.ndarray,
        dst_view: np.ndarray,
        copy_stream: int,
        kernel_stream: int,
        buffers: tuple[int, int],
        staging: staged.StagingBuffers,
        chunk_bytes: int,
        function: int,
    ) -> None:
        self.copy_stream, self.kernel_stream, self.buffers = copy_stream, kernel_stream, buffers
        chunks = StagedChunks(plan, load, chunk_bytes, tuple(staging.address(b) for b in buffers))
        if load:
            gpu = plan.side(plan.dst, indices)
            host, gpu_bases, host_bases, only = plan.side(plan.src, 0), dst_view, src_view, (0, 0)
        else:
            gpu = plan.side(plan.src, indices)
            # (the rows the gather skips keep their host bytes: copied in first)
            host, gpu_bases, host_bases = plan.side(plan.dst, 0), src_view, dst_view
            only = (indices, plan.src.slots)
        self.chunks = rows.StagedRowsSide(
            function,
            load,
            staging_side(plan),
            gpu,
            host,
            gpu_bases,
            host_bases,
            only,
            plan.pieces,
            plan.piece_bytes,
            policy.STAGING_CTAS,
            config.threads_per_cta,
            copy_stream,
            kernel_stream,
            chunks.first_rows,
            chunks.row_counts,
            chunks.host,
            chunks.staged,
            chunks.nbytes,
            chunks.staging_bases,
        )

    def issue(self, k: int, staging: staged.StagingBuffers) -> None:
        """Chunk k: its host spans by the copy engines and its rows by the layout kernel,
        in the order the side's direction needs, behind the buffer's last use."""
        buffer = self.buffers[k % len(self.buffers)]
        self.chunks.issue(k, staging.free[buffer], staging.filled[buffer])


def wanted(first: RowsPlan, second: RowsPlan, method: str) -> tuple[Decision, list[bool]] | None:
    """policy.choose_rows_staging's answer for the pair from the plans alone (no driver
    call), with whether each side is a load; None: not staged. The caller's stream is
    not capturing."""
    chunk_bytes = config.staging_bytes
    if method != "auto" or not chunk_bytes or first.rows == 0 or second.rows == 0:
        return None
    found = [_orientation(p) for p in (first, second)]
    sizes = (first.total_bytes, second.total_bytes)
    want = ("h2d" if found[0][0] else "d2h", "h2d" if found[1][0] else "d2h")
    decision = policy.choose_rows_staging(
        want, sizes, (found[0][1], found[1][1]), chunk_bytes, False, method, policy.ROWS_STAGING_MIN_BYTES
    )
    return None if decision is None else (decision, [f[0] for f in found])


def try_staged(
    first: RowsPlan,
    second: RowsPlan,
    handle: int,
    found: tuple[Decision, list[bool]],
    settle: Any,
    remember: Callable[["StagedPair"], None] | None = None,
) -> tuple[str, str] | None:
    """Issue both plans through staging buffers, as wanted() said they go (``found``:
    its answer), where their memory allows (``settle(plan)``: the plan's (Target,
    src_view, dst_view), classified and decided as copy_rows does); None where not,
    nothing issued. The caller's stream is not capturing. ``remember`` is given what
    repeats the call (kvcopy._engine.rows_memo keeps it)."""
    decision, loads = found
    want = ["h2d" if load else "d2h" for load in loads]
    chunk_bytes = config.staging_bytes
    settled = [settle(p) for p in (first, second)]
    ordinal = settled[0][0].info.ordinal
    for (target, _, _), direction in zip(settled, want):
        request = target.request
        devices = (-1, ordinal) if direction == "h2d" else (ordinal, -1)
        if (
            request.direction != direction
            or not request.device_accessible
            or request.devices != devices
            or target.info.ordinal != ordinal
        ):
            return None  # (pageable or another GPU's memory: the unstaged ways)
    staging = staged.context_buffers(chunk_bytes)
    if staging is None:
        return None
    info = settled[0][0].info
    function = kernels.kernel_for_current_context(info.cc[0], info.cc[1], info.driver_version).function_rows
    sides = _issue(first, second, settled, loads, handle, staging, chunk_bytes, function)
    note_decision(decision)
    if remember is not None:
        traffic = tuple(
            noted_traffic(target, plan.total_bytes) for (target, _, _), plan in zip(settled, (first, second))
        )
        remember(
            StagedPair(
                sides, handle, decision, staging, traffic, loads, first.host_indices or second.host_indices
            )
        )
    return "staged", "staged"


class StagedPair:
    """A staged pair, built: calling it issues the same chunks again and notes what the
    first call noted. GPU indices are read when the kernels run; a pair built with host
    indices (``host``) is called with the new call's plans, checked already, and their
    indices are uploaded through a ring slot of the call's own before its chunks, as at
    first. Its sides hold the staging buffers' addresses and the context's streams, so
    it runs only in the context it was built in, with the same buffers."""

    __slots__ = ("sides", "handle", "decision", "staging", "buffers", "context", "traffic", "loads", "host")

    def __init__(
        self,
        sides: list[_Side],
        handle: int,
        decision: Decision,
        staging: staged.StagingBuffers,
        traffic: tuple,
        loads: list[bool],
        host: bool,
    ) -> None:
        self.sides, self.handle, self.decision = sides, handle, decision
        self.staging, self.buffers = staging, (staging.base, staging.capacity)
        self.context = driver.current_context_key()
        self.traffic, self.loads, self.host = traffic, loads, host

    def usable(self) -> bool:
        """True: whether it may run is known only in its context (see __call__)."""
        return True

    def __call__(self, plans: tuple[RowsPlan, RowsPlan] | None = None) -> tuple[str, str] | None:
        """Issue the pair again, the caller's context current and its stream not
        capturing (``plans``: the call's, where the pair was built with host indices);
        None, nothing issued, where the context was made again or the staging buffers
        were, or host indices are not given (build the call again)."""
        if driver.current_context_key() != self.context or (self.host and plans is None):
            return None
        staging = staged.context_buffers(config.staging_bytes)
        if staging is not self.staging:
            return None
        if not self.host:
            with staging.lock:
                if not self._issue_again(staging, None):
                    return None
        else:
            assert plans is not None
            with ring_indices(_gpu_sides(plans, self.loads), self.handle) as where:
                with staging.lock:
                    ran = self._issue_again(staging, where)
            if not ran:
                return None
        note_decision(self.decision)
        note_again(self.traffic)
        return "staged", "staged"

    def _issue_again(self, staging: staged.StagingBuffers, indices: list[int] | None) -> bool:
        """Every chunk again (the staging lock held), each side's GPU indices read at
        ``indices`` where given; False, nothing issued, where the buffers were made
        again."""
        if (staging.base, staging.capacity) != self.buffers:
            return False
        if indices is not None:
            for side, where in zip(self.sides, indices):
                side.chunks.set_indices(where)
        _run(self.sides, self.handle, staging)
        return True


def _gpu_sides(plans: tuple[RowsPlan, RowsPlan], loads: list[bool]) -> list[tuple[Indices | None, int]]:
    """Each side's GPU-side indices and rows (a load's destination, a store's source)."""
    return [(plan.dst_indices if load else plan.src_indices, plan.rows) for plan, load in zip(plans, loads)]


def _issue(
    first: RowsPlan,
    second: RowsPlan,
    settled: list,
    loads: list[bool],
    handle: int,
    staging: staged.StagingBuffers,
    chunk_bytes: int,
    function: int,
) -> list[_Side]:
    gpu_sides = _gpu_sides((first, second), loads)
    if not host_indices_bytes(gpu_sides):  # (GPU indices on both sides: read in place)
        where = [indices.device if indices is not None else 0 for indices, _ in gpu_sides]
        return _issue_sides(first, second, settled, loads, where, handle, staging, chunk_bytes, function)
    # (fenced after the sides are joined back: every launch that reads the slot is behind it)
    with ring_indices(gpu_sides, handle) as where:
        return _issue_sides(first, second, settled, loads, where, handle, staging, chunk_bytes, function)


def _issue_sides(
    first: RowsPlan,
    second: RowsPlan,
    settled: list,
    loads: list[bool],
    indices: list[int],
    handle: int,
    staging: staged.StagingBuffers,
    chunk_bytes: int,
    function: int,
) -> list[_Side]:
    """Both sides built (``indices``: each GPU side's as the device reads them) and
    issued, under the staging lock; returns them."""
    with staging.lock:
        sides = []
        for j, (plan, (_, src_view, dst_view), load) in enumerate(zip((first, second), settled, loads)):
            # the first side's kernel runs on the caller's stream, the second's beside it
            streams = (
                (side_streams.for_caller(handle, 0), handle)
                if j == 0
                else (side_streams.for_caller(handle, 2), side_streams.for_caller(handle, 1))
            )
            buffers = (j * staged.BUFFERS_PER_SIDE, j * staged.BUFFERS_PER_SIDE + 1)
            sides.append(
                _Side(
                    plan,
                    load,
                    indices[j],
                    src_view,
                    dst_view,
                    *streams,
                    buffers,
                    staging,
                    chunk_bytes,
                    function,
                )
            )
        _run(sides, handle, staging)
    return sides


def _run(sides: list[_Side], handle: int, staging: staged.StagingBuffers) -> None:
    """Every chunk of both sides, alternating, between the caller's stream and back
    (the staging lock held)."""
    side_work = {s for side in sides for s in (side.copy_stream, side.kernel_stream)} - {handle}
    for stream in side_work:
        driver.stream_wait_stream(stream, handle)
    try:
        for k in range(max(len(side.chunks) for side in sides)):
            for side in sides:
                if k < len(side.chunks):
                    side.issue(k, staging)
    finally:
        for stream in side_work:
            driver.stream_wait_stream(handle, stream)
