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
from kvcopy.descriptors import number_tiles_per_slice
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
class Chunk:
    """Copies [first, stop) of a side, staged together. ``spans``: one cuMemcpyAsync
    each, as (first copy, host address, offset in the staging buffer, bytes)."""

    first: int
    stop: int
    spans: tuple[tuple[int, int, int, int], ...]


def plan_chunks(host: np.ndarray, sizes: np.ndarray, starts: np.ndarray,
                chunk_bytes: int) -> tuple[list[Chunk], np.ndarray]:
    """Cut a side (no copy empty, none over ``chunk_bytes``) into chunks of whole copies
    of at most ``chunk_bytes``, in order; returns the chunks and each copy's offset in
    its chunk's staging buffer (copies packed back to back)."""
    ends = np.cumsum(sizes, dtype=np.uint64)
    before = ends - sizes
    offsets = np.empty(len(sizes), dtype=np.uint64)
    chunks: list[Chunk] = []
    first = 0
    while first < len(sizes):
        limit = before[first] + np.uint64(chunk_bytes)
        stop = max(int(np.searchsorted(ends, limit, side="right")), first + 1)
        offsets[first:stop] = before[first:stop] - before[first]
        lo, hi = np.searchsorted(starts, (first + 1, stop))
        cuts = [first, *starts[lo:hi].tolist(), stop]
        spans = tuple((a, int(host[a]), int(before[a] - before[first]),
                       int(ends[b - 1] - before[a])) for a, b in zip(cuts, cuts[1:]))
        chunks.append(Chunk(first, stop, spans))
        first = stop
    return chunks, offsets


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
    chunks: list[Chunk]
    first_descriptor: int
    buffers: tuple[int, int]
    copy_stream: int
    kernel_stream: int
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
            for k in range(max(len(side.chunks) for side in sides)):
                for side in sides:
                    if k < len(side.chunks):
                        _issue_chunk(side, k, staging, function, slot.device)
        finally:
            for stream in side_work:
                driver.stream_wait_stream(handle, stream)
            ring.DescriptorRing.fence(slot, handle)


def _describe_sides(handle: int, batches: list[StagedBatch], staging: StagingBuffers,
                    table: int) -> list[_Side]:
    """Plan each side's chunks and streams, and describe every side's copies against
    their staging addresses into the pinned ``table``, one after the other, each
    chunk's tiles counted from 0 for its own launch."""
    sides, src, dst = [], [], []
    first = 0
    for j, batch in enumerate(batches):
        chunks, offsets = plan_chunks(batch.host, batch.sizes, batch.starts, batch.chunk_bytes)
        buffers = (j * BUFFERS_PER_SIDE, j * BUFFERS_PER_SIDE + 1)
        chunk_of = np.repeat(np.arange(len(chunks)), [c.stop - c.first for c in chunks])
        buffer_of = (j * BUFFERS_PER_SIDE + chunk_of % BUFFERS_PER_SIDE).astype(np.uint64)
        staged = np.uint64(staging.base) + buffer_of * np.uint64(staging.capacity) + offsets
        src.append(staged if batch.direction == "h2d" else batch.gpu)
        dst.append(batch.gpu if batch.direction == "h2d" else staged)
        streams = ((side_streams.for_caller(handle, 0), handle) if j == 0 else
                   (side_streams.for_caller(handle, 2), side_streams.for_caller(handle, 1)))
        sides.append(_Side(batch, chunks, first, buffers, *streams, []))
        first += len(batch.sizes)
    sizes = np.concatenate([b.sizes for b in batches])
    count, _, _, _, _, _, tiles = describe.describe_copies(
        np.concatenate(src), np.concatenate(dst), sizes, table, False)
    assert count == first, "staged copies are never empty, so never dropped"
    bounds = np.array([side.first_descriptor + c.first for side in sides for c in side.chunks])
    per_chunk = number_tiles_per_slice(table, count, tiles, bounds)
    for side in sides:
        side.tiles, per_chunk = per_chunk[:len(side.chunks)], per_chunk[len(side.chunks):]
    return sides


def _issue_chunk(side: _Side, k: int, staging: StagingBuffers, function: int,
                 table: int) -> None:
    """Chunk k of a side: its spans by copy engines and its scatter (or gather) by the
    kernel, in the order its direction needs, behind the staging buffer's last use."""
    chunk, buffer = side.chunks[k], side.buffers[k % BUFFERS_PER_SIDE]
    load = side.batch.direction == "h2d"
    first_stream = side.copy_stream if load else side.kernel_stream
    second_stream = side.kernel_stream if load else side.copy_stream
    driver.stream_wait_event(first_stream, staging.free[buffer])
    for stream in (first_stream, second_stream):
        if stream == side.copy_stream:
            _copy_spans(side.batch, chunk, staging.address(buffer), load, stream)
        else:
            n = chunk.stop - chunk.first
            descs = table + (side.first_descriptor + chunk.first) * describe.DESCRIPTOR_BYTES
            launch.launch_descs(function, descs, n, side.tiles[k], policy.STAGING_CTAS,
                                config.threads_per_cta, stream, 0)
        if stream == first_stream:
            driver.event_record(staging.filled[buffer], stream)
            driver.stream_wait_event(second_stream, staging.filled[buffer])
    driver.event_record(staging.free[buffer], second_stream)


def _copy_spans(batch: StagedBatch, chunk: Chunk, buffer: int, load: bool, stream: int) -> None:
    """One cuMemcpyAsync per host span of the chunk, to (load) or from its buffer."""
    host = np.array([s[1] for s in chunk.spans], dtype=np.uint64)
    staged = np.array([buffer + s[2] for s in chunk.spans], dtype=np.uint64)
    nbytes = np.array([s[3] for s in chunk.spans], dtype=np.uint64)
    try:
        if load:
            dma.memcpy_loop(staged, host, nbytes, stream)
        else:
            dma.memcpy_loop(host, staged, nbytes, stream)
    except CudaError as exc:
        index = None if exc.index is None else int(batch.positions[chunk.spans[exc.index][0]])
        prefix = f"{batch.name}: " if batch.name else ""
        raise type(exc)(exc.code, exc.name, prefix + exc.message, index) from None
