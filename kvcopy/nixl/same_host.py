"""The same-host leg: rows between one process's GPU memory and another process's
layout on the same host, moved by kvcopy through CUDA IPC, the caller's NIXL agent
carrying only the two notifications of each transfer.

UCX has no lane between one process's device memory and another process's host
memory on one node: it falls back to TCP (about 0.5 GB/s whatever the descriptors).
Here the end with the GPU memory shares its layout once (:func:`share_layout`: a
CUDA IPC handle per allocation under its planes and an interprocess event; the
:class:`SharedLayout` it gives is a small picklable value to send with the agent's
metadata) and the other end opens it once (:func:`open_layout`), which maps that
memory into its own context. From then on each transfer is one ``copy_rows`` between
the peer's mapped memory and this process's own layout: a scattered copy at the
link's speed, with no staging and nothing of the bytes through NIXL. What the driver
says of the mapped memory is kept until the layout is closed; this process's own
layout is classified once too where it holds its memory (``Layout.of`` a tensor, or
``Layout.from_pointers`` with ``keep=`` the torch tensors under every plane), else at
every transfer (a pointer query per plane).

A transfer, under a ``tag`` both ends agree on:

- the sharing end calls :func:`lend_rows`: it records its event on its stream (the
  rows it wrote before are then what the peer reads, and its writes after wait for
  nothing), tells the peer ``kvcopy/<tag>/lent`` and waits for
  ``kvcopy/<tag>/returned``, after which it may write those rows again (or read what
  the peer put there);
- the opening end calls :func:`pull_rows` (the peer's rows into its layout) or
  :func:`push_rows` (its layout's rows into the peer's): it waits for ``lent``, makes
  its stream wait for the peer's event on the GPU, copies, waits for the copy to end
  and sends ``returned``. A destination row is whole when the call returns.

Either end raises TimeoutError where the other's notification does not come within
``timeout`` seconds; nothing is half-written by a transfer that never started, and
both ends stay usable. Memory must come from cuMemAlloc (cudaMalloc: torch's and
CuPy's default allocators); the driver refuses to share virtual-memory and pool
allocations (torch's ``expandable_segments``), and :func:`share_layout` says which
plane. The peer's memory stays valid while the sharing process holds it: an opened
layout must be closed before the sharing end frees its memory or exits.
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
from kvcopy.nixl.transfers import TransferFailed, _name, notification, wait_notification
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


class SharedRows:
    """A layout shared by this process (:func:`share_layout`): ``shared`` goes to the
    peer; ``close()`` destroys the event (after the last transfer)."""

    def __init__(self, layout: Layout, shared: SharedLayout, event: int, ordinal: int) -> None:
        self.layout = layout
        self.shared = shared
        self.event = event
        self.ordinal = ordinal

    def close(self) -> None:
        if self.event:
            with on_device(self.ordinal):
                driver.event_destroy(self.event)
            self.event = 0

    def __enter__(self) -> "SharedRows":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class OpenedLayout:
    """A peer's shared layout mapped into this process (:func:`open_layout`):
    ``layout`` addresses the peer's rows here; ``close()`` unmaps them (the layout
    must not be used after)."""

    def __init__(self, bases: list[int], event: int, ordinal: int, shared: SharedLayout) -> None:
        self.mapped = bases
        self.event = event
        self.ordinal = ordinal
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
        except BaseException:
            driver.event_destroy(event)
            raise
    shared = SharedLayout(
        tuple(handles),
        tuple(planes),
        tuple(int(getattr(layout, name)) for name in _GEOMETRY),
        event_handle,
        ipc.pci_bus_id(ordinal),
        os.getpid(),
    )
    return SharedRows(layout, shared, event, ordinal)


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
    with on_device(ordinal):
        try:
            for handle in shared.handles:
                mapped.append(ipc.open_mem_handle(handle))
            event = ipc.open_event_handle(shared.event)
        except BaseException:
            for ptr in mapped:
                ipc.close_mem_handle(ptr)
            raise
    return OpenedLayout(mapped, event, ordinal, shared)


def lend_rows(
    agent: Any, peer: str, rows: SharedRows, *, tag: str, stream: Any = None, timeout: float = 60.0
) -> None:
    """The sharing end of one transfer: the peer may read or write the shared rows once
    what is queued on ``stream`` now has run; returns once the peer has returned them
    (its copy has ended). TimeoutError after ``timeout`` seconds without that;
    TransferFailed where the peer refused the transfer (its indices were wrong, say)."""
    if not isinstance(rows, SharedRows) or not rows.event:
        raise TypeError("lend_rows: rows must be an open kvcopy.nixl.SharedRows (share_layout)")
    handle = resolve_stream(stream)
    with on_device(rows.ordinal):
        driver.event_record(rows.event, handle)
    agent.send_notif(_name(peer), notification(tag, "lent"))
    refused = notification(tag, "refused")
    name = _name(peer)

    def refusal() -> None:
        if agent.check_remote_xfer_done(name, refused):
            raise TransferFailed(
                f"lend_rows: {name!r} refused transfer {tag!r} (see its error); nothing moved"
            )

    wait_notification(agent, peer, notification(tag, "returned"), timeout, refusal)


def pull_rows(
    agent: Any,
    peer: str,
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
    them back. A copy that copy_rows refuses (a bad index, say) raises here and tells
    the peer ``kvcopy/<tag>/refused``, so that its lend_rows raises too."""
    return _move(
        agent, peer, opened, opened.layout, dst, src_indices, dst_indices, tag, rows, stream, timeout
    )


def push_rows(
    agent: Any,
    peer: str,
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
    method when they are written and the peer has them back."""
    return _move(
        agent, peer, opened, src, opened.layout, src_indices, dst_indices, tag, rows, stream, timeout
    )


def _move(
    agent: Any,
    peer: str,
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
        raise TypeError("opened must be an open kvcopy.nixl.OpenedLayout (open_layout)")
    handle = resolve_stream(stream)
    wait_notification(agent, peer, notification(tag, "lent"), timeout)
    try:
        with on_device(opened.ordinal):
            driver.stream_wait_event(handle, opened.event)
            method = copy_rows(src, dst, src_indices, dst_indices, rows=rows, stream=handle)
            driver.stream_synchronize(handle)
    except BaseException:
        # (the lender stops waiting: nothing moved)
        agent.send_notif(_name(peer), notification(tag, "refused"))
        raise
    agent.send_notif(_name(peer), notification(tag, "returned"))
    return method
