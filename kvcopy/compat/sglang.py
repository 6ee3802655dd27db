"""Drop-ins for SGLang's ``sgl_kernel.kvcacheio`` transfers (HiCache).

Items are tokens: ``item_size`` bytes per token per layer; ``src_indices`` and
``dst_indices`` are int64 token slots (on the GPU, as SGLang passes them, or on the
host), a negative one skipping its item. Layer-first buffers hold a layer's items
back to back (item i at ``base + i * item_size``); page-first buffers hold a token's
layers together (item i of layer l at ``base + i * layout_dim + l * item_size``).
Page-head buffers (``[pages, heads, page_size, layers, head_dim]``) hold a page's
tokens head by head: head h of item i in layer l at ``base + (i // page_size) *
page_size * layout_dim + h * page_size * layout_dim / head_num + (i % page_size) *
layout_dim / head_num + l * item_size / head_num``.
``*_layers`` arguments are tensors of per-layer addresses. K and V move in the same
call (the ``_mla`` forms have one buffer). Each call is one kvcopy.copy_rows on
torch's current stream; ``block_quota`` and ``num_warps_per_block`` are SGLang's
launch shape, accepted and left to kvcopy's policy.

The ``_direct`` transfers take lists of tensors instead: per-layer tensors (K's
layers, then V's; one list for MLA), a token a row of their first dimension, and
page-first direct host buffers ``[pages, layers, page_size, ...]`` (K's and V's, or
one for MLA). SGLang moves their tokens a page (or a run of consecutive tokens) at a
time, its indices brought to the host first; kvcopy moves them token by token, the
indices read where they are (host indices beside GPU ones are uploaded to that GPU),
which is the same where each page's indices are consecutive (SGLang's own condition).
"""

from __future__ import annotations

from typing import Any

from kvcopy.arguments import require_int
from kvcopy.compat.kept_layouts import copy_kept, kept_layout, layer_tables
from kvcopy.layouts import Layout


def _bytes_of(tensors: tuple, names: tuple) -> int:
    """The bytes the smallest of ``tensors`` holds (TypeError naming one that is no tensor)."""
    import torch

    for t, name in zip(tensors, names):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return min(t.numel() * t.element_size() for t in tensors)


def _slots(tensors: tuple, names: tuple, item_size: int, stride: int, offset: int) -> int:
    """How many items ``stride`` apart from ``offset`` bytes in every one of ``tensors``
    holds (ValueError where it holds none)."""
    nbytes = _bytes_of(tensors, names)
    if nbytes < offset + item_size:
        raise ValueError(f"{names[0]}: {nbytes} bytes hold no item of {item_size} bytes at offset {offset}")
    return (nbytes - offset - item_size) // stride + 1


def _buffers(tensors: tuple, names: tuple, item_size: int, stride: int, offset: int = 0) -> Layout:
    """Tensors as planes of items ``stride`` apart, from ``offset`` bytes in."""

    def build() -> Layout:
        slots = _slots(tensors, names, item_size, stride, offset)  # (checks the tensors first)
        return Layout.from_pointers(
            [t.data_ptr() + offset for t in tensors], slots=slots, row_bytes=item_size, slot_stride=stride
        )

    return kept_layout(tensors, ("buffers", item_size, stride, offset), build)


def transfer_kv_per_layer(
    src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size, block_quota=2, num_warps_per_block=32
) -> None:
    """One layer's K and V items, layer-first to layer-first."""
    item = require_int(item_size, "item_size", minimum=1)
    copy_kept(
        _buffers((src_k, src_v), ("src_k", "src_v"), item, item),
        _buffers((dst_k, dst_v), ("dst_k", "dst_v"), item, item),
        src_indices,
        dst_indices,
        engine=(src_k, dst_k),
    )


def _page_first_layer(layer_id: Any, item: int, layout_dim: Any) -> tuple[int, int]:
    """(layer, layout_dim) of a page-first layer, checked: the layer's item lies within
    a token's ``layout_dim`` bytes (else it would read another token's layers)."""
    layer = require_int(layer_id, "layer_id", minimum=0)
    dim = require_int(layout_dim, "src_layout_dim", minimum=1)
    if (layer + 1) * item > dim:
        raise ValueError(
            f"layer_id {layer}: its item of {item} bytes ends at byte "
            f"{(layer + 1) * item} of a token, past src_layout_dim ({dim})"
        )
    return layer, dim


def transfer_kv_per_layer_pf_lf(
    src_k,
    dst_k,
    src_v,
    dst_v,
    src_indices,
    dst_indices,
    layer_id,
    item_size,
    src_layout_dim,
    block_quota=2,
    num_warps_per_block=32,
) -> None:
    """Layer ``layer_id``'s items from page-first buffers into layer-first ones."""
    item = require_int(item_size, "item_size", minimum=1)
    layer, dim = _page_first_layer(layer_id, item, src_layout_dim)
    copy_kept(
        _buffers((src_k, src_v), ("src_k", "src_v"), item, dim, layer * item),
        _buffers((dst_k, dst_v), ("dst_k", "dst_v"), item, item),
        src_indices,
        dst_indices,
        engine=(src_k, dst_k),
    )


def transfer_kv_all_layer(
    src_k_layers,
    dst_k_layers,
    src_v_layers,
    dst_v_layers,
    src_indices,
    dst_indices,
    item_size,
    num_layers,
    block_quota=2,
    num_warps_per_block=32,
) -> None:
    """Every layer's items, layer-first to layer-first, the layers given by address."""
    item = require_int(item_size, "item_size", minimum=1)
    layers = require_int(num_layers, "num_layers", minimum=1)
    copy_kept(
        layer_tables((src_k_layers, src_v_layers), ("src_k_layers", "src_v_layers"), item, num_layers=layers),
        layer_tables((dst_k_layers, dst_v_layers), ("dst_k_layers", "dst_v_layers"), item, num_layers=layers),
        src_indices,
        dst_indices,
        engine=(src_k_layers, dst_k_layers),
    )


def _page_first(tensors: tuple, names: tuple, item: int, dim: int, layers: int) -> Layout:
    """Page-first buffers as planes: each buffer's layers, in order."""
    if layers * item > dim:
        raise ValueError(f"{names[0]}: {layers} layers of {item} bytes do not fit a layout_dim of {dim}")

    def build() -> Layout:
        slots = _slots(tensors, names, item, dim, (layers - 1) * item)  # the last layer's
        bases = [t.data_ptr() + layer * item for t in tensors for layer in range(layers)]
        return Layout.from_pointers(bases, slots=slots, row_bytes=item, slot_stride=dim)

    return kept_layout(tensors, ("page first", item, dim, layers), build)


def _page_head(
    tensors: tuple, names: tuple, item: int, dim: int, layers: range, page_size: int, heads: int
) -> Layout:
    """Page-head buffers as planes (each buffer's ``layers``, in order), a row's pieces
    its heads, ``dim`` bytes a token across every layer and head."""
    if item % heads or dim % heads:
        raise ValueError(
            f"item_size ({item}) and the layout_dim ({dim}) must be multiples of head_num ({heads})"
        )
    if layers.stop * item > dim:
        raise ValueError(
            f"{names[0]}: layer {layers.stop - 1} of {item} bytes does not fit a layout_dim of {dim}"
        )
    page, head = page_size * dim, dim // heads

    def build() -> Layout:
        pages = _bytes_of(tensors, names) // page
        if pages == 0:
            raise ValueError(f"{names[0]}: holds no page of {page_size} tokens of {dim} bytes")
        bases = [t.data_ptr() + layer * (item // heads) for t in tensors for layer in layers]
        return Layout.from_pointers(
            bases,
            slots=pages * page_size,
            row_bytes=item,
            page_size=page_size,
            page_stride=page,
            slot_stride=head,
            pieces=heads,
            piece_stride=head * page_size,
        )

    return kept_layout(tensors, ("page head", item, dim, layers.start, layers.stop, page_size, heads), build)


def transfer_kv_per_layer_ph_lf(
    src_k,
    dst_k,
    src_v,
    dst_v,
    src_indices,
    dst_indices,
    layer_id,
    item_size,
    src_layout_dim,
    page_size,
    head_num,
    block_quota=2,
    num_warps_per_block=32,
) -> None:
    """Layer ``layer_id``'s items from page-head buffers into layer-first ones."""
    item = require_int(item_size, "item_size", minimum=1)
    layer = require_int(layer_id, "layer_id", minimum=0)
    dim = require_int(src_layout_dim, "src_layout_dim", minimum=1)
    tokens = require_int(page_size, "page_size", minimum=1)
    heads = require_int(head_num, "head_num", minimum=1)
    copy_kept(
        _page_head((src_k, src_v), ("src_k", "src_v"), item, dim, range(layer, layer + 1), tokens, heads),
        _buffers((dst_k, dst_v), ("dst_k", "dst_v"), item, item),
        src_indices,
        dst_indices,
        engine=(src_k, dst_k),
    )


def transfer_kv_all_layer_lf_ph(
    src_k_layers,
    dst_k,
    src_v_layers,
    dst_v,
    src_indices,
    dst_indices,
    item_size,
    dst_layout_dim,
    num_layers,
    page_size,
    head_num,
    block_quota=2,
    num_warps_per_block=32,
) -> None:
    """Every layer's items from layer-first layers (by address) into page-head buffers."""
    item = require_int(item_size, "item_size", minimum=1)
    layers = require_int(num_layers, "num_layers", minimum=1)
    dim = require_int(dst_layout_dim, "dst_layout_dim", minimum=1)
    tokens = require_int(page_size, "page_size", minimum=1)
    heads = require_int(head_num, "head_num", minimum=1)
    copy_kept(
        layer_tables((src_k_layers, src_v_layers), ("src_k_layers", "src_v_layers"), item, num_layers=layers),
        _page_head((dst_k, dst_v), ("dst_k", "dst_v"), item, dim, range(layers), tokens, heads),
        src_indices,
        dst_indices,
        engine=(src_k_layers, dst_k),
    )


def transfer_kv_all_layer_lf_pf(
    src_k_layers,
    dst_k,
    src_v_layers,
    dst_v,
    src_indices,
    dst_indices,
    item_size,
    dst_layout_dim,
    num_layers,
    block_quota=2,
    num_warps_per_block=32,
) -> None:
    """Every layer's items from layer-first layers (by address) into page-first buffers."""
    item = require_int(item_size, "item_size", minimum=1)
    layers = require_int(num_layers, "num_layers", minimum=1)
    dim = require_int(dst_layout_dim, "dst_layout_dim", minimum=1)
    copy_kept(
        layer_tables((src_k_layers, src_v_layers), ("src_k_layers", "src_v_layers"), item, num_layers=layers),
        _page_first((dst_k, dst_v), ("dst_k", "dst_v"), item, dim, layers),
        src_indices,
        dst_indices,
        engine=(src_k_layers, dst_k),
    )


def transfer_kv_per_layer_mla(
    src, dst, src_indices, dst_indices, item_size, block_quota=2, num_warps_per_block=32
) -> None:
    item = require_int(item_size, "item_size", minimum=1)
    copy_kept(
        _buffers((src,), ("src",), item, item),
        _buffers((dst,), ("dst",), item, item),
        src_indices,
        dst_indices,
        engine=(src, dst),
    )


def transfer_kv_per_layer_mla_pf_lf(
    src,
    dst,
    src_indices,
    dst_indices,
    layer_id,
    item_size,
    src_layout_dim,
    block_quota=2,
    num_warps_per_block=32,
) -> None:
    item = require_int(item_size, "item_size", minimum=1)
    layer, dim = _page_first_layer(layer_id, item, src_layout_dim)
    copy_kept(
        _buffers((src,), ("src",), item, dim, layer * item),
        _buffers((dst,), ("dst",), item, item),
        src_indices,
        dst_indices,
        engine=(src, dst),
    )


def transfer_kv_all_layer_mla(
    src_layers,
    dst_layers,
    src_indices,
    dst_indices,
    item_size,
    num_layers,
    block_quota=2,
    num_warps_per_block=32,
) -> None:
    item = require_int(item_size, "item_size", minimum=1)
    layers = require_int(num_layers, "num_layers", minimum=1)
    copy_kept(
        layer_tables((src_layers,), ("src_layers",), item, num_layers=layers),
        layer_tables((dst_layers,), ("dst_layers",), item, num_layers=layers),
        src_indices,
        dst_indices,
        engine=(src_layers, dst_layers),
    )


def transfer_kv_all_layer_mla_lf_pf(
    src_layers,
    dst,
    src_indices,
    dst_indices,
    item_size,
    dst_layout_dim,
    num_layers,
    block_quota=2,
    num_warps_per_block=32,
) -> None:
    item = require_int(item_size, "item_size", minimum=1)
    layers = require_int(num_layers, "num_layers", minimum=1)
    dim = require_int(dst_layout_dim, "dst_layout_dim", minimum=1)
    copy_kept(
        layer_tables((src_layers,), ("src_layers",), item, num_layers=layers),
        _page_first((dst,), ("dst",), item, dim, layers),
        src_indices,
        dst_indices,
        engine=(src_layers, dst),
    )


def _token_rows(tensors: Any, name: str) -> Layout:
    """Per-layer tensors as planes, in the list's order, a token a row of dimension 0."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(tensors).__name__}")
    return kept_layout(tensors, ("token rows",), lambda: Layout.of(list(tensors), slot=0, name=name))


def _page_first_layers(tensors: Any, name: str, page_size: int, first: int, count: int) -> Layout:
    """Page-first direct buffers' planes of layers ``first`` .. ``first + count - 1``
    (each buffer's, in order: K's, then V's)."""
    if not isinstance(tensors, (list, tuple)) or len(tensors) not in (1, 2):
        raise TypeError(
            f"{name} must be a list of one or two page-first tensors [pages, layers, page_size, ...]"
        )

    def build() -> Layout:
        if not hasattr(tensors[0], "shape"):
            raise TypeError(f"{name}[0] must be a tensor, got {type(tensors[0]).__name__}")
        shape = tuple(tensors[0].shape)
        if len(shape) < 3 or shape[2] != page_size:
            raise ValueError(f"{name}: shape {shape} is not [pages, layers, page_size={page_size}, ...]")
        layers = shape[1]
        if first + count > layers:
            raise ValueError(f"{name}: layers {first} to {first + count - 1} of {layers}")
        host = Layout.of(list(tensors), page=0, slot=2, planes=(1,), name=name)
        return host.select([b * layers + first + j for b in range(len(tensors)) for j in range(count)])

    return kept_layout(tensors, ("page first direct", page_size, first, count), build)


def _layers_per_buffer(device: Any, buffers: int, name: str) -> int:
    """How many layers the per-layer list holds for each of the host's ``buffers``."""
    if not isinstance(device, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(device).__name__}")
    if not device or len(device) % buffers:
        raise ValueError(
            f"{name}: {len(device)} tensors are not {buffers} equal lists of layers (K's, then V's)"
        )
    return len(device) // buffers


def _one_device(src_indices: Any, dst_indices: Any) -> tuple[Any, Any]:
    """SGLang's direct transfers take each side's indices wherever they are (its own
    tests pass host source indices with GPU destination indices); kvcopy reads both
    sides' from one place, so host indices beside GPU ones go up to that GPU (an
    upload on the current stream, no wait for the GPU)."""
    import torch

    pair = (src_indices, dst_indices)
    if not all(isinstance(i, torch.Tensor) for i in pair) or src_indices.is_cuda == dst_indices.is_cuda:
        return pair
    device = (src_indices if src_indices.is_cuda else dst_indices).device
    moved = tuple(i if i.is_cuda else i.to(device=device, dtype=torch.int64) for i in pair)
    return moved[0], moved[1]


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size) -> None:
    """Every token of ``src_indices`` from each tensor of ``src_layers`` to the same tensor
    of ``dst_layers`` (a token a row of dimension 0)."""
    require_int(page_size, "page_size", minimum=1)
    src, dst = _token_rows(src_layers, "src_layers"), _token_rows(dst_layers, "dst_layers")
    if src.num_planes != dst.num_planes:
        raise ValueError(f"src_layers has {src.num_planes} tensors and dst_layers {dst.num_planes}")
    src_indices, dst_indices = _one_device(src_indices, dst_indices)
    copy_kept(src, dst, src_indices, dst_indices, engine=(src_layers[0], dst_layers[0]))


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size
) -> None:
    """Tokens of page-first direct host buffers (``src_ptrs``), from layer ``layer_id`` on,
    into per-layer tensors (``dst_ptrs``: K's layers, then V's)."""
    tokens = require_int(page_size, "page_size", minimum=1)
    first = require_int(layer_id, "layer_id", minimum=0)
    buffers = len(src_ptrs) if isinstance(src_ptrs, (list, tuple)) else 1
    count = _layers_per_buffer(dst_ptrs, buffers, "dst_ptrs")
    src_indices, dst_indices = _one_device(src_indices, dst_indices)
    copy_kept(
        _page_first_layers(src_ptrs, "src_ptrs", tokens, first, count),
        _token_rows(dst_ptrs, "dst_ptrs"),
        src_indices,
        dst_indices,
        engine=(src_ptrs[0], dst_ptrs[0]),
    )


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size) -> None:
    """Tokens of per-layer tensors (``src_ptrs``: K's layers, then V's) into page-first
    direct host buffers (``dst_ptrs``), every layer."""
    tokens = require_int(page_size, "page_size", minimum=1)
    buffers = len(dst_ptrs) if isinstance(dst_ptrs, (list, tuple)) else 1
    count = _layers_per_buffer(src_ptrs, buffers, "src_ptrs")
    src_indices, dst_indices = _one_device(src_indices, dst_indices)
    copy_kept(
        _token_rows(src_ptrs, "src_ptrs"),
        _page_first_layers(dst_ptrs, "dst_ptrs", tokens, 0, count),
        src_indices,
        dst_indices,
        engine=(src_ptrs[0], dst_ptrs[0]),
    )


__all__ = [
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
]
