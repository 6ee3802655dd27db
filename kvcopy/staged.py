"""Batches whose host side is a few long spans, staged through GPU memory.

The copy kernel reads and writes host memory in small requests from SMs. Both ways
at once, a store's writes and a load's read requests share the upstream link, and
the kernel pair stops near 0.8 of two contiguous copies (scripts/link_budget.py).
The copy engines reach 1.00 there, but cost CPU per copy: too much for scattered
small blocks. Where the host side of a batch is a few long spans (LMCache keeps a
chunk of tokens in one host buffer; a host pool handed out in order), the engines
need one copy per span: each span goes whole to a staging buffer in GPU memory, and
the copy kernel scatters the GPU's blocks from there (a load), or gathers them
there first (a store), at HBM speed (figures: policy.STAGING_MIN_BYTES).

How: each side is cut into chunks of at most config.staging_bytes. Chunk k of side j
uses staging buffer 2j + k % 2, its copy-engine work on a stream of kvcopy's own and
its kernel on another (the caller's, for the first side), with events between
them, so that chunk k+1 crosses the link while chunk k is scattered. One descriptor
table, uploaded once, holds every chunk's copies against their staging addresses.
The work is ordered after what is queued on the caller's stream and before what is
queued there next, as every kvcopy call's is.

The staging buffers belong to the context. A buffer is refilled only after an event
recorded behind its last reader, and staged calls are issued one at a time under the
buffers' lock, so two calls' waits and records on one buffer never interleave (and
the buffers never grow under a call). Never under capture
(policy.choose_staging): a graph would keep the shared buffers' addresses.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from kvcopy import kernels, policy, ring, side_streams
from kvcopy._cuda import describe, dma, driver, launch
from kvcopy.config import config
from kvcopy.context import PerContext
from kvcopy.descriptors import pinned_descriptors
from kvcopy.errors import CudaError
from kvcopy.policy import Decision, HostSpans

BUFFERS_PER_SIDE = 2   # one fills while the other is scattered
SIDES = 2              # copy_both_ways stages both of its batches


def span_starts(host: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The indices of the copies that start a host span: the first, and each copy
    whose host bytes do not begin where the previous copy's end."""
    if not len(sizes):
        return np.zeros(0, dtype=np.int64)
    breaks = np.flatnonzero(host[1:] != host[:-1] + sizes[:-1]) + 1
    return np.concatenate((np.zeros(1, dtype=np.int64), breaks))


@dataclass(frozen=True)
class ChunkPlan:
    """A side cut into chunks of whole copies, in order: chunk k is copies
    [bounds[k], bounds[k + 1]), and copy i lies at offsets[i] in its chunk's buffer.
    Its host spans, cut where chunks start, are one cuMemcpyAsync each: span j starts
    at copy span_first[j], at host address span_host[j] and span_offset[j] in its
    chunk's buffer, and has span_bytes[j] bytes; chunk k's spans are
    [span_bounds[k], span_bounds[k + 1])."""

    bounds: np.ndarray
    offsets: np.ndarray
    span_first: np.ndarray
    span_host: np.ndarray
    span_offset: np.ndarray
    span_bytes: np.ndarray
    span_bounds: np.ndarray

    @property
    def count(self) -> int:
        return len(self.bounds) - 1


def plan_chunks(host: np.ndarray, sizes: np.ndarray, starts: np.ndarray,
                chunk_bytes: int) -> ChunkPlan:
    """Cut a side (no copy empty, none over ``chunk_bytes``) into chunks of at most
    ``chunk_bytes``, without a loop over copies: a copy joins the chunk in which its
    first byte falls, the side's bytes counted in steps of ``chunk_bytes`` less its
    largest copy (plus one), so that a chunk's last copy still fits; blocks of one
    size, in steps of the most whole blocks a chunk holds."""
    n = len(sizes)
    ends = np.cumsum(sizes, dtype=np.uint64)
    before = ends - sizes
    largest = int(sizes.max())
    step = (chunk_bytes - chunk_bytes % largest if int(sizes.min()) == largest
            else chunk_bytes - largest + 1)
    new_chunk = np.diff(before // np.uint64(step)) != 0
    bounds = np.concatenate(([0], np.flatnonzero(new_chunk) + 1, [n]))
    chunk_of = np.concatenate(([0], np.cumsum(new_chunk)))
    offsets = before - before[bounds[:-1]][chunk_of]
    span_first = np.union1d(starts, bounds[:-1])
    span_last = np.append(span_first[1:], n) - 1
    return ChunkPlan(bounds, offsets, span_first, host[span_first], offsets[span_first],
                     ends[span_last] - before[span_first], np.searchsorted(span_first, bounds))


def write_table(table: int, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray,
                bounds: np.ndarray) -> list[int]:
    """Write the descriptors of copies src[i] -> dst[i] (device addresses, none empty)
    into the pinned ``table``, the tiles of each slice [bounds[k], bounds[k + 1])
    counted from 0 for a launch of its own; return each slice's tile count. (The
    describe pass would check and classify them again: they were, as the caller's
    batch.)"""
    tiles = (sizes + np.uint64(launch.TILE_BYTES - 1)) // np.uint64(launch.TILE_BYTES)
    before = np.cumsum(tiles) - tiles
    counts = np.diff(bounds)
    tile_start = before - np.repeat(before[bounds[:-1]], counts)
    pinned_descriptors(table, len(sizes))[:] = np.stack((src, dst, sizes, tile_start), axis=1)
    return [int(t) for t in np.add.reduceat(tiles, bounds[:-1])] if len(counts) else []


@dataclass(frozen=True)
class StagedBatch:
    """One side of a staged call: its direction ('h2d' or 'd2h'), the host and GPU
    addresses and sizes of its non-empty copies, where its host spans start, each
    copy's index in the caller's batch, the policy's Decision, its chunk size (the
    staging buffers hold at least that much) and the side's name."""

    direction: str
    host: np.ndarray
    gpu: np.ndarray
    sizes: np.ndarray
    starts: np.ndarray
    positions: np.ndarray
    decision: Decision
    chunk_bytes: int
    name: str = ""


class StagingBuffers:
    """A context's staging buffers (SIDES x BUFFERS_PER_SIDE of ``capacity`` bytes each,
    in one allocation made on first use and grown, never shrunk, with
    config.staging_bytes), per buffer an event behind its last reader and one behind
    its filling, and the lock a staged call holds while it issues its work."""

    def __init__(self) -> None:
        count = SIDES * BUFFERS_PER_SIDE
        self.capacity = 0
        self.base = 0
        self.free = [driver.event_create() for _ in range(count)]
        self.filled = [driver.event_create() for _ in range(count)]
        self.lock = threading.Lock()

    def ensure(self, chunk_bytes: int) -> bool:
        """Buffers of at least ``chunk_bytes`` each; False where the GPU has no room
        (the caller then runs the kernel instead)."""
        if chunk_bytes <= self.capacity:
            return True
        with self.lock:
            if chunk_bytes <= self.capacity:
                return True
            for event in self.free:   # the old buffers may still be read
                driver.event_synchronize(event)
            if self.base:
                driver.mem_free(self.base)
                self.base = self.capacity = 0
            try:
                self.base = driver.mem_alloc(len(self.free) * chunk_bytes)
            except CudaError:
                return False
            self.capacity = chunk_bytes
            return True

    def address(self, index: int) -> int:
        return self.base + index * self.capacity


_buffers = PerContext(StagingBuffers)


def plan_batch(request: policy.CopyRequest, decision: Decision, src: np.ndarray,
               dst: np.ndarray, sizes: np.ndarray, method: str,
               thresholds: policy.Thresholds, name: str = "") -> StagedBatch | None:
    """The batch as a staged side, where policy.choose_staging stages it and the
    context's staging buffers exist (allocated here on first use); else None."""
    chunk_bytes = config.staging_bytes
    # what the policy can rule out without a pass over the copies
    if (decision.method != "kernel" or method != "auto" or not chunk_bytes
            or request.direction not in ("h2d", "d2h") or request.capturing
            or request.total_bytes < thresholds.staging_min_bytes):
        return None
    host, gpu = (src, dst) if request.direction == "h2d" else (dst, src)
    positions = np.flatnonzero(sizes)
    if len(positions) != len(sizes):
        host, gpu, sizes = host[positions], gpu[positions], sizes[positions]
    starts = span_starts(host, sizes)
    spans = HostSpans(len(starts), int(sizes.max()) if len(sizes) else 0)
    staged = policy.choose_staging(request, decision, spans, chunk_bytes, thresholds, method)
    if staged is None or not _buffers.current().ensure(chunk_bytes):
        return None
    return StagedBatch(request.direction, host, gpu, sizes, starts, positions, staged,
                       chunk_bytes, name)


@dataclass
class _Side:
    batch: StagedBatch
    chunks: ChunkPlan
    first_descriptor: int
    copy_stream: int
    kernel_stream: int
    span_staged: np.ndarray   # each span's address in its staging buffer
    buffers: tuple[int, int]
    tiles: list[int]


def run(handle: int, batches: list[StagedBatch], cc: tuple[int, int],
        driver_version: int) -> None:
    """Issue one or two staged sides on the caller's stream ``handle`` (in its context),
    chunks of the sides in turn so that both directions start at once."""
    staging = _buffers.current()
    kernel = kernels.kernel_for_current_context(*cc, driver_version)
    function = kernel.scatter("registers").staged
    count = sum(len(b.sizes) for b in batches)
    nbytes = count * describe.DESCRIPTOR_BYTES
    # the ring's lock, then the buffers': the order plan_batch takes them in
    with ring.ring_for_current_context().reserve(nbytes) as slot, staging.lock:
        sides = _describe_sides(handle, batches, staging, slot.host)
        launch.upload(slot.device, slot.host, nbytes, handle)
        side_work = {s for side in sides for s in (side.copy_stream, side.kernel_stream)} - {handle}
        for stream in side_work:
            driver.stream_wait_stream(stream, handle)
        try:
            for k in range(max(side.chunks.count for side in sides)):
                for side in sides:
                    if k < side.chunks.count:
                        _issue_chunk(side, k, staging, function, slot.device)
        finally:
            for stream in side_work:
                driver.stream_wait_stream(handle, stream)
            ring.DescriptorRing.fence(slot, handle)


def _describe_sides(handle: int, batches: list[StagedBatch], staging: StagingBuffers,
                    table: int) -> list[_Side]:
    """Plan each side's chunks and streams, and write every side's copies against their
    staging addresses into the pinned ``table``, one side after the other."""
    sides, src, dst = [], [], []
    first = 0
    for j, batch in enumerate(batches):
        plan = plan_chunks(batch.host, batch.sizes, batch.starts, batch.chunk_bytes)
        buffers = (j * BUFFERS_PER_SIDE, j * BUFFERS_PER_SIDE + 1)
        # chunk k in buffer k % 2 of the side's two
        chunk_buffer = (np.uint64(staging.address(buffers[0])) + np.uint64(staging.capacity)
                        * (np.arange(plan.count) % BUFFERS_PER_SIDE).astype(np.uint64))
        staged = np.repeat(chunk_buffer, np.diff(plan.bounds)) + plan.offsets
        src.append(staged if batch.direction == "h2d" else batch.gpu)
        dst.append(batch.gpu if batch.direction == "h2d" else staged)
        streams = ((side_streams.for_caller(handle, 0), handle) if j == 0 else
                   (side_streams.for_caller(handle, 2), side_streams.for_caller(handle, 1)))
        sides.append(_Side(batch, plan, first, *streams, staged[plan.span_first], buffers, []))
        first += len(batch.sizes)
    bounds = np.concatenate([side.first_descriptor + side.chunks.bounds[:-1] for side in sides]
                            + [[first]])
    per_chunk = write_table(table, np.concatenate(src), np.concatenate(dst),
                            np.concatenate([b.sizes for b in batches]), bounds)
    for side in sides:
        side.tiles, per_chunk = per_chunk[:side.chunks.count], per_chunk[side.chunks.count:]
    return sides


def _issue_chunk(side: _Side, k: int, staging: StagingBuffers, function: int,
                 table: int) -> None:
    """Chunk k of a side: its spans by copy engines and its scatter (or gather) by the
    kernel, in the order its direction needs, behind the staging buffer's last use."""
    plan, buffer = side.chunks, side.buffers[k % BUFFERS_PER_SIDE]
    load = side.batch.direction == "h2d"
    first_stream = side.copy_stream if load else side.kernel_stream
    second_stream = side.kernel_stream if load else side.copy_stream
    driver.stream_wait_event(first_stream, staging.free[buffer])
    for stream in (first_stream, second_stream):
        if stream == side.copy_stream:
            _copy_spans(side, int(plan.span_bounds[k]), int(plan.span_bounds[k + 1]), load)
        else:
            first, stop = int(plan.bounds[k]), int(plan.bounds[k + 1])
            descs = table + (side.first_descriptor + first) * describe.DESCRIPTOR_BYTES
            launch.launch_descs(function, descs, stop - first, side.tiles[k],
                                policy.STAGING_CTAS, config.threads_per_cta, stream, 0)
        if stream == first_stream:
            driver.event_record(staging.filled[buffer], stream)
            driver.stream_wait_event(second_stream, staging.filled[buffer])
    driver.event_record(staging.free[buffer], second_stream)


def _copy_spans(side: _Side, lo: int, hi: int, load: bool) -> None:
    """Spans [lo, hi) of a side, one cuMemcpyAsync each, to (load) or from their
    staging buffer."""
    plan = side.chunks
    host, staged, nbytes = plan.span_host[lo:hi], side.span_staged[lo:hi], plan.span_bytes[lo:hi]
    try:
        if load:
            dma.memcpy_loop(staged, host, nbytes, side.copy_stream)
        else:
            dma.memcpy_loop(host, staged, nbytes, side.copy_stream)
    except CudaError as exc:
        batch = side.batch
        index = (None if exc.index is None
                 else int(batch.positions[plan.span_first[lo + exc.index]]))
        prefix = f"{batch.name}: " if batch.name else ""
        raise type(exc)(exc.code, exc.name, prefix + exc.message, index) from None
