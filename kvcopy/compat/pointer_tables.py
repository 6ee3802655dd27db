"""Tables of per-layer addresses that engines keep in tensors (LMCache's
``key_value_ptrs``, SGLang's ``*_layers``), read once per table.

Such a table lives on the GPU and rarely changes: reading it costs a
synchronisation, so its values (and, where asked, how far each address reaches) are
kept with the table object itself, and read again when the tensor's address, length
or torch's version counter (bumped by every in-place write through torch) changes.
They are never reused for another tensor, even one that torch's caching allocator
puts at the same address with the same length: a new table is read anew. An inference
tensor (made under torch.inference_mode, as engines often make their tables) has no
version counter: its values are read once for the object, so a table that changes
must be a new tensor, as the engines' own tables are.
"""
from __future__ import annotations

import weakref
from typing import Any

_KEPT = 64


class _Kept:
    """One table's values, valid while ``table`` is this object with this ``key``."""

    __slots__ = ("table", "key", "addresses", "reaches")

    def __init__(self, table: Any, key: tuple, addresses: list[int]) -> None:
        self.table = weakref.ref(table)
        self.key = key
        self.addresses = addresses
        self.reaches: list[int] | None = None


_tables: dict[int, _Kept] = {}


def version_of(tensor: Any) -> int:
    """torch's version counter of ``tensor``; -1 for an inference tensor (made under
    torch.inference_mode), which has none: its contents count as fixed for the object."""
    return -1 if tensor.is_inference() else tensor._version


def _kept(table: Any, name: str) -> _Kept:
    import torch

    if not isinstance(table, torch.Tensor) or table.dim() != 1 \
            or table.dtype not in (torch.int64, torch.uint64):
        raise TypeError(f"{name} must be a 1-D int64 (or uint64) torch.Tensor of addresses")
    key = (table.data_ptr(), table.numel(), str(table.device), version_of(table))
    found = _tables.get(id(table))
    if found is not None and found.table() is table and found.key == key:
        return found
    values = [int(v) for v in table.cpu().numpy().view("uint64").tolist()]
    if any(v == 0 for v in values):
        raise ValueError(f"{name}: an address is 0")
    if len(_tables) >= _KEPT:
        _tables.clear()
    found = _tables[id(table)] = _Kept(table, key, values)
    return found


def addresses_of(table: Any, name: str) -> list[int]:
    """The addresses in a 1-D int64/uint64 tensor (any device), as Python ints."""
    return _kept(table, name).addresses


def reaches_of(table: Any, name: str, count: int) -> list[int]:
    """For each of the first ``count`` addresses in ``table``, the bytes from it to the
    end of the allocation holding it (device memory or pinned host memory), as the
    driver reports it: how far a layer given only by its address may be addressed.
    ValueError naming the table where an address is not memory the driver knows."""
    found = _kept(table, name)
    if found.reaches is None:
        found.reaches = []
    for address in found.addresses[len(found.reaches):count]:
        found.reaches.append(_reach_of(address, name))
    return found.reaches[:count]


def _reach_of(address: int, name: str) -> int:
    from cuda.bindings import driver as cu

    attrs = (cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
             cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_SIZE)
    answers = []
    for attr in attrs:
        err, value = cu.cuPointerGetAttribute(attr, address)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise ValueError(f"{name}: address {address:#x} is not memory the CUDA driver knows "
                             f"({err.name})")
        answers.append(int(value))
    start, size = answers
    return start + size - address
