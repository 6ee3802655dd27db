"""Layouts the drop-ins build from an engine's tensors, kept for the same tensors.

An engine calls a drop-in with the same cache tensors step after step (a layer's K
and V, the host pool, a table of layer addresses). Describing them again at every
call (each tensor's address, shape and strides read through its framework) costs
more than planning the copy: about 5 µs a tensor, 0.6 ms for 128 layer tensors,
against 0.6 µs a tensor to find the kept layout (python3
experiments/dropins_cpu_probe.py, bench/results/cpu-dropins.txt). A new layout at
every call would also keep copy_rows from repeating its last call
(kvcopy._engine.rows_memo, keyed by the layouts). So a layout is kept, keyed by the
identity of the tensors it describes and the arguments that shape it, and used again
only while those very tensor objects are alive with the same address, shape, strides
and dtype (and, for tables of addresses, the same contents by torch's version
counter, which every in-place write through torch bumps; an inference tensor's
contents count as fixed, see compat.pointer_tables). A kept layout holds no
reference to its tensors: a freed cache is never kept alive, and a new tensor at its
address is described anew. Nor does it name them to copy_rows, which finds the
framework's current stream through a layout's tensors where the indices name none:
copy_kept passes that stream itself.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Sequence

from kvcopy.api import copy_rows
from kvcopy.compat.pointer_tables import version_of
from kvcopy.interop.streams import current_framework_stream
from kvcopy.layouts import Layout

_KEPT = 256


class _Entry:
    __slots__ = ("tensors", "facts", "layout")

    def __init__(self, tensors: Sequence[Any], facts: list, layout: Layout) -> None:
        self.tensors = tuple(weakref.ref(t) for t in tensors)
        self.facts, self.layout = facts, layout

    def holds(self, tensors: Sequence[Any], facts: list) -> bool:
        return self.facts == facts and all(ref() is t for ref, t in zip(self.tensors, tensors))


_kept: dict[tuple, _Entry] = {}


def _facts(tensors: Sequence[Any], contents: bool) -> list:
    """What a tensor object's layout rests on (about 0.35 µs a tensor)."""
    if contents:
        return [(t.data_ptr(), t.shape, t.stride(), t.dtype, version_of(t)) for t in tensors]
    return [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors]


def kept_layout(tensors: Sequence[Any], args: tuple, build: Callable[[], Layout], *,
                contents: bool = False) -> Layout:
    """``build()``, the layout of ``tensors`` shaped by ``args`` (hashable, naming the
    builder too), or the one kept for these tensor objects and ``args`` where none of
    them has changed (``contents``: their values count too, as for tables of
    addresses). Objects that are not torch tensors are described at every call."""
    import torch

    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return build()
    key = (tuple(map(id, tensors)), args)
    facts = _facts(tensors, contents)
    found = _kept.get(key)
    if found is not None and found.holds(tensors, facts):
        return found.layout
    layout = dataclasses.replace(build(), keep=())
    if len(_kept) >= _KEPT:
        _kept.clear()
    _kept[key] = _Entry(tensors, facts, layout)
    return layout


def copy_kept(src: Layout, dst: Layout, src_indices: Any, dst_indices: Any, *,
              engine: Sequence[Any], rows: int | None = None) -> str:
    """copy_rows between kept layouts on the current stream of the framework of the
    indices or, where they name none, of ``engine`` (a tensor of each side): the stream
    copy_rows would have found through the layouts' tensors."""
    stream = current_framework_stream(*(i for i in (src_indices, dst_indices) if i is not None),
                                      *engine)
    return copy_rows(src, dst, src_indices, dst_indices, rows=rows, stream=stream)
