"""Batches whose host side is a few long spans, staged through GPU memory.

The copy kernel reads and writes host memory in small requests from SMs. Both ways
at once, a store's writes and a load's read requests share the upstream link, and
the kernel pair stops near 0.8 of two contiguous copies.
The copy engines reach 1.00 there, but cost CPU per copy: too much for scattered
small blocks. Where the host side of a batch is a few long spans (LMCache keeps a
chunk of tokens in one host buffer; a host pool handed out in order), the engines
need one copy per span: each span goes whole to a staging buffer in GPU memory, and
the copy kernel scatters the GPU's blocks from there (a load), or gathers them
there first (a store), at HBM speed (figures: policy.STAGING_MIN_BYTES).

How: kvcopy._cuda.stage cuts each side's copies into chunks of at most
config.staging_bytes and writes the kernel's descriptors. Chunk k of side j uses
staging buffer 2j + k % 2, its copy-engine work on a stream of kvcopy's own and its
kernel on another (the caller's, for the first side), with events between them, so
that chunk k+1 crosses the link while chunk k is scattered. One descriptor table
holds every chunk's copies against their staging addresses: for one-tile copies
(many per chunk) each chunk is planned just before it is issued and read by the
kernel in place; other sides are planned whole first and uploaded once.
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

from kvcopy import policy
from kvcopy._runtime import kernels, ring, side_streams
from kvcopy._cuda import describe, driver, launch, memory, stage
from kvcopy._cuda.describe import DescribedBatch
from kvcopy.config import config
from kvcopy._runtime.context import PerContext
from kvcopy.errors import CudaError
from kvcopy.policy import Decision, HostSpans

BUFFERS_PER_SIDE = 2  # one fills while the other is scattered
SIDES = 2  # copy_both_ways stages both of its batches


@dataclass(frozen=True)
class StagedBatch:
    """One side of a staged call: its direction ('h2d' or 'd2h'), the caller's host and
    GPU addresses and sizes, how many copies are not empty, the policy's Decision, its
    chunk size (the staging buffers hold at least that much), the side's name and its
    largest copy (0: not known)."""

    direction: str
    host: np.ndarray
    gpu: np.ndarray
    sizes: np.ndarray
    count: int
    decision: Decision
    chunk_bytes: int
    name: str = ""
    largest_copy: int = 0

    @property
    def one_tile_copies(self) -> bool:
        """Every copy is one tile of the kernel: it may read their descriptors in place."""
        return 0 < self.largest_copy <= launch.TILE_BYTES


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
            for event in self.free:  # the old buffers may still be read
                driver.event_synchronize(event)
            if self.base:
                memory.mem_free(self.base)
                self.base = self.capacity = 0
            try:
                self.base = memory.mem_alloc(len(self.free) * chunk_bytes)
            except CudaError:
                return False
            self.capacity = chunk_bytes
            return True

    def address(self, index: int) -> int:
        return self.base + index * self.capacity


_buffers = PerContext(StagingBuffers)


def context_buffers(chunk_bytes: int) -> StagingBuffers | None:
    """The current context's staging buffers, of ``chunk_bytes`` each at least (made or
    grown here); None where the GPU has no room for them."""
    staging = _buffers.current()
    return staging if staging.ensure(chunk_bytes) else None


def plan_batch(
    request: policy.CopyRequest,
    decision: Decision,
    batch: DescribedBatch,
    method: str,
    thresholds: policy.Thresholds,
    name: str = "",
) -> StagedBatch | None:
    """The described batch as a staged side, where policy.choose_staging stages it (its
    host side's spans as the describe pass counted them) and the context's staging
    buffers exist (allocated here on first use); else None."""
    chunk_bytes = config.staging_bytes
    if not policy.staging_possible(request, decision, chunk_bytes, thresholds, method):
        return None
    load = request.direction == "h2d"
    host, gpu = (batch.src, batch.dst) if load else (batch.dst, batch.src)
    spans = HostSpans(batch.src_spans if load else batch.dst_spans, batch.largest_copy)
    staged = policy.choose_staging(request, decision, spans, chunk_bytes, thresholds, method)
    if staged is None or not _buffers.current().ensure(chunk_bytes):
        return None
    return StagedBatch(
        request.direction,
        host,
        gpu,
        batch.sizes,
        len(batch.sizes) - batch.empty_copies,
        staged,
        chunk_bytes,
        name,
        batch.largest_copy,
    )


class _Side:
    """A side planned into the descriptor table from ``first_descriptor`` on, and its
    streams: copy engines on ``copy_stream``, the kernel on ``kernel_stream``.

    Batches of one-tile copies are planned chunk by chunk, each just before it is
    issued, and the kernel reads their descriptors where they are written (pinned,
    mapped): planning 16,384 copies before the first chunk's copy held the link idle
    for as long. Other batches (few copies per chunk) are planned whole and uploaded
    once; the kernel then reads ``table`` (the slot's device copy)."""

    def __init__(
        self,
        batch: StagedBatch,
        first_descriptor: int,
        buffers: tuple[int, int],
        staging: StagingBuffers,
        slot: ring.Slot,
        copy_stream: int,
        kernel_stream: int,
    ) -> None:
        self.batch, self.first_descriptor, self.buffers = batch, first_descriptor, buffers
        self.copy_stream, self.kernel_stream = copy_stream, kernel_stream
        self.in_place = batch.one_tile_copies
        self.table = slot.mapped if self.in_place else slot.device
        self._host_table = slot.host + first_descriptor * describe.DESCRIPTOR_BYTES
        self._staging = staging
        room = len(batch.sizes) + 1
        self.chunk_first = np.zeros(room, dtype=np.int64)
        self.chunk_tiles = np.empty(room, dtype=np.uint64)
        self.span_bounds = np.zeros(room, dtype=np.int64)
        self.span_first = np.empty(room, dtype=np.int64)
        self.span_host = np.empty(room, dtype=np.uint64)
        self.span_staged = np.empty(room, dtype=np.uint64)
        self.span_bytes = np.empty(room, dtype=np.uint64)
        # (the addresses, for launch.issue_staged_chunk: asking NumPy costs microseconds)
        self.span_addresses: tuple[int, int, int] = (
            self.span_host.ctypes.data,
            self.span_staged.ctypes.data,
            self.span_bytes.ctypes.data,
        )
        self.planned, self._next_copy = 0, 0  # chunks planned; the first copy left
        if not self.in_place:
            self.has_chunk(len(batch.sizes))  # every chunk now: the table is uploaded whole

    def has_chunk(self, k: int) -> bool:
        """Whether the side has a chunk k, planning it first where it is not yet."""
        batch = self.batch
        while self.planned <= k and self._next_copy < len(batch.sizes):
            j = self.planned
            first = int(self.chunk_first[j])
            self._next_copy, taken, tiles, spans = stage.plan_next_chunk(
                batch.host,
                batch.gpu,
                batch.sizes,
                batch.direction == "h2d",
                batch.chunk_bytes,
                self._staging.address(self.buffers[j % BUFFERS_PER_SIDE]),
                self._next_copy,
                self._host_table + first * describe.DESCRIPTOR_BYTES,
                self.span_first,
                self.span_host,
                self.span_staged,
                self.span_bytes,
                int(self.span_bounds[j]),
            )
            if taken:
                self.chunk_first[j + 1], self.chunk_tiles[j] = first + taken, tiles
                self.span_bounds[j + 1] = spans
                self.planned += 1
        return k < self.planned

    def upload(self, handle: int) -> None:
        """A side planned whole: its descriptors to the slot's device copy, on ``handle``."""
        if not self.in_place:
            offset = self.first_descriptor * describe.DESCRIPTOR_BYTES
            launch.upload(
                self.table + offset,
                self._host_table,
                int(self.chunk_first[self.planned]) * describe.DESCRIPTOR_BYTES,
                handle,
            )


def run(handle: int, batches: list[StagedBatch], cc: tuple[int, int], driver_version: int) -> None:
    """Issue one or two staged sides on the caller's stream ``handle`` (in its context),
    chunks of the sides in turn so that both directions start at once."""
    staging = _buffers.current()
    kernel = kernels.kernel_for_current_context(*cc, driver_version)
    function = kernel.scatter("registers").uploaded
    count = sum(b.count for b in batches)
    nbytes = count * describe.DESCRIPTOR_BYTES
    # the ring's lock, then the buffers': the order plan_batch takes them in
    with ring.ring_for_current_context().reserve(nbytes) as slot, staging.lock:
        sides, first = [], 0
        for j, batch in enumerate(batches):
            # the first side's kernel runs on the caller's stream, the second's beside it
            streams = (
                (side_streams.for_caller(handle, 0), handle)
                if j == 0
                else (side_streams.for_caller(handle, 2), side_streams.for_caller(handle, 1))
            )
            buffers = (j * BUFFERS_PER_SIDE, j * BUFFERS_PER_SIDE + 1)
            sides.append(_Side(batch, first, buffers, staging, slot, *streams))
            first += batch.count
        for side in sides:
            side.upload(handle)
        side_work = {s for side in sides for s in (side.copy_stream, side.kernel_stream)} - {handle}
        for stream in side_work:
            driver.stream_wait_stream(stream, handle)
        try:
            k = 0
            while True:
                # (has_chunk plans chunk k of a side planned chunk by chunk)
                turn = [side for side in sides if side.has_chunk(k)]
                if not turn:
                    break
                for side in turn:
                    _issue_chunk(side, k, staging, function)
                k += 1
        finally:
            for stream in side_work:
                driver.stream_wait_stream(handle, stream)
            ring.DescriptorRing.fence(slot, handle)


def _issue_chunk(side: _Side, k: int, staging: StagingBuffers, function: int) -> None:
    """Chunk k of a side: its spans by copy engines and its scatter (or gather) by the
    kernel, in the order its direction needs, behind the staging buffer's last use
    (launch.issue_staged_chunk). A failed span copy is reported with the side's name
    and the caller's index of the span's first copy."""
    buffer = side.buffers[k % BUFFERS_PER_SIDE]
    lo, hi = int(side.span_bounds[k]), int(side.span_bounds[k + 1])
    first = int(side.chunk_first[k])
    descs = side.table + (side.first_descriptor + first) * describe.DESCRIPTOR_BYTES
    try:
        launch.issue_staged_chunk(
            side.batch.direction == "h2d",
            side.copy_stream,
            side.kernel_stream,
            staging.free[buffer],
            staging.filled[buffer],
            *side.span_addresses,
            lo,
            hi,
            function,
            descs,
            int(side.chunk_first[k + 1]) - first,
            int(side.chunk_tiles[k]),
            policy.STAGING_CTAS,
            config.threads_per_cta,
        )
    except CudaError as exc:
        index = None if exc.index is None else int(side.span_first[exc.index])
        prefix = f"{side.batch.name}: " if side.batch.name else ""
        raise type(exc)(exc.code, exc.name, prefix + exc.message, index) from None
