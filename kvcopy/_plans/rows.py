"""What a copy_rows call moves: two layouts paired plane by plane, and the rows'
indices, checked before anything is enqueued where they are on the host.

Host indices are checked whole, vectorised, in time that follows the batch (never
the pool): each below its side's slots, no destination slot written by two rows,
and, where the two layouts share memory, no row reading bytes another writes.
GPU-resident indices are not read here (that would wait for the GPU): the kernel
checks each against its side's slots before the row it names is written
(kvcopy.check_indices); that no two rows write one slot, or read what another
writes, is then the caller's to guarantee.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcopy._cuda.plan_arrays import row_slots_ok
from kvcopy.arguments import require_int
from kvcopy.interop.frameworks import framework_of, type_name
from kvcopy.interop.streams import current_framework_stream, resolve_stream
from kvcopy.interop.protocols import plain_face_key
from kvcopy.interop.arrays import plain_host_int64, plain_int64, torch_integers
from kvcopy.interop.tensors import strided, torch_integers_refusal
from kvcopy.kept import make_room
from kvcopy.layouts import Layout
from kvcopy._plans.overlaps import first_overlap, overlap_between

_INT64_MAX = (1 << 63) - 1


@dataclass(slots=True, eq=False)
class Indices:
    """One side's row -> slot map: ``device`` (an address of int64 slots in GPU memory)
    or ``host`` (int64 values), ``count`` of them; ``keep`` holds their owner. Never
    changed once made (not frozen: a frozen dataclass costs a microsecond to build, and
    one is built per side at every call)."""

    count: int
    device: int = 0
    host: np.ndarray | None = None
    keep: Any = None


def _gpu_indices(obj: Any, name: str) -> Indices | None:
    """GPU-resident indices (a CUDA torch tensor, or a __cuda_array_interface__
    producer), read in place; None where ``obj`` is not on a GPU."""
    if framework_of(obj) == "torch":
        if not obj.is_cuda:
            return None  # (host tensors are read, and checked, by torch_integers)
        if plain_int64(obj) and obj.dim() == 1 and obj.is_contiguous():  # (the engines')
            count = obj.numel()
            return Indices(count, obj.data_ptr() if count else 0, None, obj)
        refusal = torch_integers_refusal(obj)
        if refusal:
            raise TypeError(f"{name}: {refusal}")
        import torch

        if obj.dtype != torch.int64:
            raise TypeError(f"{name}: GPU indices must be int64, got {obj.dtype}")
        count = obj.numel()
        if obj.dim() != 1 or (count > 1 and obj.stride()[0] != 1):
            raise ValueError(
                f"{name}: GPU indices must be one contiguous dimension, got shape "
                f"{tuple(obj.shape)} strides {tuple(obj.stride())}"
            )
        return Indices(count, obj.data_ptr() if count else 0, None, obj)
    face = getattr(obj, "__cuda_array_interface__", None)
    if not isinstance(face, dict):
        return None
    # (one with pending writes is read in full: its stream is waited for)
    key = plain_face_key(face, "__cuda_array_interface__") if face.get("stream") is None else None
    known = _index_faces.get(key) if key is not None else None
    if known is not None:
        return Indices(known[0], known[1], keep=obj)
    if str(face.get("typestr", "")).lstrip("<=") != "i8":
        raise TypeError(f"{name}: GPU indices must be int64 ('<i8'), got {face.get('typestr')!r}")
    ptr, shape, strides, _ = strided(obj, name)
    if len(shape) != 1 or (shape[0] > 1 and strides[0] != 8):
        raise ValueError(
            f"{name}: GPU indices must be one contiguous dimension, got shape {shape} strides {strides}"
        )
    count, at = shape[0], ptr if shape[0] else 0
    if key is not None:
        make_room(_index_faces, _INDEX_FACES_KEPT)
        _index_faces[key] = (count, at)
    return Indices(count, at, keep=obj)


# GPU index interfaces read before, by their fields: (count, address)
_INDEX_FACES_KEPT = 256
_index_faces: dict[tuple, tuple[int, int]] = {}


def read_indices(obj: Any, name: str) -> Indices | None:
    """A side's indices as the caller gave them: None (slot = row), GPU-resident, or
    host integers (NumPy, CPU tensors, sequences); Indices already read pass through.
    Raises TypeError or ValueError naming ``name``."""
    if obj is None or isinstance(obj, Indices):
        return obj
    found = _gpu_indices(obj, name)
    if found is not None:
        return found
    if framework_of(obj) == "torch":
        plain = plain_host_int64(obj, 1)
        if plain is not None:
            return Indices(len(plain), host=plain)
        obj = torch_integers(obj, name, host_only=False)
    try:
        values = np.asarray(obj)
    except Exception as exc:  # noqa: BLE001 - anything NumPy cannot read
        raise TypeError(f"{name}: {type_name(obj)} is not an array of indices ({exc})") from None
    if values.ndim != 1:
        raise ValueError(f"{name}: indices must be one-dimensional, got shape {values.shape}")
    if values.size and values.dtype.kind not in "iu":
        raise TypeError(f"{name}: indices must be integers, got dtype {values.dtype}")
    if values.dtype.kind == "u" and values.size and int(values.max()) > _INT64_MAX:
        position = int(np.argmax(values > _INT64_MAX))
        raise ValueError(f"{name}[{position}] = {int(values[position])} does not fit int64")
    return Indices(len(values), host=np.ascontiguousarray(values, dtype=np.int64))


@dataclass(frozen=True)
class RowsPlan:
    """A copy_rows call's work: ``rows`` rows of ``pieces`` pieces of ``piece_bytes`` in
    each plane, and each side's layout as the kernel takes it (a row's pieces as the
    job's: a side whose row is one piece is cut into the other side's pieces)."""

    src: Layout
    dst: Layout
    rows: int
    src_indices: Indices | None
    dst_indices: Indices | None
    pieces: int
    piece_bytes: int

    @property
    def copies(self) -> int:
        return self.rows * self.pieces * self.src.num_planes

    @property
    def total_bytes(self) -> int:
        return self.rows * self.src.row_bytes * self.src.num_planes

    @property
    def host_indices(self) -> bool:
        return any(i is not None and i.host is not None for i in (self.src_indices, self.dst_indices))

    @property
    def device_indices(self) -> bool:
        return any(i is not None and i.device for i in (self.src_indices, self.dst_indices))

    def side(self, layout: Layout, indices: int) -> tuple[int, int, int, int, int, int]:
        """``layout`` as a side of the job, in the job's pieces."""
        *head, piece_stride = layout.side(indices)
        if layout.pieces == 1 and self.pieces > 1:
            piece_stride = self.piece_bytes
        return (*head, piece_stride)  # type: ignore[return-value]


def _pieces(src: Layout, dst: Layout) -> tuple[int, int]:
    if src.pieces == dst.pieces or dst.pieces == 1:
        pieces = src.pieces
    elif src.pieces == 1:
        pieces = dst.pieces
    else:
        raise ValueError(
            f"src and dst cut their rows in {src.pieces} and {dst.pieces} pieces: "
            "one side's rows must be whole, or both cut alike"
        )
    return pieces, src.row_bytes // pieces


def _check_bounds(indices: Indices | None, slots: int, name: str) -> None:
    if indices is None or indices.host is None or not indices.count:
        return
    beyond = indices.host >= slots
    if beyond.any():
        i = int(np.argmax(beyond))
        raise ValueError(
            f"{name}[{i}] = {int(indices.host[i])} is out of range: the layout "
            f"has {slots} slots (a negative index skips its row)"
        )


def _check_destinations(indices: Indices | None, name: str) -> None:
    """No destination slot written by two rows (their order on the GPU is not defined)."""
    if indices is None or indices.host is None or indices.count < 2:
        return
    live = np.flatnonzero(indices.host >= 0)
    order = live[np.argsort(indices.host[live], kind="stable")]
    twice = np.flatnonzero(indices.host[order[1:]] == indices.host[order[:-1]])
    if twice.size:
        k = int(twice[0])
        raise ValueError(
            f"{name}: rows {int(order[k])} and {int(order[k + 1])} both write slot "
            f"{int(indices.host[order[k]])}; the result would depend on their order"
        )


def plan_rows(
    src: Layout, dst: Layout, src_indices: Any = None, dst_indices: Any = None, rows: int | None = None
) -> RowsPlan:
    """Pair two layouts and the rows' indices, checking every argument (host indices
    whole) before anything is enqueued. Raises TypeError or ValueError naming it."""
    for layout, name in ((src, "src"), (dst, "dst")):
        if not isinstance(layout, Layout):
            raise TypeError(f"{name} must be a kvcopy.Layout, got {type_name(layout)}")
    src.check_current("src")
    dst.check_current("dst")
    if dst.readonly:
        raise ValueError(
            "dst: its memory is read-only (a read-only array or buffer); copy into writable memory"
        )
    clash = dst.rows_overlap
    if clash is not None:
        raise ValueError(
            f"dst: its rows overlap ({clash}); rows written there would land in no defined order"
        )
    if src.num_planes != dst.num_planes:
        raise ValueError(
            f"src has {src.num_planes} planes and dst {dst.num_planes}: a row is copied plane to plane"
        )
    if src.row_bytes != dst.row_bytes:
        raise ValueError(f"src rows are {src.row_bytes} bytes and dst rows {dst.row_bytes}")
    pieces, piece_bytes = _pieces(src, dst)
    a, b = read_indices(src_indices, "src_indices"), read_indices(dst_indices, "dst_indices")
    if a is not None and b is not None and (a.host is None) != (b.host is None):
        raise ValueError(
            "src_indices and dst_indices must both be on the GPU or both on the "
            f"host; got src_indices {_where(a)} and dst_indices {_where(b)}"
        )
    counts = {i.count for i in (a, b) if i is not None}
    if len(counts) > 1:
        a_count, b_count = (i.count for i in (a, b) if i is not None)
        raise ValueError(f"src_indices has {a_count} rows and dst_indices {b_count}")
    if rows is not None:
        rows = require_int(rows, "rows", minimum=0)
        if counts and int(rows) not in counts:
            raise ValueError(f"rows ({rows}) differs from the indices' length ({counts.pop()})")
        counts = {int(rows)}
    if not counts:
        raise ValueError("rows: give the number of rows where neither side has indices")
    n = counts.pop()
    for layout, indices, name in ((src, a, "src"), (dst, b, "dst")):
        if indices is None and n > layout.slots:
            raise ValueError(f"{name} has {layout.slots} slots and no indices: {n} rows would run past them")
        unique = name == "dst"
        if (
            indices is not None
            and indices.host is not None
            and not row_slots_ok(indices.host, layout.slots, unique)
        ):
            # (the one C pass found a problem: these say which)
            _check_bounds(indices, layout.slots, f"{name}_indices")
            if unique:
                _check_destinations(indices, "dst_indices")
    plan = RowsPlan(src, dst, n, a, b, pieces, piece_bytes)
    _check_crossing(plan)
    return plan


def _where(indices: Indices) -> str:
    return "on the host" if indices.host is not None else "on the GPU"


def rows_stream(stream: Any, layouts: tuple[Layout, ...], indices: tuple[Any, ...]) -> int:
    """The raw handle a layout transfer runs on: ``stream`` resolved, or where None the
    current stream of the framework whose index tensors (None ones skipped) or layout
    tensors were passed, else the default stream."""
    if stream is not None:
        return resolve_stream(stream)
    return current_framework_stream(
        *(i for i in indices if i is not None), *(t for layout in layouts for t in layout.keep)
    )


def _check_crossing(plan: RowsPlan) -> None:
    """Where the layouts share memory, no row may read bytes another row writes."""
    if plan.device_indices:
        return  # not readable here: the caller's to guarantee (copy_rows' docstring)
    if layouts_apart(plan.src, plan.dst):
        return
    s, d, sizes = expand(plan)
    clash = first_overlap(d, sizes)
    if clash is not None:
        raise ValueError(f"two rows write the same bytes of dst (expanded copies {clash[0]} and {clash[1]})")
    moved = s != d  # (a row copied onto itself changes nothing)
    hit = overlap_between(s[moved], sizes[moved], d[moved], sizes[moved])
    if hit is not None:
        raise ValueError(
            "src and dst share memory and a row reads bytes another row writes; "
            "the result would depend on their order"
        )


def layouts_apart(src: Layout, dst: Layout) -> bool:
    """Whether no plane of ``src`` shares a byte with a plane of ``dst``, base to extent:
    worked out once per pair of layouts (a layout never changes; an engine passes the
    same pair every step)."""
    by_dst = _apart.get(src)
    found = by_dst.get(dst) if by_dst is not None else None
    if found is None:
        found = (
            overlap_between(
                src.bases,
                np.full(src.num_planes, src.extent, np.uint64),
                dst.bases,
                np.full(dst.num_planes, dst.extent, np.uint64),
            )
            is None
        )
        with _apart_lock:
            _apart.setdefault(src, weakref.WeakKeyDictionary())[dst] = found
    return found


# whether two layouts are apart, by source then destination layout: leaves with either
_apart: "weakref.WeakKeyDictionary[Layout, weakref.WeakKeyDictionary[Layout, bool]]" = (
    weakref.WeakKeyDictionary()
)
_apart_lock = threading.Lock()


def _slots(indices: Indices | None, rows: int) -> np.ndarray:
    if indices is None:
        return np.arange(rows, dtype=np.int64)
    if indices.host is None:
        raise ValueError("indices on the GPU cannot be expanded on the host")
    return indices.host


def live_slots(plan: RowsPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, source slots, destination slots) of the plan's rows that are copied (no
    negative index on either side), in row order; host indices only."""
    s_slots, d_slots = _slots(plan.src_indices, plan.rows), _slots(plan.dst_indices, plan.rows)
    live = (s_slots >= 0) & (d_slots >= 0)
    return np.flatnonzero(live), s_slots[live], d_slots[live]


def expand(plan: RowsPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The plan as pointer copies (source, destination, size; uint64 arrays), plane by
    plane, row by row, piece by piece, rows with a negative index left out: what the
    copy engines and the pointer path take, and what the kernel computes."""
    _, s_slots, d_slots = live_slots(plan)
    piece = np.arange(plan.pieces, dtype=np.uint64)

    def addresses(layout: Layout, slots: np.ndarray, piece_stride: int) -> np.ndarray:
        rows = layout.row_addresses(slots)
        return (rows[:, :, None] + piece[None, None, :] * np.uint64(piece_stride)).ravel()

    src = addresses(plan.src, s_slots, plan.side(plan.src, 0)[-1])
    dst = addresses(plan.dst, d_slots, plan.side(plan.dst, 0)[-1])
    return src, dst, np.full(src.size, plan.piece_bytes, dtype=np.uint64)
