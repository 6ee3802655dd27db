"""Paged KV caches as layouts: where every slot's row lies, plane by plane.

A plane is one part of a cache that every slot has a row in: a layer's K or V, one
layer of an MLA cache, a run of fragments. Piece j of slot s's row in plane p is

    bases[p] + (s // page_size) * page_stride + (s % page_size) * slot_stride
             + j * piece_stride

and ``row_bytes // pieces`` bytes long. kvcopy.copy_rows moves rows between two
layouts of as many planes and the same row bytes; the copy kernel computes each
address from these numbers and the indices (kvcopy._engine.rows).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Sequence

import numpy as np

from kvcopy._cuda.tensor_stamps import array_stamp
from kvcopy._plans.row_overlaps import overlapping_rows
from kvcopy.arguments import require_bool, require_int
from kvcopy.interop.frameworks import framework_of
from kvcopy.interop.kept_reads import stamp_of
from kvcopy.interop.tensors import strided_access

_U64_MAX = (1 << 64) - 1  # slots, sizes and strides are 64-bit on the GPU


def _seen_as(kept: Any) -> Any:
    """What Layout.moved compares ``kept`` with later: a torch tensor's (data_ptr, shape),
    an array's stamp (kept_reads.stamp_of), else None."""
    if framework_of(kept) == "torch":
        return kept.data_ptr(), kept.shape
    return stamp_of(kept)


def _addresses(bases: Any) -> np.ndarray:
    """``bases`` as an array of plane addresses: 1-D integers, at least one, all positive
    (TypeError or ValueError naming ``bases``)."""
    found = np.asarray(bases)
    if found.ndim != 1 or found.dtype.kind not in "iu":
        raise TypeError("bases must be a 1-D sequence of integer addresses")
    if len(found) == 0:
        raise ValueError("bases: a layout needs at least one plane")
    if int(found.min()) <= 0:  # (one reduction: signed or unsigned)
        raise ValueError("bases: every base address must be a positive address")
    return found


@dataclass(frozen=True, eq=False)
class Layout:
    """Where a cache's rows are (see the module's docstring for the address of a row).

    Build one with Layout.of (tensors or arrays of any framework kvcopy reads) or
    Layout.from_pointers (a custom allocator's addresses). A layout holds the objects
    it was built from (``keep``), so their memory lives as long as it does, and
    remembers where their torch tensors' memory was: a layout whose tensor was since
    moved (``resize_``, ``set_``) is refused rather than written where that tensor no
    longer is. Every row lies below 2**64; ``bases`` is read-only. A destination's rows
    must not overlap one another (copy_rows refuses one whose rows do); a source's may.
    ``readonly``: memory that must not be written (a read-only array), refused as a
    destination."""

    bases: np.ndarray  # uint64, one base address per plane
    slots: int  # slots per plane: an index must be below this
    row_bytes: int
    page_size: int = 1
    page_stride: int = 0
    slot_stride: int = 0
    pieces: int = 1
    piece_stride: int = 0
    keep: tuple = field(default=(), repr=False)
    readonly: bool = False
    # what each object in ``keep`` was when the layout was first made (a layout derived
    # from it by dataclasses.replace keeps its parent's): a torch tensor's (data_ptr,
    # shape), an array's array_stamp (its address and geometry), None for other objects;
    # empty where ``keep`` holds nothing to check
    seen: tuple = field(default=(), repr=False)

    def __post_init__(self) -> None:
        # Checked here, so that a Layout built directly is as sound as from_pointers'.
        found = _addresses(self.bases)
        bases = found.astype(np.uint64)  # (a copy: the caller's array stays the caller's)
        bases.flags.writeable = False
        object.__setattr__(self, "bases", bases)
        for name in ("slots", "row_bytes", "page_size", "pieces"):
            require_int(getattr(self, name), name, minimum=1, maximum=_U64_MAX)
        for name in ("page_stride", "slot_stride", "piece_stride"):
            require_int(getattr(self, name), name, minimum=0, maximum=_U64_MAX)
        if self.row_bytes % self.pieces:
            raise ValueError(f"row_bytes ({self.row_bytes}) must be a multiple of pieces ({self.pieces})")
        top = int(found.max()) + self.extent
        if top > _U64_MAX + 1:
            raise ValueError(f"bases: rows reach {top:#x}, past the end of the 64-bit address space")
        if not isinstance(self.keep, tuple):
            raise TypeError(f"keep must be a tuple, got {type(self.keep).__name__}")
        if not self.seen:  # (a new layout: where its tensors are now)
            object.__setattr__(self, "seen", tuple(map(_seen_as, self.keep)))
        elif len(self.seen) != len(self.keep):  # (its objects dropped: nothing to check)
            object.__setattr__(self, "seen", ())

    def moved(self) -> int | None:
        """The position in ``keep`` of a torch tensor whose memory is no longer where it
        was when the layout was made, or of an array changed since (another address,
        shape, strides, type or writability), or None."""
        for k, fact in enumerate(self.seen):
            if fact is not None:
                kept = self.keep[k]
                if type(fact[0]) is not int:  # (an array: its stamp whole)
                    if array_stamp(kept) != fact:
                        return k
                elif kept.data_ptr() != fact[0] or kept.shape != fact[1]:
                    return k
        return None

    def check_current(self, name: str) -> None:
        """Raise ValueError naming ``name`` where one of the layout's tensors moved."""
        k = self.moved()
        if k is not None:
            raise ValueError(
                f"{name}: tensor {k} of the layout has moved or changed shape "
                "since the layout was made (resize_ or set_; an array's shape, "
                "strides, dtype or writability): make the layout again"
            )

    @cached_property
    def rows_overlap(self) -> str | None:
        """What overlaps where two rows (or planes) share bytes, None where none do."""
        return overlapping_rows(self)

    @property
    def num_planes(self) -> int:
        return len(self.bases)

    @property
    def piece_bytes(self) -> int:
        return self.row_bytes // self.pieces

    @cached_property
    def extent(self) -> int:
        """Bytes from a plane's base to the end of its last row."""
        last = self.slots - 1
        return (
            (last // self.page_size) * self.page_stride
            + (last % self.page_size) * self.slot_stride
            + (self.pieces - 1) * self.piece_stride
            + self.piece_bytes
        )

    def row_addresses(self, slots: np.ndarray) -> np.ndarray:
        """Where each slot's row (its first piece) starts in each plane: a uint64 array
        of shape (planes, len(slots)) for non-negative ``slots``."""
        slots = np.asarray(slots).astype(np.uint64)
        size = np.uint64(self.page_size)
        within = (slots // size) * np.uint64(self.page_stride) + (slots % size) * np.uint64(self.slot_stride)
        return self.bases[:, None] + within[None, :]

    def select(self, planes: Any) -> "Layout":
        """The same layout over some of its planes (an int, a slice or a sequence of
        ints, negative ones counting from the end). Raises TypeError or ValueError
        naming ``planes``."""
        count = self.num_planes
        if isinstance(planes, slice):
            picked = list(range(count))[planes]
        else:
            items = (
                planes.ravel().tolist()
                if isinstance(planes, np.ndarray)
                else list(planes)
                if isinstance(planes, (list, tuple, range))
                else [planes]
            )
            for item in items:
                if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, np.integer)):
                    raise TypeError(
                        f"planes: expected ints, a slice or a sequence of ints; "
                        f"got {type(item).__name__} ({item!r})"
                    )
                if not -count <= item < count:
                    raise ValueError(f"planes: {item} is out of range for {count} planes")
            picked = [int(item) % count for item in items]
        if not picked:
            raise ValueError("planes: selects no plane")
        return replace(self, bases=self.bases[picked])

    def side(self, indices: int) -> tuple[int, int, int, int, int, int]:
        """This layout as one side of the layout kernel's job (kvcopy_rows_side, rows.h),
        its rows' slots read from ``indices`` (a device address; 0: slot = row)."""
        return (indices, self.slots, self.page_size, self.page_stride, self.slot_stride, self.piece_stride)

    @classmethod
    def from_pointers(
        cls,
        bases: Sequence[int] | np.ndarray,
        *,
        slots: int,
        row_bytes: int,
        page_size: int = 1,
        page_stride: int | None = None,
        slot_stride: int | None = None,
        pieces: int = 1,
        piece_stride: int | None = None,
        keep: tuple = (),
        readonly: bool = False,
    ) -> "Layout":
        """A layout from raw addresses (one base per plane) and byte strides.

        Defaults: rows back to back (``slot_stride = row_bytes``), pages of ``page_size``
        slots back to back, a row's pieces back to back. ``readonly``: memory that must
        not be written, refused as a destination. Raises TypeError or ValueError naming
        the argument."""
        found = _addresses(bases)
        slots = require_int(slots, "slots", minimum=1, maximum=_U64_MAX)
        row_bytes = require_int(row_bytes, "row_bytes", minimum=1, maximum=_U64_MAX)
        page_size = require_int(page_size, "page_size", minimum=1, maximum=_U64_MAX)
        pieces = require_int(pieces, "pieces", minimum=1, maximum=_U64_MAX)
        if row_bytes % pieces:
            raise ValueError(f"row_bytes ({row_bytes}) must be a multiple of pieces ({pieces})")
        piece = row_bytes // pieces
        piece_stride = require_int(
            piece if piece_stride is None else piece_stride, "piece_stride", minimum=0, maximum=_U64_MAX
        )
        slot_stride = require_int(
            row_bytes if slot_stride is None else slot_stride, "slot_stride", minimum=0, maximum=_U64_MAX
        )
        if page_size == 1:  # every slot is its own page
            page_stride = slot_stride if page_stride is None else page_stride
        page_stride = require_int(
            page_size * slot_stride if page_stride is None else page_stride,
            "page_stride",
            minimum=0,
            maximum=_U64_MAX,
        )
        return cls(
            found,
            slots,
            row_bytes,
            page_size,
            page_stride,
            slot_stride,
            pieces,
            piece_stride,
            tuple(keep),
            require_bool(readonly, "readonly"),
        )

    @classmethod
    def of(
        cls,
        tensors: Any,
        *,
        slot: int,
        page: int | None = None,
        planes: Sequence[int] = (),
        pieces: int | None = None,
        name: str = "tensors",
    ) -> "Layout":
        """The layout of one tensor or a list of tensors of one shape, strides and dtype
        (one per layer, say), by naming what each dimension is:

        - ``slot``: the dimension a token (or a block, where a row is a whole block)
          indexes; with ``page``, the token's place within its page;
        - ``page``: the page (block) dimension of a paged cache, if any;
        - ``planes``: dimensions every slot has a row in each index of (K/V, layers),
          outermost first; a list of tensors is outermost of all;
        - ``pieces``: a dimension that cuts a row into strided pieces (the heads of an
          HND cache, whose heads lie page_size tokens apart);
        - every other dimension is the row itself and must be contiguous.

        For example vLLM's flash-attention caches, one ``[2, blocks, block_size, heads,
        head_size]`` tensor per layer: ``Layout.of(caches, planes=(0,), page=1, slot=2)``;
        LMCache's chunk ``[2, layers, tokens, hidden]`` in the same plane order:
        ``Layout.of(chunk, planes=(1, 0), slot=2)``."""
        items = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        if not items:
            raise ValueError(f"{name}: no tensor given")
        found = [strided_access(t, f"{name}[{i}]" if len(items) > 1 else name) for i, t in enumerate(items)]
        _, shape, strides, itemsize, _ = found[0]
        for i, (_, s, st, size, _) in enumerate(found[1:], 1):
            if (s, st, size) != (shape, strides, itemsize):
                raise ValueError(
                    f"{name}[{i}]: shape {s}, strides {st} and itemsize {size} "
                    f"differ from {name}[0]'s {shape}, {strides}, {itemsize}"
                )
        ndim = len(shape)
        named = {"slot": slot, "page": page, "pieces": pieces}
        roles: dict[int, str] = {}
        for role, dim in [*named.items(), *((f"planes[{k}]", d) for k, d in enumerate(planes))]:
            if dim is None:
                continue
            if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
                raise ValueError(f"{role}: {dim!r} is not a dimension of shape {shape}")
            dim %= ndim
            if dim in roles:
                raise ValueError(f"{role}: dimension {dim} is already {roles[dim]}")
            roles[dim] = role
        if any(strides[d] < 0 for d in range(ndim)):
            raise ValueError(f"{name}: negative strides {strides} are not supported")
        row_dims = [d for d in range(ndim) if d not in roles]
        piece = itemsize
        for d in reversed(row_dims):
            if shape[d] != 1 and strides[d] != piece:
                raise ValueError(
                    f"{name}: the row dimensions {tuple(row_dims)} of shape {shape} "
                    f"must be contiguous; strides are {strides} bytes"
                )
            piece *= shape[d]
        plane_dims = [d % ndim for d in planes]
        bases = [
            ptr + sum(i * strides[d] for i, d in zip(index, plane_dims))
            for ptr, *_ in found
            for index in itertools.product(*(range(shape[d]) for d in plane_dims))
        ]
        slot_d, count = slot % ndim, pieces
        kwargs: dict[str, int] = {"slot_stride": strides[slot_d]}
        if page is not None:
            kwargs.update(page_size=shape[slot_d], page_stride=strides[page % ndim])
        slots = shape[slot_d] * (shape[page % ndim] if page is not None else 1)
        n_pieces = 1 if count is None else shape[count % ndim]
        if count is not None:
            kwargs["piece_stride"] = strides[count % ndim]
        if slots == 0 or piece == 0 or n_pieces == 0:
            raise ValueError(f"{name}: shape {shape} holds no rows")
        return cls.from_pointers(
            np.array(bases, dtype=np.uint64),
            slots=slots,
            row_bytes=piece * n_pieces,
            pieces=n_pieces,
            keep=tuple(items),
            readonly=any(f[4] for f in found),
            **kwargs,
        )
