"""Planning of swap_blocks calls: where each tensor pair keeps its blocks, and the
checked block-id mapping. No driver calls; the engine issues the plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

import numpy as np

from kvcopy._cuda.plan_arrays import block_addresses, block_ids_ok
from kvcopy._plans.races import race_in_plan
from kvcopy.arguments import require_bool
from kvcopy._plans.copies import CopyPlan, plan_copies
from kvcopy.interop.arrays import as_block_mapping, as_list
from kvcopy.interop.frameworks import framework_of
from kvcopy.interop.kept_reads import KeptReads, may_keep
from kvcopy._runtime.kept_memory import MemoryStore, new_store
from kvcopy.interop.tensors import (
    BlockLayout,
    ConsumerStream,
    block_layout,
    flat_buffer_layout,
    is_flat_buffer,
    uniform_torch_layout,
)
from kvcopy.kept import make_room


def _split(layout: BlockLayout, block_bytes: int, name: str) -> tuple[BlockLayout, int]:
    """View a layout whose blocks hold several smaller blocks as sub-blocks."""
    if layout.block_bytes == block_bytes:
        return layout, 1
    if layout.block_bytes % block_bytes:
        raise ValueError(
            f"{name}: blocks of {layout.block_bytes} bytes do not hold whole blocks of {block_bytes} bytes"
        )
    factor = layout.block_bytes // block_bytes
    return BlockLayout(
        layout.ptr, layout.num_blocks * factor, layout.block_stride, block_bytes, layout.readonly
    ), factor


def _extent(layout: BlockLayout) -> int:
    """Bytes from a tensor's first block to the end of its last block."""
    return (layout.num_blocks - 1) * layout.block_stride + layout.block_bytes if layout.num_blocks else 0


def _name(side: str, index: int, multi: bool) -> str:
    return f"{side}[{index}]" if multi else side


def _check_ids(ids: np.ndarray, limits: np.ndarray, side: str, tensor: str, multi: bool) -> None:
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low >= 0 and high < int(limits.min()):
        return
    counts = [int(v) for v in limits]
    for k, limit in enumerate(counts):
        bad = (ids < 0) | (ids >= limit)
        if bad.any():
            pair = int(np.argmax(bad))
            raise ValueError(
                f"block_mapping[{pair}]: {side} block {int(ids[pair])} is out of "
                f"range for {_name(tensor, k, multi)}, which has {limit} blocks"
            )


def _check_unique_destinations(ids: np.ndarray) -> None:
    """Two pairs writing one block would race: reject them, naming the pairs. Only
    where block_ids_ok found a problem (the error path: a sort)."""
    if ids.size < 2:
        return
    order = np.argsort(ids, kind="stable")
    same = ids[order[1:]] == ids[order[:-1]]
    if not same.any():
        return
    k = int(np.argmax(same))
    first, second = sorted((int(order[k]), int(order[k + 1])))
    raise ValueError(
        f"block_mapping[{first}] and block_mapping[{second}] both write "
        f"destination block {int(ids[order[k]])}"
    )


@dataclass(frozen=True)
class BlockGeometry:
    """Where every tensor pair of a swap_blocks call keeps its blocks (no ids yet).

    Built once per call by :func:`block_geometry`, or once per TransferQueue.
    Columns are (T,) uint64 arrays, one entry per tensor pair.
    """

    block_bytes: int  # bytes of every copied block (after split_blocks)
    src_base: np.ndarray
    dst_base: np.ndarray
    src_extent: np.ndarray  # bytes each tensor spans
    dst_extent: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray
    src_factor: np.ndarray  # sub-blocks per block
    dst_factor: np.ndarray
    src_blocks: np.ndarray  # blocks (sub-blocks) each tensor holds
    dst_blocks: np.ndarray
    producer_streams: tuple = ()  # streams __cuda_array_interface__ producers declared
    # pending writes on: copies wait for them first
    key: tuple | None = None  # identifies the memory layout (every column above), so
    # that what depends only on it is worked out once

    @property
    def num_tensors(self) -> int:
        return int(self.src_base.shape[0])

    def reversed(self) -> "BlockGeometry":
        """The same tensor pairs with src and dst swapped. Only where either side may be
        written (geometry_and_reverse: torch tensors); a read-only side is not recorded."""
        return BlockGeometry(
            self.block_bytes,
            self.dst_base,
            self.src_base,
            self.dst_extent,
            self.src_extent,
            self.dst_stride,
            self.src_stride,
            self.dst_factor,
            self.src_factor,
            self.dst_blocks,
            self.src_blocks,
            self.producer_streams,
            None if self.key is None else ("reversed", self.key),
        )

    @cached_property
    def id_limits(self) -> tuple[int, int]:
        """The ids each side's every tensor holds: [0, fewest blocks of the side)."""
        return int(self.src_blocks.min()), int(self.dst_blocks.min())

    @cached_property
    def layout_sides(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """Each side as the layout kernel takes it (kvcopy_rows_side, rows.h, less its
        indices): (slots, page_size, page_stride, slot_stride, piece_stride), a tensor a
        plane, a block a row, a block of a split tensor a slot of a page; None where a
        side's tensors differ in stride or split (the block kernel's tensor table
        takes those). Ids are checked against every tensor, so the fewest blocks of a
        side bound its slots. Worked out once per geometry (an engine's caches keep
        theirs from call to call)."""

        def side(stride: np.ndarray, factor: np.ndarray, slots: int) -> tuple | None:
            if (stride != stride[0]).any() or (factor != factor[0]).any():
                return None
            return (slots, int(factor[0]), int(stride[0]), self.block_bytes, self.block_bytes)

        src = side(self.src_stride, self.src_factor, self.id_limits[0])
        dst = side(self.dst_stride, self.dst_factor, self.id_limits[1])
        return None if src is None or dst is None else (src, dst)

    def with_mapping(
        self, block_mapping: Any, owners: tuple = (), memory: MemoryStore | None = None
    ) -> "BlockPlan":
        """Validate ``block_mapping`` against this geometry (read from ``owners``, the
        src tensors then the dst tensors, where known; ``memory``: the store kept with
        the geometry for them, KeptGeometry). Raises TypeError/ValueError."""
        mapping = np.ascontiguousarray(as_block_mapping(block_mapping))
        if not (self.num_tensors and block_ids_ok(mapping, *self.id_limits)):
            # (the checks below say what failed)
            multi = self.num_tensors > 1
            _check_ids(mapping[:, 0], self.src_blocks, "source", "src", multi)
            _check_ids(mapping[:, 1], self.dst_blocks, "destination", "dst", multi)
            _check_unique_destinations(mapping[:, 1])
        plan = BlockPlan(self, mapping, owners, memory)
        race = race_in_plan(plan)
        if race:
            raise ValueError(f"{race}: the copies of one call run in no defined order")
        return plan


@dataclass(slots=True)
class BlockPlan:
    """A validated swap_blocks call: per-tensor geometry plus the id mapping. Never
    changed once made (not frozen: a frozen dataclass costs a microsecond to build, and
    a repeated call builds one)."""

    geometry: BlockGeometry
    mapping: np.ndarray  # (n, 2) int64, C-contiguous
    # the objects the geometry was read from, src then dst (empty where not known): the
    # engine keeps their memory's classification while they live (kvcopy._runtime.kept_memory)
    owners: tuple = field(default=(), compare=False, repr=False)
    # where the geometry was kept for unchanged torch tensors, the store kept with it for
    # what the engine finds of their memory (KeptGeometry), else None
    memory: MemoryStore | None = field(default=None, compare=False, repr=False)

    @property
    def num_pairs(self) -> int:
        return int(self.mapping.shape[0])

    @property
    def num_copies(self) -> int:
        return self.num_pairs * self.geometry.num_tensors

    @property
    def total_bytes(self) -> int:
        return self.num_copies * self.geometry.block_bytes

    def tensor_table(self, src_base: np.ndarray, dst_base: np.ndarray) -> np.ndarray:
        """(T, 6) uint64 rows of kvcopy_block_tensor, with the bases the device uses."""
        g = self.geometry
        table = np.empty((g.num_tensors, 6), dtype=np.uint64)
        for column, values in enumerate(
            (src_base, dst_base, g.src_stride, g.dst_stride, g.src_factor, g.dst_factor)
        ):
            table[:, column] = values
        return table

    def layout_sides(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """Each side as the layout kernel takes it (BlockGeometry.layout_sides)."""
        return self.geometry.layout_sides

    def copy_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every block copy as uint64 (src, dst, size) arrays, tensor-major, unmerged."""
        g = self.geometry
        src = block_addresses(self.mapping[:, 0], g.src_base, g.src_stride, g.src_factor, g.block_bytes)
        dst = block_addresses(self.mapping[:, 1], g.dst_base, g.dst_stride, g.dst_factor, g.block_bytes)
        return src, dst, np.full(src.shape[0], g.block_bytes, dtype=np.uint64)

    def copy_plan(self) -> CopyPlan:
        """Every block copy as a pointer triple (adjacent blocks merged by address)."""
        return plan_copies(*self.copy_arrays())


def crossing_pairs(forward: BlockPlan, back: BlockPlan) -> str | None:
    """Where a copy one way and a copy back issued together would race, or None.

    ``back`` copies between the same caches as ``forward``, the other way
    (TransferQueue.submit's ``back``), so block ids of one cache mean the same
    blocks in both mappings. Issued at once, neither copy is ordered before the
    other: a block that one writes and the other reads would get either value.
    Where the two caches are the same tensors, two writes of one block race too.
    Returns the first such block, named by both pairs, as a message."""
    # forward reads its source caches, which back writes (column 0 against 1); back
    # reads the destination caches, which forward writes (column 1 against 0)
    checks = [(0, 1, "source", "reads", "writes"), (1, 0, "destination", "writes", "reads")]
    g = forward.geometry
    if np.array_equal(g.src_base, g.dst_base):  # one set of caches: every id is one block
        checks.append((1, 1, "destination", "writes", "writes"))
    for mine, theirs, cache, verb, other in checks:
        block, i, j = np.intersect1d(forward.mapping[:, mine], back.mapping[:, theirs], return_indices=True)
        if block.size:
            return (
                f"block_mapping[{int(i[0])}] {verb} {cache} block {int(block[0])}, which "
                f"back[{int(j[0])}] {other}"
            )
    return None


def _pair_rows(srcs: list, dsts: list, split_blocks: bool, stream: ConsumerStream) -> tuple[list, int, tuple]:
    """Per-tensor-pair geometry rows, tensor by tensor (any framework, mixed shapes),
    the block size, and the producer streams the tensors declared."""
    multi = len(srcs) > 1
    rows: list[tuple] = []
    producers: list[int] = []
    block: int | None = None
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        ls, ld = _layouts_of_pair(s, d, i, multi, stream)
        producers += [p for p in (ls.stream, ld.stream) if p is not None and p not in producers]
        if ld.readonly:
            raise ValueError(f"{_name('dst', i, multi)} is read-only")
        if ls.block_bytes == ld.block_bytes:
            pair_block, s_factor, d_factor = ls.block_bytes, 1, 1
        else:
            if not split_blocks:
                raise ValueError(
                    f"{_name('src', i, multi)} has blocks of {ls.block_bytes} bytes but "
                    f"{_name('dst', i, multi)} of {ld.block_bytes}; pass "
                    "split_blocks=True if the larger blocks hold several of the smaller ones"
                )
            pair_block = min(ls.block_bytes, ld.block_bytes)
            s_factor = _split(ls, pair_block, _name("src", i, multi))[1]
            d_factor = _split(ld, pair_block, _name("dst", i, multi))[1]
        if block is None:
            block = pair_block
        elif pair_block != block:
            raise ValueError(
                f"{_name('src', i, multi)}/{_name('dst', i, multi)} copy blocks of "
                f"{pair_block} bytes, the tensors before them blocks of {block} bytes; "
                "call swap_blocks once per size"
            )
        rows.append(
            (
                ls.ptr,
                ld.ptr,
                _extent(ls),
                _extent(ld),
                ls.block_stride,
                ld.block_stride,
                s_factor,
                d_factor,
                ls.num_blocks * s_factor,
                ld.num_blocks * d_factor,
            )
        )
    assert block is not None  # block_geometry refuses empty lists
    return rows, block, tuple(producers)


def _layouts_of_pair(
    s: Any, d: Any, i: int, multi: bool, stream: ConsumerStream
) -> tuple[BlockLayout, BlockLayout]:
    """Both layouts of pair i; a flat buffer takes its block size from the other side."""
    try:
        src_flat, dst_flat = is_flat_buffer(s), is_flat_buffer(d)
        if src_flat and dst_flat:
            raise TypeError(
                "src and dst are both flat buffers: wrap one in "
                "kvcopy.block_view(buffer, block_bytes) to give the block size"
            )
        if src_flat:
            ld = block_layout(d, "dst", stream)
            ls = flat_buffer_layout(s, ld.block_bytes, "src")
        else:
            ls = block_layout(s, "src", stream)
            ld = flat_buffer_layout(d, ls.block_bytes, "dst") if dst_flat else block_layout(d, "dst", stream)
    except (TypeError, ValueError) as exc:  # re-raise naming the tensor's position
        message = str(exc)
        for side in ("src", "dst"):
            message = message.replace(f"{side}:", f"{_name(side, i, multi)}:", 1)
        raise type(exc)(message) from None
    return ls, ld


@dataclass(frozen=True)
class KeptGeometry:
    """A geometry read from torch tensors or arrays, kept while they are unchanged
    (kvcopy.interop.kept_reads), and the store for what the engine finds of their
    memory (kvcopy._runtime.kept_memory.find_in): unchanged live tensors and arrays
    hold the same memory, so it is classified once."""

    geometry: BlockGeometry
    memory: MemoryStore = field(default_factory=new_store)


def block_geometry(
    src: Any, dst: Any, *, split_blocks: bool = False, stream: ConsumerStream = None
) -> BlockGeometry:
    """Validate the tensors of a swap_blocks call (no driver needed). Raises TypeError/ValueError.
    See geometry_and_memory."""
    return geometry_and_memory(src, dst, split_blocks=split_blocks, stream=stream)[0]


GeometryAndMemory = tuple[BlockGeometry, Optional[MemoryStore]]


def geometry_and_memory(
    src: Any, dst: Any, *, split_blocks: bool = False, stream: ConsumerStream = None
) -> GeometryAndMemory:
    """The geometry of a swap_blocks call's tensors, and where it was kept (torch
    tensors, NumPy arrays, array-interface producers that name no stream: see
    kvcopy.interop.kept_reads), the store kept with it for their memory (KeptGeometry;
    else None).
    Raises TypeError/ValueError.

    Runs on every swap_blocks call, so a list of torch tensors of one shape,
    stride and dtype per side (the usual per-layer cache) is read in one
    vectorised step; anything else tensor by tensor. ``stream`` is the raw
    handle the copy will run on, or a function giving it, given to DLPack producers
    of GPU memory so that they order their pending writes before it (None: no
    ordering is asked of them; interop.tensors.ConsumerStream).
    """
    split_blocks = require_bool(split_blocks, "split_blocks")
    srcs, dsts = as_list(src), as_list(dst)
    if not srcs:
        raise ValueError("src: no tensors given")
    if len(srcs) != len(dsts):
        raise ValueError(f"src and dst hold different numbers of tensors: {len(srcs)} and {len(dsts)}")
    if may_keep(srcs[0]) and may_keep(dsts[0]):
        # (an engine passes the same caches every step: read them once while unchanged)
        kept, held = _kept_geometries.lookup(
            (*srcs, *dsts),
            ("forward", len(srcs), split_blocks),
            lambda: KeptGeometry(_read_geometry(srcs, dsts, split_blocks, stream)),
        )
        # (a store for memory only where the geometry is kept: else the engine's
        # kept_memory, keyed by the tensors, knows them again)
        return kept.geometry, kept.memory if held else None
    return _read_geometry(srcs, dsts, split_blocks, stream), None


def _read_geometry(srcs: list, dsts: list, split_blocks: bool, stream: ConsumerStream) -> BlockGeometry:
    """block_geometry read from the tensors themselves."""
    fast = _uniform_geometry(srcs, dsts)
    if fast is not None:
        return fast
    rows, block, producers = _pair_rows(srcs, dsts, split_blocks, stream)
    table = np.array(rows, dtype=np.uint64)
    (
        src_base,
        dst_base,
        src_extent,
        dst_extent,
        src_stride,
        dst_stride,
        src_factor,
        dst_factor,
        src_blocks,
        dst_blocks,
    ) = (np.ascontiguousarray(table[:, i]) for i in range(10))
    return BlockGeometry(
        block,
        src_base,
        dst_base,
        src_extent,
        dst_extent,
        src_stride,
        dst_stride,
        src_factor,
        dst_factor,
        src_blocks,
        dst_blocks,
        producers,
        ("rows", block, table.tobytes()),
    )


def _uniform_geometry(srcs: list, dsts: list) -> BlockGeometry | None:
    """Geometry of two lists of torch tensors with one layout per side and equal
    block sizes, from one layout per side plus every tensor's address; else None."""
    side_s, side_d = uniform_torch_layout(srcs), uniform_torch_layout(dsts)
    if side_s is None or side_d is None:
        return None
    (ls, ptr_s), (ld, ptr_d) = side_s, side_d
    if ls.block_bytes != ld.block_bytes:
        return None
    key = ("uniform", ls, ld, ptr_s.tobytes(), ptr_d.tobytes())
    found = _uniform_geometries.get(key)  # (an engine passes the same caches every step)
    if found is not None:
        return found
    n = len(srcs)

    def column(value: int) -> np.ndarray:
        return np.full(n, value, dtype=np.uint64)

    geometry = BlockGeometry(
        ls.block_bytes,
        ptr_s,
        ptr_d,
        column(_extent(ls)),
        column(_extent(ld)),
        column(ls.block_stride),
        column(ld.block_stride),
        column(1),
        column(1),
        column(ls.num_blocks),
        column(ld.num_blocks),
        key=key,
    )
    make_room(_uniform_geometries, _GEOMETRIES_KEPT)
    _uniform_geometries[key] = geometry
    return geometry


# Geometries of uniform torch lists by what they were read from (layouts and addresses:
# the whole of a geometry), so that a repeated call builds none of its columns again
# (views made anew at every call are new objects, read again); and geometries of torch
# tensors by the tensors themselves while they are unchanged, so that a repeated call
# reads none of them again. Enough for two a layer of a 128-layer model called layer
# by layer, both ways.
_GEOMETRIES_KEPT = 1024
_uniform_geometries: dict[tuple, BlockGeometry] = {}
_kept_geometries = KeptReads(_GEOMETRIES_KEPT)


def geometry_and_reverse(src: Any, dst: Any) -> tuple[GeometryAndMemory, GeometryAndMemory] | None:
    """The geometry of src -> dst and of dst -> src from one reading of the tensors, each
    with its store for their memory where kept (see geometry_and_memory), for lists of torch tensors of one
    layout per side and one block size (the usual per-layer caches: reading them is
    most of a swap_blocks call's CPU time); else None, and each direction is to be read
    by block_geometry."""
    srcs, dsts = as_list(src), as_list(dst)
    if not srcs or len(srcs) != len(dsts) or framework_of(srcs[0]) != "torch":
        return None

    def read() -> tuple[KeptGeometry, KeptGeometry] | None:
        forward = _uniform_geometry(srcs, dsts)
        return None if forward is None else (KeptGeometry(forward), KeptGeometry(forward.reversed()))

    found, held = _kept_geometries.lookup((*srcs, *dsts), ("both", len(srcs)), read)
    if found is None:
        return None
    # (a store for memory only where the geometries are kept, as geometry_and_memory)
    forward, back = found
    return (forward.geometry, forward.memory if held else None), (
        back.geometry,
        back.memory if held else None,
    )


def kept_geometry(srcs: list, dsts: list, split_blocks: bool) -> GeometryAndMemory | None:
    """The geometry an earlier call kept for these torch tensors and the store kept
    with it (geometry_and_memory), where they are unchanged; else None, having read
    nothing from them."""
    if not srcs or len(srcs) != len(dsts):
        return None
    kept = _kept_geometries.peek((*srcs, *dsts), ("forward", len(srcs), split_blocks))
    return None if kept is None else (kept.geometry, kept.memory)


def plan_blocks(
    src: Any, dst: Any, block_mapping: Any, *, split_blocks: bool = False, stream: ConsumerStream = None
) -> BlockPlan:
    """Validate a swap_blocks call (no driver needed). Raises TypeError/ValueError."""
    geometry, memory = geometry_and_memory(src, dst, split_blocks=split_blocks, stream=stream)
    return geometry.with_mapping(block_mapping, (*as_list(src), *as_list(dst)), memory)


def plan_block_copies(src: Any, dst: Any, block_mapping: Any, *, split_blocks: bool = False):
    """The pointer-level plan of a swap_blocks call, and the tensors (for stream lookup)."""
    return plan_blocks(src, dst, block_mapping, split_blocks=split_blocks).copy_plan(), as_list(
        src
    ) + as_list(dst)


__all__ = [
    "BlockGeometry",
    "BlockPlan",
    "block_geometry",
    "crossing_pairs",
    "geometry_and_memory",
    "geometry_and_reverse",
    "kept_geometry",
    "plan_block_copies",
    "plan_blocks",
]
