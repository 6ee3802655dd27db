"""Scattered rows sent as whole chunks: gathered by kvcopy into a registered staging
region, moved by NIXL one descriptor a chunk, scattered into the destination layout
on the other side (see kvcopy.nixl).

The sender gathers chunk k (``chunk_rows`` rows of every plane, plane after plane)
into its staging slot k mod its slots with ``copy_rows``, waits for the stream, and
WRITEs the slot into the receiver's slot k mod the receiver's slots; NIXL tells the
receiver once the chunk has landed whole. While chunk k is in flight, chunk k+1 is
gathered into the next slot. The receiver queues each chunk's scatter from its slot
into the destination's rows with ``copy_rows`` and an event after it, and tells the
sender the slot is free once that event has completed, looking between two looks for
the next chunk: the scatters run back to back on its stream while it takes the next
chunks. The sender writes no slot the receiver has not freed. A destination row is
written only from a chunk that arrived whole.

Each end may describe its rows however its cache holds them: a slice of each row's
heads (between tensor-parallel degrees), another block size, another plane order.
Both gathers and scatters are ``copy_rows`` between layouts, so the transform is in
the layouts the two ends pass; only the row bytes and the number of planes must agree.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcopy._cuda.driver import event_create, event_destroy, event_query, event_record, stream_synchronize
from kvcopy.rows import copy_rows
from kvcopy.arguments import require_int
from kvcopy.interop.streams import resolve_stream
from kvcopy.layouts import Layout
from kvcopy.nixl.descriptors import Descriptors
from kvcopy.nixl.transfers import Posted, finish, notification, post, wait_notification

MEMORIES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class Staging:
    """A registered staging region of ``slots`` slots of ``slot_bytes``, from
    ``address``: ``device`` and ``memory`` ('DRAM' or 'VRAM') as NIXL names them.
    The receiver sends its own to the sender with its metadata."""

    address: int
    slot_bytes: int
    slots: int = 2
    device: int = 0
    memory: str = "DRAM"

    def __post_init__(self) -> None:
        require_int(self.address, "staging: address", minimum=1, maximum=2**64 - 1)
        require_int(self.slot_bytes, "staging: slot_bytes", minimum=1)
        require_int(self.slots, "staging: slots", minimum=1)
        require_int(self.device, "staging: device", minimum=0)
        if self.memory not in MEMORIES:
            raise ValueError(f"staging: memory must be 'DRAM' or 'VRAM', got {self.memory!r}")

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.slots

    def regions(self) -> np.ndarray:
        """The region to register with ``agent.register_memory(..., memory)``."""
        return np.array([[self.address, self.nbytes, self.device]], dtype=np.uint64)

    def slot(self, chunk: int) -> int:
        """The address of the slot chunk ``chunk`` goes through."""
        return self.address + (chunk % self.slots) * self.slot_bytes

    def rows(self, chunk: int, count: int, planes: int, row_bytes: int) -> Layout:
        """Chunk ``chunk``'s slot as a layout of ``count`` rows a plane, plane after plane
        (one Layout per slot and shape, made once: a send makes one a chunk)."""
        return _slot_rows(self, chunk % self.slots, count, planes, row_bytes)


@functools.lru_cache(maxsize=256)
def _slot_rows(staging: Staging, slot: int, count: int, planes: int, row_bytes: int) -> Layout:
    first = staging.slot(slot)
    return Layout.from_pointers(
        [first + p * count * row_bytes for p in range(planes)], slots=count, row_bytes=row_bytes
    )


def _rows(indices: Any, name: str, sender: bool) -> np.ndarray:
    """Host indices as int64; the sender's must all be rows (no negative index)."""
    found = np.asarray(indices)
    if found.ndim != 1 or found.dtype.kind not in "iu":
        raise TypeError(f"{name} must be a 1-D sequence of integer row indices on the host")
    found = found.astype(np.int64)
    if sender and len(found) and int(found.min()) < 0:
        raise ValueError(f"{name}: a packed send moves every row it names (no negative index)")
    return found


def _chunks(count: int, chunk_rows: Any, layout: Layout, staging: Staging, side: str) -> int:
    chunk_rows = require_int(chunk_rows, "chunk_rows", minimum=1)
    need = min(chunk_rows, max(count, 1)) * layout.num_planes * layout.row_bytes
    if staging.slot_bytes < need:
        raise ValueError(
            f"{side} staging: slots of {staging.slot_bytes} bytes hold no chunk of "
            f"{min(chunk_rows, count)} rows of {layout.num_planes} planes of "
            f"{layout.row_bytes} bytes ({need})"
        )
    return chunk_rows


def send_packed(
    agent: Any,
    src: Layout,
    src_indices: Any,
    peer: str,
    staging: Staging,
    peer_staging: Staging,
    *,
    tag: str,
    chunk_rows: int,
    stream: Any = None,
    timeout: float = 60.0,
) -> int:
    """Send ``src``'s rows ``src_indices`` (host indices, in order) to ``peer``, which
    runs :func:`receive_packed` with the same ``tag`` and ``chunk_rows``, through this
    end's ``staging`` into the peer's ``peer_staging``; returns the chunks sent.
    Raises TransferFailed, or TimeoutError where the peer frees no slot within
    ``timeout`` seconds; chunks sent before stay sent."""
    rows = _rows(src_indices, "src_indices", sender=True)
    chunk_rows = _chunks(len(rows), chunk_rows, src, staging, "this end's")
    _chunks(len(rows), chunk_rows, src, peer_staging, "the peer's")
    handle = resolve_stream(stream)
    planes, row = src.num_planes, src.row_bytes
    flight: dict[int, Posted] = {}
    chunks = -(-len(rows) // chunk_rows)
    try:
        for k in range(chunks):
            part = rows[k * chunk_rows : (k + 1) * chunk_rows]
            if k % staging.slots in flight:  # (its last chunk must have left the slot)
                finish(flight.pop(k % staging.slots))
            if k >= peer_staging.slots:
                wait_notification(agent, peer, notification(tag, "free", k - peer_staging.slots), timeout)
            copy_rows(src, staging.rows(k, len(part), planes, row), part, None, rows=len(part), stream=handle)
            stream_synchronize(handle)
            size = len(part) * planes * row
            one = Descriptors(
                np.array([[staging.slot(k), size, staging.device]], dtype=np.uint64),
                np.array([[peer_staging.slot(k), size, peer_staging.device]], dtype=np.uint64),
                len(part) * planes,
                size,
                False,
            )
            flight[k % staging.slots] = post(
                agent,
                "WRITE",
                one,
                peer,
                local_memory=staging.memory,
                remote_memory=peer_staging.memory,
                notification=notification(tag, "chunk", k),
                timeout=timeout,
            )
        while flight:
            finish(flight.pop(next(iter(flight))))
    finally:
        for posted in flight.values():  # (after an error: released, not waited for)
            posted.deadline = 0.0
            try:
                finish(posted)
            except Exception:  # noqa: BLE001 - the first error is the one raised
                pass
    return chunks


def receive_packed(
    agent: Any,
    dst: Layout,
    dst_indices: Any,
    peer: str,
    staging: Staging,
    *,
    tag: str,
    chunk_rows: int,
    stream: Any = None,
    timeout: float = 60.0,
) -> int:
    """Receive what ``peer`` sends with :func:`send_packed` (same ``tag`` and
    ``chunk_rows``) into ``dst``'s rows ``dst_indices`` (host indices; a negative
    index skips its row), through ``staging``; returns the chunks received, their rows
    written when it returns. Each chunk is scattered once it arrived whole, its slot
    given back once the scatter has ended on the GPU (seen between two looks for the
    next chunk: nothing waits for it), and only where the sender will write the slot
    again. TimeoutError where a chunk does not come within ``timeout`` seconds: the
    rows of the chunks before are written, no other."""
    rows = _rows(dst_indices, "dst_indices", sender=False)
    chunk_rows = _chunks(len(rows), chunk_rows, dst, staging, "this end's")
    handle = resolve_stream(stream)
    planes, row = dst.num_planes, dst.row_bytes
    chunks = -(-len(rows) // chunk_rows)
    # the sender writes slot k again, for chunk k + slots, after free k: later frees
    # would wait, unread, for a later transfer's sender to take them for its own
    awaited = chunks - staging.slots
    scattering: collections.deque[tuple[int, int]] = collections.deque()  # (chunk, its event)
    events = [event_create() for _ in range(min(staging.slots, chunks))]

    def give_back_ended() -> None:
        while scattering and event_query(scattering[0][1]):
            k = scattering.popleft()[0]
            if k < awaited:
                agent.send_notif(peer, notification(tag, "free", k))

    try:
        for k in range(chunks):
            part = rows[k * chunk_rows : (k + 1) * chunk_rows]
            wait_notification(agent, peer, notification(tag, "chunk", k), timeout, give_back_ended)
            copy_rows(staging.rows(k, len(part), planes, row), dst, None, part, rows=len(part), stream=handle)
            event_record(events[k % len(events)], handle)
            scattering.append((k, events[k % len(events)]))
            give_back_ended()
        stream_synchronize(handle)
        give_back_ended()
    finally:
        for event in events:
            event_destroy(event)
    return chunks
