"""swap_blocks: copy blocks of paged KV caches by block id."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kvcopy import engine
from kvcopy.plan import plan_copies
from kvcopy.streams import current_framework_stream, resolve_stream
from kvcopy.tensors import BlockLayout, block_layout


def _as_list(obj: Any) -> list:
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def as_block_mapping(block_mapping: Any) -> np.ndarray:
    """An (n, 2) int64 array of [source block, destination block] pairs."""
    module = type(block_mapping).__module__ or ""
    if module.startswith("torch"):
        block_mapping = block_mapping.detach().cpu().numpy()
    elif module.startswith("cupy"):
        block_mapping = block_mapping.get()
    elif isinstance(block_mapping, (list, tuple)):
        for i, pair in enumerate(block_mapping):
            if (not isinstance(pair, (list, tuple, np.ndarray)) or len(pair) != 2
                    or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in pair)):
                raise TypeError(f"block_mapping[{i}] must be a pair of ints, got {pair!r}")
    arr = np.asarray(block_mapping)
    if arr.size == 0:
        return np.empty((0, 2), dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"block_mapping: expected integer block ids, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"block_mapping: expected shape (n, 2), got {arr.shape}")
    return arr.astype(np.int64, copy=False)


def _split(layout: BlockLayout, block_bytes: int, name: str) -> tuple[BlockLayout, int]:
    """View a layout whose blocks hold several smaller blocks as sub-blocks."""
    if layout.block_bytes == block_bytes:
        return layout, 1
    if layout.block_bytes % block_bytes:
        raise ValueError(f"{name}: blocks of {layout.block_bytes} bytes do not hold whole "
                         f"blocks of {block_bytes} bytes")
    factor = layout.block_bytes // block_bytes
    return BlockLayout(layout.ptr, layout.num_blocks * factor, layout.block_stride, block_bytes,
                       layout.readonly), factor


def _addresses(layout: BlockLayout, factor: int, ids: np.ndarray) -> np.ndarray:
    ids = ids.astype(np.uint64)
    if factor == 1:
        return np.uint64(layout.ptr) + ids * np.uint64(layout.block_stride)
    f = np.uint64(factor)
    return (np.uint64(layout.ptr) + (ids // f) * np.uint64(layout.block_stride)
            + (ids % f) * np.uint64(layout.block_bytes))


def _check_ids(ids: np.ndarray, limit: int, side: str, name: str) -> None:
    bad = (ids < 0) | (ids >= limit)
    if bad.any():
        pair = int(np.argmax(bad))
        raise ValueError(f"block_mapping[{pair}]: {side} block {int(ids[pair])} is out of range "
                         f"for {name}, which has {limit} blocks")


def plan_block_copies(src: Any, dst: Any, block_mapping: Any, *, split_blocks: bool = False):
    """Validate and build the copy plan of a swap_blocks call (no driver needed)."""
    srcs, dsts = _as_list(src), _as_list(dst)
    if not srcs:
        raise ValueError("src: no tensors given")
    if len(srcs) != len(dsts):
        raise ValueError(f"src and dst hold different numbers of tensors: {len(srcs)} and {len(dsts)}")
    mapping = as_block_mapping(block_mapping)
    src_ptrs, dst_ptrs, sizes = [], [], []
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        s_name, d_name = (f"src[{i}]", f"dst[{i}]") if len(srcs) > 1 else ("src", "dst")
        s_layout, d_layout = block_layout(s, s_name), block_layout(d, d_name)
        if d_layout.readonly:
            raise ValueError(f"{d_name} is read-only")
        block = min(s_layout.block_bytes, d_layout.block_bytes)
        if s_layout.block_bytes != d_layout.block_bytes and not split_blocks:
            raise ValueError(f"{s_name} has blocks of {s_layout.block_bytes} bytes but {d_name} of "
                             f"{d_layout.block_bytes}; pass split_blocks=True if the larger blocks "
                             "hold several of the smaller ones")
        s_layout, s_factor = _split(s_layout, block, s_name)
        d_layout, d_factor = _split(d_layout, block, d_name)
        _check_ids(mapping[:, 0], s_layout.num_blocks, "source", s_name)
        _check_ids(mapping[:, 1], d_layout.num_blocks, "destination", d_name)
        src_ptrs.append(_addresses(s_layout, s_factor, mapping[:, 0]))
        dst_ptrs.append(_addresses(d_layout, d_factor, mapping[:, 1]))
        sizes.append(np.full(len(mapping), block, dtype=np.uint64))
    return plan_copies(np.concatenate(src_ptrs), np.concatenate(dst_ptrs), np.concatenate(sizes)), srcs + dsts


def swap_blocks(src: Any, dst: Any, block_mapping: Any, *, stream: Any = None,
                method: str = "auto", split_blocks: bool = False) -> str:
    """Copy blocks ``block_mapping[k, 0]`` of ``src`` to blocks ``block_mapping[k, 1]`` of ``dst``.

    ``src`` and ``dst`` are a tensor/array or equal-length sequences of them
    (one per layer, or K and V views), of any framework: torch (CUDA, pinned or
    plain CPU), CuPy, NumPy (pinned with kvcopy.pinned_empty or registered, or
    pageable), JAX (as sources), DLPack or array-interface producers. Dimension
    0 is the block index and each block must be contiguous. All copies of all
    tensors go out as one batch. With ``split_blocks``, a side whose blocks
    are k times larger is addressed in sub-blocks: its ids count sub-blocks,
    so id ``b * k + j`` is the j-th part of block b (vLLM's block_size_factor).

    Returns the method that ran ('kernel', 'batch', 'loop', or 'none').

    Raises:
        TypeError, ValueError: bad tensors or ids, before anything is copied.
    """
    engine.check_method(method)
    plan, tensors = plan_block_copies(src, dst, block_mapping, split_blocks=split_blocks)
    handle = resolve_stream(stream) if stream is not None else current_framework_stream(*tensors)
    return engine.execute(plan, handle, method)


__all__ = ["as_block_mapping", "plan_block_copies", "swap_blocks"]
