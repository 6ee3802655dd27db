"""Layouts the drop-ins build from an engine's tensors, kept for the same tensors.

An engine calls a drop-in with the same cache tensors step after step (a layer's K
and V, the host pool, a table of layer addresses). Describing them again at every
call (each tensor's address, shape and strides read through its framework) costs
more than planning the copy, several times what finding the kept layout costs
(docs/performance.md has the figures). A new layout at
every call would also keep copy_rows from repeating its last call
(kvcopy._engine.rows_memo, keyed by the layouts). So a layout is kept for the tensor
objects it describes and the arguments that shape it (compat.per_tensors: used again
only while those very objects are unchanged, tables of addresses with the same
contents too), holding no reference to them. Nor does it name them to copy_rows,
which finds the framework's current stream through a layout's tensors where the
indices name none: copy_kept passes that stream itself.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Sequence

from kvcopy.rows import copy_rows
from kvcopy.compat.per_tensors import PerTensors
from kvcopy.compat.pointer_tables import addresses_of, reaches_of, slots_apart
from kvcopy.interop.streams import current_framework_stream
from kvcopy.layouts import Layout
from kvcopy._runtime import kept_memory

# (a 128-layer model moved layer by layer keeps two layouts a layer for each op it
# uses: every one of them stays kept)
_layouts = PerTensors(2048)


def kept_layout(
    tensors: Sequence[Any], args: tuple, build: Callable[[], Layout], *, contents: bool = False
) -> Layout:
    """``build()``, the layout of ``tensors`` shaped by ``args`` (hashable, naming the
    builder too), or the one kept for these tensor objects and ``args`` where none of
    them has changed (``contents``: their values count too, as for tables of
    addresses). Objects that are not torch tensors are described at every call."""
    found = _layouts.held(tensors, args)  # (the steady call: the same tensors unchanged)
    if found is not None:
        return found
    import torch

    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return build()

    def build_kept() -> Layout:
        layout = dataclasses.replace(build(), keep=())
        # handed out only while these tensors live unchanged: where they hold its planes,
        # its memory is the same allocation at every call (a table's addresses are not
        # held by the table)
        if not contents and kept_memory.planes_inside(layout, tensors):
            kept_memory.hold_layout(layout)
        return layout

    return _layouts.renewed(tensors, args, build_kept, contents=contents)  # (held() found none)


def layer_tables(
    tables: tuple, names: tuple, item: int, stride: int | None = None, num_layers: int | None = None
) -> Layout:
    """Tables of per-layer addresses (SGLang's) as one layout's planes, the first
    table's layers then the next's, items of ``item`` bytes every ``stride`` (default
    ``item``), kept for the tables. Each table must hold ``num_layers`` addresses
    (SGLang's own check: the table is the layers) or, where None, as many as the
    first; a layer holds as many items as reach its allocation's end or the next
    layer, whichever comes first."""

    def build() -> Layout:
        bases, reaches = [], []
        want = num_layers if num_layers is not None else len(addresses_of(tables[0], names[0]))
        for table, name in zip(tables, names):
            found = addresses_of(table, name)
            if len(found) != want:
                against = f"num_layers is {num_layers}" if num_layers is not None else f"{names[0]} {want}"
                raise ValueError(f"{name} has {len(found)} layers, {against}")
            bases += found
            reaches += reaches_of(table, name, want)
        slots = slots_apart(bases, reaches, item, stride)
        if slots == 0:
            raise ValueError(f"{names[0]}: a layer holds no item of {item} bytes")
        return Layout.from_pointers(bases, slots=slots, row_bytes=item, slot_stride=stride)

    return kept_layout(tables, ("layer tables", item, stride, num_layers), build, contents=True)


def copy_kept(
    src: Layout,
    dst: Layout,
    src_indices: Any,
    dst_indices: Any,
    *,
    engine: Sequence[Any],
    rows: int | None = None,
) -> str:
    """copy_rows between kept layouts on the current stream of the framework of the
    indices or, where they name none, of ``engine`` (a tensor of each side): the stream
    copy_rows would have found through the layouts' tensors."""
    if _on_torch_gpu(src_indices) or _on_torch_gpu(dst_indices):
        # (copy_rows finds the same stream through the index tensors: that of the first
        # CUDA tensor's device, the engine's tensors coming after them)
        stream = None
    else:
        stream = current_framework_stream(*(i for i in (src_indices, dst_indices) if i is not None), *engine)
    return copy_rows(src, dst, src_indices, dst_indices, rows=rows, stream=stream)


def _on_torch_gpu(obj: Any) -> bool:
    """Whether ``obj`` is a CUDA torch tensor."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor) and obj.is_cuda
