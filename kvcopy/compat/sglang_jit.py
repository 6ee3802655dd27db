"""Drop-ins for SGLang's JIT HiCache transfers (``sglang.jit_kernel.hicache``), the
kernels its HiCache controller loads in place of ``sgl_kernel.kvcacheio`` where an
item's size allows.

Arguments come destination first, as SGLang's do. ``transfer_hicache_one_layer``
moves one layer's K and V items between tensors seen as ``[slots, element_dim]``
(``element_dim`` defaults to the destination's last dimension; the slots may be
further apart than an item, as in a pool sliced to a rank's heads);
``transfer_hicache_all_layer`` moves every layer, each side given as tables of
per-layer addresses (K's and V's), items ``element_size`` bytes every
``kv_cache_*_stride_bytes``. The ``_mla`` forms have one cache (one table). Indices
are int32 or int64, on the GPU or the host, item ``indices_src[i]`` going to slot
``indices_dst[i]``; GPU indices of int32 are widened on torch's current stream.
``unroll`` and ``block_quota`` are SGLang's launch shape, accepted and left to
kvcopy's policy. Each call is one kvcopy.copy_rows on torch's current stream.
SGLang's staged write-back forms (``*_staged_lf_pf``) are not provided: kvcopy's
copy_rows stages by itself where that is faster.
"""

from __future__ import annotations

from typing import Any

from kvcopy.arguments import require_int
from kvcopy.compat.kept_layouts import copy_kept, kept_layout, layer_tables
from kvcopy.layouts import Layout


def _items(tensors: tuple, names: tuple, element_dim: Any) -> Layout:
    """Tensors as planes of ``[slots, element_dim]`` items (SGLang's ``view(-1, dim)``)."""
    import torch

    for t, name in zip(tensors, names):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dim = require_int(element_dim, "element_dim", minimum=1)

    def build() -> Layout:
        views = []
        for t, name in zip(tensors, names):
            try:
                views.append(t if t.dim() == 2 and t.shape[1] == dim else t.view(-1, dim))
            except RuntimeError:
                raise ValueError(
                    f"{name}: shape {tuple(t.shape)} strides {tuple(t.stride())} "
                    f"cannot be seen as items of {dim} elements"
                ) from None
        return Layout.of(views, slot=0, name=names[0])

    return kept_layout(tensors, ("jit items", dim), build)


def _widened(indices: Any) -> Any:
    """GPU indices as int64 (kvcopy's kernel reads int64 in place); others as given."""
    import torch

    if isinstance(indices, torch.Tensor) and indices.is_cuda and indices.dtype == torch.int32:
        return indices.to(torch.int64)
    return indices


def _element_size(element_size: Any, src_stride: int, dst_stride: int) -> int:
    if element_size is None:  # (SGLang's rule: both sides contiguous)
        if src_stride != dst_stride:
            raise ValueError(
                f"element_size is needed where the strides differ ({src_stride} and {dst_stride} bytes)"
            )
        return src_stride
    return require_int(element_size, "element_size", minimum=1)


def _stride(value: Any, name: str, item: int) -> int:
    stride = require_int(value, name, minimum=1)
    if stride < item:
        raise ValueError(f"{name} ({stride}) is smaller than element_size ({item}): items would overlap")
    return stride


def transfer_hicache_one_layer(
    k_cache_dst,
    v_cache_dst,
    indices_dst,
    k_cache_src,
    v_cache_src,
    indices_src,
    *,
    element_dim=None,
    unroll=None,
    block_quota=None,
) -> None:
    """One layer's K and V items ``indices_src[i]`` -> ``indices_dst[i]``."""
    dim = k_cache_dst.size(-1) if element_dim is None and hasattr(k_cache_dst, "size") else element_dim
    copy_kept(
        _items((k_cache_src, v_cache_src), ("k_cache_src", "v_cache_src"), dim),
        _items((k_cache_dst, v_cache_dst), ("k_cache_dst", "v_cache_dst"), dim),
        _widened(indices_src),
        _widened(indices_dst),
        engine=(k_cache_src, k_cache_dst),
    )


def transfer_hicache_one_layer_mla(
    cache_dst, indices_dst, cache_src, indices_src, *, element_dim=None, unroll=None, block_quota=None
) -> None:
    """One layer's MLA items ``indices_src[i]`` -> ``indices_dst[i]``."""
    dim = cache_dst.size(-1) if element_dim is None and hasattr(cache_dst, "size") else element_dim
    copy_kept(
        _items((cache_src,), ("cache_src",), dim),
        _items((cache_dst,), ("cache_dst",), dim),
        _widened(indices_src),
        _widened(indices_dst),
        engine=(cache_src, cache_dst),
    )


def transfer_hicache_all_layer(
    k_ptr_dst,
    v_ptr_dst,
    indices_dst,
    k_ptr_src,
    v_ptr_src,
    indices_src,
    *,
    kv_cache_src_stride_bytes,
    kv_cache_dst_stride_bytes,
    element_size=None,
    unroll=None,
    block_quota=None,
) -> None:
    """Every layer's K and V items, the layers given by address tables."""
    src_stride = require_int(kv_cache_src_stride_bytes, "kv_cache_src_stride_bytes", minimum=1)
    dst_stride = require_int(kv_cache_dst_stride_bytes, "kv_cache_dst_stride_bytes", minimum=1)
    item = _element_size(element_size, src_stride, dst_stride)
    _stride(src_stride, "kv_cache_src_stride_bytes", item)
    _stride(dst_stride, "kv_cache_dst_stride_bytes", item)
    copy_kept(
        layer_tables((k_ptr_src, v_ptr_src), ("k_ptr_src", "v_ptr_src"), item, src_stride),
        layer_tables((k_ptr_dst, v_ptr_dst), ("k_ptr_dst", "v_ptr_dst"), item, dst_stride),
        _widened(indices_src),
        _widened(indices_dst),
        engine=(k_ptr_src, k_ptr_dst),
    )


def transfer_hicache_all_layer_mla(
    ptr_dst,
    indices_dst,
    ptr_src,
    indices_src,
    *,
    cache_src_stride_bytes,
    cache_dst_stride_bytes,
    element_size=None,
    unroll=None,
    block_quota=None,
) -> None:
    """Every layer's MLA items, the layers given by an address table."""
    src_stride = require_int(cache_src_stride_bytes, "cache_src_stride_bytes", minimum=1)
    dst_stride = require_int(cache_dst_stride_bytes, "cache_dst_stride_bytes", minimum=1)
    item = _element_size(element_size, src_stride, dst_stride)
    _stride(src_stride, "cache_src_stride_bytes", item)
    _stride(dst_stride, "cache_dst_stride_bytes", item)
    copy_kept(
        layer_tables((ptr_src,), ("ptr_src",), item, src_stride),
        layer_tables((ptr_dst,), ("ptr_dst",), item, dst_stride),
        _widened(indices_src),
        _widened(indices_dst),
        engine=(ptr_src, ptr_dst),
    )


__all__ = [
    "transfer_hicache_all_layer",
    "transfer_hicache_all_layer_mla",
    "transfer_hicache_one_layer",
    "transfer_hicache_one_layer_mla",
]
