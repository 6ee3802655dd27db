"""The same-host leg: rows between one process's GPU memory and another process's
layout on the same host, moved by kvcopy through CUDA IPC, signalled through a page of
shared memory (kvcopy.nixl.doorbell).

UCX has no lane between one process's device memory and another process's host
memory on one node: it falls back to TCP (about 0.5 GB/s whatever the descriptors).
Here the end with the GPU memory shares its layout once (:func:`share_layout`: a
CUDA IPC handle per allocation under its planes, an interprocess event and a
doorbell; the :class:`SharedLayout` it gives is a small picklable value to send with
the agent's metadata) and the other end opens it once (:func:`open_layout`), which
maps that memory into its own context. From then on each transfer is one
``copy_rows`` between the peer's mapped memory and this process's own layout: a
scattered copy at the link's speed, with no staging and nothing of the bytes through
NIXL. What the driver says of the mapped memory is kept until the layout is closed;
this process's own layout is classified once too where it holds its memory
(``Layout.of`` a tensor, or ``Layout.from_pointers`` with ``keep=`` the torch tensors
under every plane), else at every transfer (a pointer query per plane).

A transfer, under a ``tag`` both ends agree on, one at a time a shared layout:

- the sharing end calls :func:`lend_rows`: it records its event on its stream (the
  rows it wrote before are then what the peer reads, and its writes after wait for
  nothing), rings "lent" and waits for the peer's answer, after which it may write
  those rows again (or read what the peer put there);
- the opening end calls :func:`pull_rows` (the peer's rows into its layout) or
  :func:`push_rows` (its layout's rows into the peer's): it waits for the lend, makes
  its stream wait for the peer's event on the GPU, copies, waits for the copy to end
  and answers "returned". A destination row is whole when the call returns.

The two signals take microseconds where NIXL notifications between the same two
processes take what the agents' progress threads give them (see kvcopy.nixl.doorbell),
and the leg needs no agent. Either end raises TimeoutError where the other's signal
does not come within ``timeout`` seconds; nothing is half-written by a transfer that
never started, and both ends stay usable. A refused transfer (an index out of range,
the ends disagreeing on the tag) raises TransferFailed at the lender with the peer's
reason. A shared layout is opened by one peer: share it once per peer. Memory must
come from cuMemAlloc (cudaMalloc: torch's and CuPy's default allocators); the driver
refuses to share virtual-memory and pool allocations (torch's
``expandable_segments``), and :func:`share_layout` says which plane. The peer's memory
stays valid while the sharing process holds it: an opened layout must be closed
before the sharing end frees its memory or exits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvcopy._cuda import driver, ipc
from kvcopy._runtime import kept_memory
from kvcopy._runtime.context import on_device
from kvcopy.layouts import Layout
from kvcopy.interop.streams import resolve_stream
from kvcopy.nixl import doorbell
from kvcopy.nixl.transfers import TransferFailed
from kvcopy.rows import copy_rows

_GEOMETRY = ("slots", "row_bytes", "page_size", "page_stride", "slot_stride", "pieces", "piece_stride")


@dataclass(frozen=True)
class SharedLayout:
    """What the sharing end sends its peer: one CUDA IPC handle per allocation under
    the layout's planes, each plane as (allocation, offset), the layout's geometry,
    the interprocess event's handle, the device's PCI bus id and the sharing process's
    id. Picklable; it grants the peer nothing until it is opened."""

    handles: tuple[bytes, ...]
    planes: tuple[tuple[int, int], ...]
    geometry: tuple[int, ...]
    event: bytes
    bus_id: str
    pid: int
    doorbell: str


class SharedRows:
    """A layout shared by this process (:func:`share_layout`): ``shared`` goes to the
    peer; ``close()`` destroys the event and the doorbell (after the last transfer).
    Keep it while the peer may open the layout: a doorbell no peer has opened is
    unlinked when this object is dropped."""

    def __init__(
        self, layout: Layout, shared: SharedLayout, event: int, ordinal: int, bell: doorbell.Doorbell
    ) -> None:
        self.layout = layout
        self.shared = shared
        self.event = event
        self.ordinal = ordinal
        self.doorbell = bell
        self.sequence = 0  # (the latest lend's number)

    def close(self) -> None:
        if self.event:
            with on_device(self.ordinal):
                driver.event_destroy(self.event)
            self.event = 0
        self.doorbell.close()

    def __enter__(self) -> "SharedRows":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class OpenedLayout:
    """A peer's shared layout mapped into this process (:func:`open_layout`):
    ``layout`` addresses the peer's rows here; ``close()`` unmaps them (the layout
    must not be used after)."""

    def __init__(
        self, bases: list[int], event: int, ordinal: int, shared: SharedLayout, bell: doorbell.Doorbell
    ) -> None:
        self.mapped = bases
        self.event = event
        self.ordinal = ordinal
        self.doorbell = bell
        self.taken = 0  # (the number of the latest lend this end took)
        slots, row_bytes, page_size, page_stride, slot_stride, pieces, piece_stride = shared.geometry
        self.layout = Layout.from_pointers(
            [bases[allocation] + offset for allocation, offset in shared.planes],
            slots=slots,
            row_bytes=row_bytes,
            page_size=page_size,
            page_stride=page_stride,
            slot_stride=slot_stride,
            pieces=pieces,
            piece_stride=piece_stride,
            keep=(self,),
        )
        # (the mapping stays until close(): what the driver says of it is kept, so a
        # pull or push classifies this side's memory once, not at every transfer)
        kept_memory.hold_layout(self.layout)

    def close(self) -> None:
        if not self.mapped and not self.event:
            return  # (closed already)
        kept_memory.release_layout(self.layout)
        with on_device(self.ordinal):
            while self.mapped:
                ipc.close_mem_handle(self.mapped.pop())
            if self.event:
                driver.event_destroy(self.event)
                self.event = 0
        self.doorbell.close()

    def __enter__(self) -> "OpenedLayout":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def share_layout(layout: Layout) -> SharedRows:
    """Share ``layout``'s rows, all in GPU memory from cuMemAlloc on one device, with
    another process. Raises TypeError for what is not a Layout, ValueError naming the
    plane whose memory cannot be shared (host memory, another device's, a plane that
    runs past its allocation, an allocation the driver will not share)."""
    if not isinstance(layout, Layout):
        raise TypeError(f"share_layout: layout must be a kvcopy.Layout, got {type(layout).__name__}")
    driver.init()
    bases = [int(b) for b in layout.bases]
    ordinal = _device_of(bases[0], 0)
    allocations: dict[int, int] = {}  # base -> index
    handles: list[bytes] = []
    planes = []
    extent = layout.extent
    with on_device(ordinal):  # (IPC handles are made in a context of the memory's device)
        for p, base in enumerate(bases):
            where = _device_of(base, p)
            if where != ordinal:
                raise ValueError(f"share_layout: plane {p} is on device {where}, plane 0 on device {ordinal}")
            start, size = ipc.allocation_of(base)
            if base + extent > start + size:
                raise ValueError(
                    f"share_layout: plane {p}'s rows run past the end of its allocation "
                    f"({base + extent - start - size} bytes): a plane is shared as part of one"
                )
            if start not in allocations:
                try:
                    handles.append(ipc.mem_handle(start))
                except Exception as exc:
                    raise ValueError(
                        f"share_layout: the driver will not share plane {p}'s allocation ({exc}); "
                        "CUDA IPC shares cuMemAlloc memory only (not expandable segments or pools)"
                    ) from None
                allocations[start] = len(handles) - 1
            planes.append((allocations[start], base - start))
        event = ipc.event_create_shared()
        try:
            event_handle = ipc.event_handle(event)
            bus_id = ipc.pci_bus_id(ordinal)
            bell = doorbell.Doorbell.create()
        except BaseException:
            driver.event_destroy(event)
            raise
    shared = SharedLayout(
        tuple(handles),
        tuple(planes),
        tuple(int(getattr(layout, name)) for name in _GEOMETRY),
        event_handle,
        bus_id,
        os.getpid(),
        bell.path,
    )
    return SharedRows(layout, shared, event, ordinal, bell)


def _device_of(base: int, plane: int) -> int:
    """The device whose memory holds ``base``, or ValueError naming the plane."""
    ordinal = ipc.device_ordinal(base)
    if ordinal < 0:
        raise ValueError(
            f"share_layout: plane {plane} is not GPU memory (host or managed memory, or none "
            "the driver knows); CUDA IPC shares GPU memory only"
        )
    return ordinal


def open_layout(shared: SharedLayout) -> OpenedLayout:
    """Map another process's shared layout into this one, on the device of the same
    PCI bus id. Raises TypeError for what is not a SharedLayout, ValueError where this
    process shared it (IPC opens another process's memory only) or has no such device,
    CudaError where the driver refuses (the sharing process gone, say)."""
    if not isinstance(shared, SharedLayout):
        raise TypeError(
            f"open_layout: shared must be a kvcopy.nixl.SharedLayout, got {type(shared).__name__}"
        )
    if shared.pid == os.getpid():
        raise ValueError("open_layout: this process shared the layout; use it directly")
    driver.init()
    try:
        ordinal = ipc.device_of_bus_id(shared.bus_id)
    except Exception:
        raise ValueError(f"open_layout: no device at PCI bus id {shared.bus_id!r} in this process") from None
    mapped: list[int] = []
    event = 0
    with on_device(ordinal):
        try:
            for handle in shared.handles:
                mapped.append(ipc.open_mem_handle(handle))
            event = ipc.open_event_handle(shared.event)
            try:
                bell = doorbell.Doorbell.open(shared.doorbell)
            except FileNotFoundError:
                raise ValueError(
                    f"open_layout: the shared layout's doorbell ({shared.doorbell}) is gone: a shared "
                    "layout is opened once (share it again for another peer), and not after its "
                    "sharer closed it"
                ) from None
        except BaseException:
            for ptr in mapped:
                ipc.close_mem_handle(ptr)
            if event:
                driver.event_destroy(event)
            raise
    return OpenedLayout(mapped, event, ordinal, shared, bell)


def lend_rows(rows: SharedRows, *, tag: str, stream: Any = None, timeout: float = 60.0) -> None:
    """The sharing end of one transfer: the peer may read or write the shared rows once
    what is queued on ``stream`` now has run; returns once the peer has returned them
    (its copy has ended). TransferFailed where the peer refused the transfer (its
    indices were wrong, or it asked for another tag: the reason is in the message).
    TimeoutError after ``timeout`` seconds without an answer; the lend is then
    withdrawn, so a peer that has not taken it yet will not (one that took it as the
    time ran out may still be copying: treat the rows as in use until that peer is
    known to have stopped)."""
    if not isinstance(rows, SharedRows) or not rows.event:
        raise TypeError("lend_rows: rows must be an open kvcopy.nixl.SharedRows (share_layout)")
    _require_tag(tag, "lend_rows")
    handle = resolve_stream(stream)
    with on_device(rows.ordinal):
        driver.event_record(rows.event, handle)
    rows.sequence += 1
    sequence = rows.sequence & 0xFFFFFFFF
    bell = rows.doorbell
    bell.ring("lent", doorbell.word(sequence, doorbell.LENT, tag), tag)

    def answered(value: int) -> bool:
        return doorbell.fields(value)[0] == sequence

    answer = bell.wait("answer", answered, timeout)
    if answer is None:
        bell.ring("lent", doorbell.word(sequence, doorbell.WITHDRAWN, tag), tag)
        answer = bell.read("answer")  # (an answer that came as the lend was withdrawn)
        if not answered(answer):
            raise TimeoutError(
                f"lend_rows: transfer {tag!r} not returned after {timeout} s; the lend is withdrawn"
            )
    if doorbell.fields(answer)[1] == doorbell.REFUSED:
        raise TransferFailed(f"lend_rows: the peer refused transfer {tag!r}: {bell.reason()}")


def pull_rows(
    opened: OpenedLayout,
    dst: Layout,
    src_indices: Any = None,
    dst_indices: Any = None,
    *,
    tag: str,
    rows: int | None = None,
    stream: Any = None,
    timeout: float = 60.0,
) -> str:
    """The opening end of one transfer: the peer's rows ``src_indices`` into this
    process's ``dst`` rows ``dst_indices`` (as copy_rows takes them), once the peer
    lends them; returns copy_rows' method when the rows are written and the peer has
    them back. A copy that copy_rows refuses (a bad index, say) raises here and
    refuses the transfer at the lender too, with the reason; a lend under another tag
    is refused at both ends (TransferFailed). TimeoutError where no lend comes within
    ``timeout`` seconds."""
    return _move(
        "pull_rows", opened, opened.layout, dst, src_indices, dst_indices, tag, rows, stream, timeout
    )


def push_rows(
    src: Layout,
    opened: OpenedLayout,
    src_indices: Any = None,
    dst_indices: Any = None,
    *,
    tag: str,
    rows: int | None = None,
    stream: Any = None,
    timeout: float = 60.0,
) -> str:
    """The opening end of one transfer: this process's ``src`` rows ``src_indices`` into
    the peer's rows ``dst_indices``, once the peer lends them; returns copy_rows'
    method when they are written and the peer has them back. Refusals and timeouts as
    :func:`pull_rows`."""
    return _move(
        "push_rows", opened, src, opened.layout, src_indices, dst_indices, tag, rows, stream, timeout
    )


def _require_tag(tag: Any, caller: str) -> None:
    if not isinstance(tag, str) or not tag:
        raise TypeError(f"{caller}: tag must be a non-empty str naming the transfer, got {tag!r}")


def _move(
    caller: str,
    opened: OpenedLayout,
    src: Layout,
    dst: Layout,
    src_indices: Any,
    dst_indices: Any,
    tag: str,
    rows: int | None,
    stream: Any,
    timeout: float,
) -> str:
    if not isinstance(opened, OpenedLayout) or not opened.mapped:
        raise TypeError(f"{caller}: opened must be an open kvcopy.nixl.OpenedLayout (open_layout)")
    _require_tag(tag, caller)
    handle = resolve_stream(stream)
    bell = opened.doorbell
    taken = opened.taken

    def lent(value: int) -> bool:
        sequence, state, _ = doorbell.fields(value)
        return state == doorbell.LENT and sequence != taken

    found = bell.wait("lent", lent, timeout)
    if found is None:
        raise TimeoutError(f"{caller}: transfer {tag!r} not lent within {timeout} s")
    sequence, _, which = doorbell.fields(found)
    opened.taken = sequence
    if which != doorbell.digest(tag):
        theirs = bell.lent_tag()
        bell.ring(
            "answer", doorbell.word(sequence, doorbell.REFUSED, tag), tag, f"the peer asked for {tag!r}"
        )
        raise TransferFailed(f"{caller}: the peer lent transfer {theirs!r}, not {tag!r}; nothing moved")
    try:
        with on_device(opened.ordinal):
            driver.stream_wait_event(handle, opened.event)
            method = copy_rows(src, dst, src_indices, dst_indices, rows=rows, stream=handle)
            driver.stream_synchronize(handle)
    except BaseException as exc:
        # (the lender stops waiting, told why: nothing moved)
        reason = f"{type(exc).__name__}: {exc}"
        bell.ring("answer", doorbell.word(sequence, doorbell.REFUSED, tag), tag, reason)
        raise
    bell.ring("answer", doorbell.word(sequence, doorbell.RETURNED, tag), tag)
    return method
