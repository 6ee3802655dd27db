"""Drop-in for LMCache's ``multi_layer_kv_transfer`` (its CUDA op of that name).

``key_value`` is LMCache's chunk, ``[2, layers, tokens, hidden]`` (``[1, ...]`` with
``use_mla``), in GPU or pinned host memory; ``key_value_ptrs`` holds each layer's
paged cache address (an int64 tensor), a layer being ``[2, page_buffer_size, hidden]``
elements of the chunk's dtype (``[page_buffer_size, hidden]`` with MLA);
``slot_mapping`` gives each token's slot (negative: skipped). ``direction`` True
gathers the paged caches into the chunk, False scatters the chunk into them. One
kvcopy.copy_rows call on torch's current stream: the copy kernel reads the slot
mapping where it is (GPU or host) and computes every address.
"""
from __future__ import annotations

from typing import Any

from kvcopy.api import copy_rows
from kvcopy.arguments import require_int
from kvcopy.compat.pointer_tables import addresses_of
from kvcopy.layouts import Layout


def multi_layer_kv_transfer(key_value: Any, key_value_ptrs: Any, slot_mapping: Any,
                            paged_memory_device: Any, page_buffer_size: int, direction: bool,
                            use_mla: bool = False) -> None:
    """Move every layer's K and V rows of the tokens in ``slot_mapping`` between the
    paged caches and the chunk (see the module's docstring). Raises TypeError or
    ValueError naming a bad argument before anything is enqueued."""
    import torch

    if not isinstance(key_value, torch.Tensor) or key_value.dim() != 4:
        raise TypeError("key_value must be a 4-D torch.Tensor [2 (1 with MLA), layers, tokens, "
                        "hidden]")
    planes = 1 if use_mla else 2
    if key_value.shape[0] != planes:
        raise ValueError(f"key_value: dimension 0 is {key_value.shape[0]}, expected {planes} "
                         f"(use_mla={use_mla})")
    require_int(page_buffer_size, "page_buffer_size", minimum=1)
    layers, tokens, hidden = key_value.shape[1:]
    row = hidden * key_value.element_size()
    bases = addresses_of(key_value_ptrs, "key_value_ptrs")
    if len(bases) != layers:
        raise ValueError(f"key_value_ptrs has {len(bases)} layers, key_value {layers}")
    paged = Layout.from_pointers([b + p * page_buffer_size * row for b in bases
                                  for p in range(planes)],
                                 slots=page_buffer_size, row_bytes=row,
                                 keep=(key_value_ptrs,))
    chunk = Layout.of(key_value, planes=(1, 0), slot=2, name="key_value")
    if direction:
        copy_rows(paged, chunk, slot_mapping, None, rows=tokens)
    else:
        copy_rows(chunk, paged, None, slot_mapping, rows=tokens)
