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
from typing import Any, Callable, Sequence

from kvcopy.api import copy_rows
from kvcopy.compat.per_tensors import PerTensors
from kvcopy.interop.streams import current_framework_stream
from kvcopy.layouts import Layout

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
    import torch

    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return build()
    return _layouts.get(tensors, args, lambda: dataclasses.replace(build(), keep=()), contents=contents)


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
    stream = current_framework_stream(*(i for i in (src_indices, dst_indices) if i is not None), *engine)
    return copy_rows(src, dst, src_indices, dst_indices, rows=rows, stream=stream)
