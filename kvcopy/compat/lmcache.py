"""Drop-ins for LMCache's transfer ops (its CUDA ops of the same names):
``multi_layer_kv_transfer``, ``multi_layer_kv_transfer_unilateral``,
``single_layer_kv_transfer`` and ``single_layer_kv_transfer_sgl``.

``key_value`` is LMCache's chunk, ``[2, layers, tokens, hidden]`` (``[1, ...]`` for
MLA, and for the formats that fuse K and V into a token's row), in GPU or pinned host
memory; ``key_value_ptrs`` holds each layer's paged cache address (an int64 tensor);
``slot_mapping`` gives each token's slot, ``block * block_size + offset`` (negative:
skipped). ``direction`` D2H (True) gathers the paged caches into the chunk, H2D
(False) scatters the chunk into them. ``engine_kv_format`` names how each layer's
cache is laid out, as LMCache's ``EngineKVFormat`` does (LMCache's own enum members,
this module's, their values, or a bool in that argument's place, which LMCache's
earlier op took as its ``use_mla`` flag: True for MLA):

- NL_X_TWO_NB_BS_NH_HS (vLLM flash-attn): a layer is ``[2, page_buffer_size, hidden]``;
  NB_NL_TWO_BS_NH_HS (vLLM cross-layer) is addressed the same way from its layer
  addresses, as LMCache's kernel addresses it;
- NL_X_NB_TWO_BS_NH_HS (flashinfer): ``[blocks, 2, block_size, hidden]``;
- NL_X_NB_BS_HS (vLLM MLA) and NL_X_NBBS_ONE_HS (SGLang MLA): ``[slots, hidden]``;
- NL_X_TWO_NB_NH_BS_HS and NL_X_NB_TWO_NH_BS_HS (the HND forms of flash-attn and
  flashinfer): heads before the block's tokens, each head ``head_size`` elements;
- NL_X_NB_NH_BS_CS and NL_X_NB_BS_NH_CS (vLLM's blocks-first caches, K and V fused
  into a head's content, ``[blocks, heads, block_size, content]`` and ``[blocks,
  block_size, heads, content]``), and their deprecated forms NL_X_NB_NH_BS_TWO_HS and
  NL_X_NB_BS_NH_TWO_HS: a block ``block_stride_elems`` apart (0: blocks back to back);
  ``head_size`` is half a head's content for both (as LMCache's kernel takes it);
- NL_X_TWO_NB_NH_ONE_BS_HS: as NL_X_TWO_NB_NH_BS_HS (the singleton changes no address).

NL_X_NB_BSV_BSS (the DSA indexer), NL_X_TWO_X_NB_BS_NH_HS and NL_X_TWO_X_NB_BS_HS (a
layer as a tuple of tensors) are refused by name. For the MLA formats a
``page_buffer_size`` of 0 is taken, as LMCache's kernel ignores it there: a layer's
slots are then as many as its allocation holds (up to the next layer's address).

The SGLang MHA formats go by ``multi_layer_kv_transfer_unilateral`` (K's layers, then
V's, each ``[page_buffer_size, hidden]``), as in LMCache. One layer at a time,
``single_layer_kv_transfer`` moves tokens between a layer's chunk (``[tokens, 2,
hidden]`` with ``token_major``, else ``[2, tokens, hidden]``; ``[tokens, hidden]`` for
MLA) and that layer's vLLM cache tensor, and ``single_layer_kv_transfer_sgl`` between
it and SGLang's K and V tensors ``[blocks, block_size, heads, head_size]``. Each call
is one kvcopy.copy_rows on torch's current stream: the copy kernel reads the slot
mapping where it is (GPU or host) and computes every address, whatever the alignment.
"""

from __future__ import annotations

import operator
from enum import IntEnum
from typing import Any

from kvcopy.arguments import require_bool, require_int
from kvcopy.compat.kept_layouts import copy_kept, kept_layout
from kvcopy.compat.pointer_tables import addresses_of, reaches_of, slots_apart
from kvcopy.layouts import Layout


class TransferDirection(IntEnum):
    """LMCache's directions: H2D scatters the chunk into the paged caches, D2H gathers."""

    H2D = 0
    D2H = 1


class EngineKVFormat(IntEnum):
    """LMCache's names for the engines' KV cache layouts (see the module's docstring)."""

    NB_NL_TWO_BS_NH_HS = 0
    NL_X_TWO_NB_BS_NH_HS = 1
    NL_X_NB_TWO_BS_NH_HS = 2
    NL_X_NB_BS_HS = 3
    TWO_X_NL_X_NBBS_NH_HS = 4
    NL_X_NBBS_ONE_HS = 5
    NL_X_TWO_NB_NH_BS_HS = 6
    NL_X_NB_TWO_NH_BS_HS = 7
    NB_NL_TWO_NH_BS_HS = 8
    TWO_X_NL_X_NB_BS_NH_HS = 9
    NL_X_NB_NH_BS_TWO_HS = 10  # (deprecated by LMCache for NL_X_NB_NH_BS_CS)
    NL_X_NB_BS_NH_TWO_HS = 11  # (deprecated by LMCache for NL_X_NB_BS_NH_CS)
    NL_X_NB_NH_BS_CS = 12
    NL_X_NB_BS_NH_CS = 13
    NL_X_NB_BSV_BSS = 14
    NL_X_TWO_NB_NH_ONE_BS_HS = 15
    NL_X_TWO_X_NB_BS_NH_HS = 16
    NL_X_TWO_X_NB_BS_HS = 17


_F = EngineKVFormat
# (the same memory under LMCache's newer name: an HND layer's singleton, K and V fused
# into a content dimension)
_SAME_AS = {_F.NL_X_TWO_NB_NH_ONE_BS_HS: _F.NL_X_TWO_NB_NH_BS_HS}
_MLA = {_F.NL_X_NB_BS_HS, _F.NL_X_NBBS_ONE_HS}
_ONE_PLANE = _MLA | {
    _F.NL_X_NB_NH_BS_TWO_HS,
    _F.NL_X_NB_BS_NH_TWO_HS,
    _F.NL_X_NB_NH_BS_CS,
    _F.NL_X_NB_BS_NH_CS,
}  # MLA, or K and V fused in a row
_NEEDS_BLOCK = {
    _F.NL_X_NB_TWO_BS_NH_HS,
    _F.NL_X_TWO_NB_NH_BS_HS,
    _F.NL_X_NB_TWO_NH_BS_HS,
    _F.NL_X_NB_NH_BS_TWO_HS,
    _F.NL_X_NB_BS_NH_TWO_HS,
    _F.NL_X_NB_NH_BS_CS,
    _F.NL_X_NB_BS_NH_CS,
}
_NEEDS_HEAD = {_F.NL_X_TWO_NB_NH_BS_HS, _F.NL_X_NB_TWO_NH_BS_HS, _F.NL_X_NB_NH_BS_TWO_HS, _F.NL_X_NB_NH_BS_CS}
# (K and V fused into a head's content: ``head_size`` is half that content, as LMCache's
# kernel and its own round-trip test take it)
_FUSED_HEADS = {_F.NL_X_NB_NH_BS_TWO_HS, _F.NL_X_NB_NH_BS_CS}
_UNILATERAL = {_F.TWO_X_NL_X_NBBS_NH_HS, _F.TWO_X_NL_X_NB_BS_NH_HS}
# Formats whose pages kvcopy does not address: refused by name, never guessed at.
_NOT_TAKEN = {
    _F.NL_X_NB_BSV_BSS: "the DSA indexer's blocks keep their values and their scales in two "
    "runs of unequal rows",
    _F.NL_X_TWO_X_NB_BS_NH_HS: "a layer's K and V come as a tuple of tensors",
    _F.NL_X_TWO_X_NB_BS_HS: "a layer's planes come as a tuple of tensors of unequal widths",
}


def _member(value: Any, enum: type[IntEnum], name: str) -> Any:
    """``value`` as a member of ``enum``: a member of LMCache's enum of that name (by
    its name), of this module's, or its value."""
    found = getattr(value, "name", None)
    if isinstance(found, str) and found in enum.__members__:
        return enum.__members__[found]
    if not isinstance(value, bool):
        try:
            return enum(operator.index(value))  # (Python and NumPy integers)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"{name} must be one of {', '.join(enum.__members__)}, got {value!r}")


def _engine_format(value: Any) -> EngineKVFormat:
    """The format ``value`` names; a bool is the ``use_mla`` of LMCache's earlier op."""
    if isinstance(value, bool):
        return _F.NL_X_NB_BS_HS if value else _F.NL_X_TWO_NB_BS_NH_HS
    fmt = _member(value, EngineKVFormat, "engine_kv_format")
    if fmt in _NOT_TAKEN:
        raise ValueError(
            f"engine_kv_format {fmt.name} is not taken by kvcopy's drop-in: "
            f"{_NOT_TAKEN[fmt]}; move it with LMCache's own op"
        )
    return _SAME_AS.get(fmt, fmt)


def _direction(value: Any) -> bool:
    """True where the paged caches are gathered into the chunk (D2H)."""
    if isinstance(value, bool):
        return value
    return _member(value, TransferDirection, "direction") is TransferDirection.D2H


def _chunk(key_value: Any, planes: int, fmt: EngineKVFormat) -> tuple[int, int, int]:
    """(layers, tokens, row bytes) of LMCache's chunk, checked against the format."""
    import torch

    if not isinstance(key_value, torch.Tensor) or key_value.dim() != 4:
        raise TypeError(
            "key_value must be a 4-D torch.Tensor [2 (1 for MLA or fused K and V), layers, tokens, hidden]"
        )
    if key_value.shape[0] != planes:
        raise ValueError(f"key_value: dimension 0 is {key_value.shape[0]}, expected {planes} ({fmt.name})")
    layers, tokens, hidden = key_value.shape[1:]
    return layers, tokens, hidden * key_value.element_size()


def _paged(
    fmt: EngineKVFormat, bases: list[int], slots: int, row: int, block: int, head: int, block_step: int
) -> Layout:
    """Every layer's paged cache as planes (a layer's K, then its V), as LMCache's kernel
    addresses ``fmt``; ``head`` and ``block_step`` in bytes (0: unused or tight)."""

    def planes(*offsets: int) -> list[int]:
        return [b + o for b in bases for o in offsets]

    if fmt in (_F.NB_NL_TWO_BS_NH_HS, _F.NL_X_TWO_NB_BS_NH_HS):
        return Layout.from_pointers(planes(0, slots * row), slots=slots, row_bytes=row)
    if fmt is _F.NL_X_NB_TWO_BS_NH_HS:
        return Layout.from_pointers(
            planes(0, block * row), slots=slots, row_bytes=row, page_size=block, page_stride=2 * block * row
        )
    if fmt in (_F.NL_X_NB_BS_HS, _F.NL_X_NBBS_ONE_HS):
        return Layout.from_pointers(planes(0), slots=slots, row_bytes=row)
    if fmt in (_F.NL_X_TWO_NB_NH_BS_HS, _F.NL_X_NB_TWO_NH_BS_HS):
        kv_step, page = (
            (slots * row, block * row) if fmt is _F.NL_X_TWO_NB_NH_BS_HS else (block * row, 2 * block * row)
        )
        return Layout.from_pointers(
            planes(0, kv_step),
            slots=slots,
            row_bytes=row,
            page_size=block,
            page_stride=page,
            slot_stride=head,
            pieces=row // head,
            piece_stride=block * head,
        )
    page = block_step or block * row
    if fmt in (_F.NL_X_NB_NH_BS_TWO_HS, _F.NL_X_NB_NH_BS_CS):
        # a head's K and V side by side (a head's content), heads before tokens
        width = 2 * head
        return Layout.from_pointers(
            planes(0),
            slots=slots,
            row_bytes=row,
            page_size=block,
            page_stride=page,
            slot_stride=width,
            pieces=row // width,
            piece_stride=block * width,
        )
    if fmt in (_F.NL_X_NB_BS_NH_TWO_HS, _F.NL_X_NB_BS_NH_CS):
        return Layout.from_pointers(planes(0), slots=slots, row_bytes=row, page_size=block, page_stride=page)
    raise ValueError(
        f"engine_kv_format {fmt.name}: LMCache's multi_layer_kv_transfer does not "
        "take it" + (" (its layers go by multi_layer_kv_transfer_unilateral)" if fmt in _UNILATERAL else "")
    )


def _tokens_slots(slot_mapping: Any, skip: int, tokens: int) -> Any:
    """The slots of the chunk's tokens from ``skip`` on: LMCache's kernel reads the first
    ``tokens`` entries of a longer mapping (a shorter one is refused by copy_rows)."""
    if skip == 0 and len(slot_mapping) == tokens:
        return slot_mapping
    return slot_mapping[skip:tokens]


Rows = tuple[Layout, Layout, Any, Any, int]  # copy_rows' src, dst, their indices, rows


def _chunk_rows(
    paged: Layout, key_value: Any, skip: int, slot_mapping: Any, tokens: int, gather: bool
) -> Rows:
    """The chunk's rows from token ``skip`` on (a layer's K, then its V) to or from the
    paged slots."""
    chunk = kept_layout(
        [key_value],
        ("chunk", skip),
        lambda: Layout.of(key_value[:, :, skip:], planes=(1, 0), slot=2, name="key_value"),
    )
    if gather:
        return paged, chunk, slot_mapping, None, tokens
    return chunk, paged, None, slot_mapping, tokens


def transfer_rows(
    key_value: Any,
    key_value_ptrs: Any,
    slot_mapping: Any,
    page_buffer_size: int,
    direction: Any,
    engine_kv_format: Any = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
    block_size: int = 0,
    head_size: int = 0,
    skip_prefix_n_tokens: int = 0,
    block_stride_elems: int = 0,
) -> Rows | None:
    """multi_layer_kv_transfer's work as copy_rows' arguments (``None``: no row moves),
    every argument checked."""
    fmt = _engine_format(engine_kv_format)
    gather = _direction(direction)
    planes = 1 if fmt in _ONE_PLANE else 2
    layers, tokens, row = _chunk(key_value, planes, fmt)
    # (LMCache's kernel ignores page_buffer_size for MLA, and its tests pass 0 there)
    slots = require_int(page_buffer_size, "page_buffer_size", minimum=0 if fmt in _MLA else 1)
    block = require_int(block_size, "block_size", minimum=0)
    element = key_value.element_size()
    head = require_int(head_size, "head_size", minimum=0) * element
    skip = require_int(skip_prefix_n_tokens, "skip_prefix_n_tokens", minimum=0, maximum=tokens)
    step = require_int(block_stride_elems, "block_stride_elems", minimum=0) * element
    if fmt in _NEEDS_BLOCK and block == 0:
        raise ValueError(f"block_size is needed for engine_kv_format {fmt.name}")
    if fmt in _NEEDS_HEAD:
        width = 2 * head if fmt in _FUSED_HEADS else head
        if width == 0 or row % width:
            raise ValueError(
                f"head_size ({head_size}) must divide a token's row of {row} bytes "
                f"into heads for engine_kv_format {fmt.name}"
            )

    def build() -> Layout:
        bases = addresses_of(key_value_ptrs, "key_value_ptrs")
        if len(bases) != layers:
            raise ValueError(f"key_value_ptrs has {len(bases)} layers, key_value {layers}")
        # an MLA cache of unstated size: as far as its allocation (the driver's answer)
        # or the next layer reaches
        reach = slots or slots_apart(bases, reaches_of(key_value_ptrs, "key_value_ptrs", layers), row)
        return _paged(fmt, bases, reach, row, block, head, step)

    # (the table is read where the kept layout is not found: one lookup a call)
    paged = kept_layout(
        [key_value_ptrs], ("paged", fmt, layers, slots, row, block, head, step), build, contents=True
    )
    if skip == tokens:
        return None
    return _chunk_rows(
        paged, key_value, skip, _tokens_slots(slot_mapping, skip, tokens), tokens - skip, gather
    )


def unilateral_rows(
    key_value: Any,
    key_value_ptrs: Any,
    slot_mapping: Any,
    page_buffer_size: int,
    direction: Any,
    engine_kv_format: Any = EngineKVFormat.TWO_X_NL_X_NBBS_NH_HS,
) -> Rows | None:
    """multi_layer_kv_transfer_unilateral's work as copy_rows' arguments."""
    fmt = _engine_format(engine_kv_format)
    if fmt in _ONE_PLANE:
        return transfer_rows(key_value, key_value_ptrs, slot_mapping, page_buffer_size, direction, fmt)
    gather = _direction(direction)
    layers, tokens, row = _chunk(key_value, 2, fmt)
    slots = require_int(page_buffer_size, "page_buffer_size", minimum=1)

    def build() -> Layout:
        bases = addresses_of(key_value_ptrs, "key_value_ptrs")
        if len(bases) != 2 * layers:
            raise ValueError(
                f"key_value_ptrs has {len(bases)} addresses, expected K's and V's "
                f"{layers} layers ({2 * layers})"
            )
        return Layout.from_pointers(
            [bases[kv * layers + layer] for layer in range(layers) for kv in (0, 1)],
            slots=slots,
            row_bytes=row,
        )

    paged = kept_layout([key_value_ptrs], ("unilateral", layers, slots, row), build, contents=True)
    return _chunk_rows(paged, key_value, 0, _tokens_slots(slot_mapping, 0, tokens), tokens, gather)


def _run(rows: Rows | None, *engine: Any) -> None:
    """copy_rows' arguments run on the current stream of the engine's tensors' framework."""
    if rows is not None:
        src, dst, src_indices, dst_indices, count = rows
        copy_kept(src, dst, src_indices, dst_indices, engine=engine, rows=count)


def multi_layer_kv_transfer(
    key_value: Any,
    key_value_ptrs: Any,
    slot_mapping: Any,
    paged_memory_device: Any,
    page_buffer_size: int,
    direction: Any,
    engine_kv_format: Any = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
    block_size: int = 0,
    head_size: int = 0,
    skip_prefix_n_tokens: int = 0,
    block_stride_elems: int = 0,
) -> None:
    """Move every layer's K and V rows of the tokens in ``slot_mapping`` between the
    paged caches and the chunk (see the module's docstring); tokens before
    ``skip_prefix_n_tokens`` are left as they are. ``block_size`` (and ``head_size``, in
    elements) are needed by the formats that address blocks (and heads);
    ``paged_memory_device`` is accepted (kvcopy finds each memory's device itself).
    Raises TypeError or ValueError naming a bad argument before anything is enqueued."""
    _run(
        transfer_rows(
            key_value,
            key_value_ptrs,
            slot_mapping,
            page_buffer_size,
            direction,
            engine_kv_format,
            block_size,
            head_size,
            skip_prefix_n_tokens,
            block_stride_elems,
        ),
        key_value_ptrs,
        key_value,
    )


def multi_layer_kv_transfer_unilateral(
    key_value: Any,
    key_value_ptrs: Any,
    slot_mapping: Any,
    paged_memory_device: Any,
    page_buffer_size: int,
    direction: Any,
    engine_kv_format: Any = EngineKVFormat.TWO_X_NL_X_NBBS_NH_HS,
) -> None:
    """SGLang's MHA layers (``key_value_ptrs``: K's layers, then V's, each
    ``[page_buffer_size, hidden]``) and the chunk; an MLA format goes as in
    multi_layer_kv_transfer, as in LMCache."""
    _run(
        unilateral_rows(
            key_value, key_value_ptrs, slot_mapping, page_buffer_size, direction, engine_kv_format
        ),
        key_value_ptrs,
        key_value,
    )


# A layer's vLLM cache tensor per format: (K/V dimension, if any), page, slot, and the
# heads' dimension where they come before the block's tokens (HND).
_LAYER_TENSOR = {
    _F.NL_X_TWO_NB_BS_NH_HS: ((0,), 1, 2, None),  # [2, blocks, block_size, heads, head_size]
    _F.NL_X_NB_TWO_BS_NH_HS: ((1,), 0, 2, None),  # [blocks, 2, block_size, heads, head_size]
    _F.NL_X_TWO_NB_NH_BS_HS: ((0,), 1, 3, 2),  # [2, blocks, heads, block_size, head_size]
    _F.NL_X_NB_TWO_NH_BS_HS: ((1,), 0, 3, 2),  # [blocks, 2, heads, block_size, head_size]
    _F.NL_X_NB_BS_HS: ((), 0, 1, None),  # [blocks, block_size, head_size]
}


def _layer_chunk(cache: Any, mla: bool, token_major: Any) -> Layout:
    """A layer's LMCache chunk as planes (K, then V), a token a row."""
    name = "lmc_key_value_cache"
    _tensor_of_dims(cache, name, 2 if mla else 3)
    major = require_bool(token_major, "token_major")
    if mla:
        return kept_layout([cache], ("layer chunk",), lambda: Layout.of(cache, slot=0, name=name))
    planes, slot = ((1,), 0) if major else ((0,), 1)
    return kept_layout(
        [cache], ("layer chunk", major), lambda: Layout.of(cache, planes=planes, slot=slot, name=name)
    )


def _tensor_of_dims(tensor: Any, name: str, dims: int) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.dim() != dims:
        found = f"shape {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"{name} must be a {dims}-D torch.Tensor, got {found}")


def single_layer_rows(
    lmc_key_value_cache: Any,
    vllm_key_value_cache: Any,
    slot_mapping: Any,
    direction: Any,
    engine_kv_format: Any,
    token_major: Any = False,
) -> Rows:
    """single_layer_kv_transfer's work as copy_rows' arguments, every argument checked."""
    fmt = _engine_format(engine_kv_format)
    if fmt not in _LAYER_TENSOR:
        raise ValueError(f"engine_kv_format {fmt.name}: LMCache's single_layer_kv_transfer does not take it")
    gather = _direction(direction)
    planes, page, slot, heads = _LAYER_TENSOR[fmt]
    _tensor_of_dims(vllm_key_value_cache, "vllm_key_value_cache", 5 if planes else 3)
    paged = kept_layout(
        [vllm_key_value_cache],
        ("layer", fmt),
        lambda: Layout.of(
            vllm_key_value_cache,
            planes=planes,
            page=page,
            slot=slot,
            pieces=heads,
            name="vllm_key_value_cache",
        ),
    )
    chunk = _layer_chunk(lmc_key_value_cache, not planes, token_major)
    tokens = len(slot_mapping)
    if gather:
        return paged, chunk, slot_mapping, None, tokens
    return chunk, paged, None, slot_mapping, tokens


def single_layer_kv_transfer(
    lmc_key_value_cache: Any,
    vllm_key_value_cache: Any,
    slot_mapping: Any,
    direction: Any,
    engine_kv_format: Any,
    token_major: Any = False,
) -> None:
    """One layer's K and V rows of the tokens in ``slot_mapping`` between that layer's
    chunk (token t a row of it) and its vLLM cache tensor, laid out as
    ``engine_kv_format`` (flash-attn or flashinfer, NHD or HND, or MLA)."""
    _run(
        single_layer_rows(
            lmc_key_value_cache, vllm_key_value_cache, slot_mapping, direction, engine_kv_format, token_major
        ),
        vllm_key_value_cache,
        lmc_key_value_cache,
    )


def single_layer_kv_transfer_sgl(
    lmc_key_value_cache: Any,
    sgl_key_cache: Any,
    sgl_value_cache: Any,
    slot_mapping: Any,
    direction: Any,
    token_major: Any = False,
) -> None:
    """One layer's K and V rows of the tokens in ``slot_mapping`` between that layer's
    chunk and SGLang's K and V tensors (``[blocks, block_size, heads, head_size]``)."""
    gather = _direction(direction)
    _tensor_of_dims(sgl_key_cache, "sgl_key_cache", 4)
    paged = kept_layout(
        [sgl_key_cache, sgl_value_cache],
        ("sgl layer",),
        lambda: Layout.of([sgl_key_cache, sgl_value_cache], page=0, slot=1, name="sgl_key_cache"),
    )
    chunk = _layer_chunk(lmc_key_value_cache, False, token_major)
    tokens = len(slot_mapping)
    _run(
        (paged, chunk, slot_mapping, None, tokens) if gather else (chunk, paged, None, slot_mapping, tokens),
        sgl_key_cache,
        lmc_key_value_cache,
    )


__all__ = [
    "EngineKVFormat",
    "TransferDirection",
    "multi_layer_kv_transfer",
    "multi_layer_kv_transfer_unilateral",
    "single_layer_kv_transfer",
    "single_layer_kv_transfer_sgl",
    "single_layer_rows",
    "transfer_rows",
    "unilateral_rows",
]
