"""Tables of per-layer addresses that engines keep in tensors (LMCache's
``key_value_ptrs``, SGLang's ``*_layers``), read once per table.

Such a table lives on the GPU and rarely changes: reading it costs a
synchronisation, so its values (and, where asked, how far each address reaches) are
kept for the table object (compat.per_tensors: read again when its address, length,
device or torch's version counter changes, and never reused for another tensor, even
one that torch's caching allocator puts at the same address). An inference tensor
has no version counter: its values are read once for the object.
"""

from __future__ import annotations

from typing import Any

from kvcopy._cuda import driver
from kvcopy.compat.per_tensors import PerTensors

_KEPT = 256


class _Table:
    """One table's addresses and, once asked for, how far each of them reaches."""

    __slots__ = ("addresses", "reaches")

    def __init__(self, addresses: list[int]) -> None:
        self.addresses = addresses
        self.reaches: list[int] = []


_tables = PerTensors(_KEPT)


def _read(table: Any, name: str) -> _Table:
    values = [int(v) for v in table.cpu().numpy().view("uint64").tolist()]
    if any(v == 0 for v in values):
        raise ValueError(f"{name}: an address is 0")
    return _Table(values)


def _kept(table: Any, name: str) -> _Table:
    import torch

    if (
        not isinstance(table, torch.Tensor)
        or table.dim() != 1
        or table.dtype not in (torch.int64, torch.uint64)
    ):
        raise TypeError(f"{name} must be a 1-D int64 (or uint64) torch.Tensor of addresses")
    return _tables.get([table], (), lambda: _read(table, name), contents=True)


def addresses_of(table: Any, name: str) -> list[int]:
    """The addresses in a 1-D int64/uint64 tensor (any device), as Python ints."""
    return _kept(table, name).addresses


def reaches_of(table: Any, name: str, count: int) -> list[int]:
    """For each of the first ``count`` addresses in ``table``, the bytes from it to the
    end of the allocation holding it (device memory or pinned host memory), as the
    driver reports it: how far a layer given only by its address may be addressed.
    ValueError naming the table where an address is not memory the driver knows."""
    found = _kept(table, name)
    for address in found.addresses[len(found.reaches) : count]:
        found.reaches.append(_reach_of(address, name))
    return found.reaches[:count]


def _reach_of(address: int, name: str) -> int:
    driver.init()  # NoDriverError, kvcopy's own, where there is no driver
    from cuda.bindings import driver as cu

    attrs = (
        cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    )
    answers = []
    for attr in attrs:
        err, value = cu.cuPointerGetAttribute(attr, address)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise ValueError(f"{name}: address {address:#x} is not memory the CUDA driver knows ({err.name})")
        answers.append(int(value))
    start, size = answers
    return start + size - address


def slots_apart(bases: list[int], reaches: list[int], row: int, stride: int | None = None) -> int:
    """Slots of ``row`` bytes, ``stride`` bytes apart (default ``row``), that every plane
    of an address table holds (``reaches``: each plane's bytes from its base), counted
    no further than the next plane's base: a table gives no plane's size, and the memory
    it reaches (an allocator's whole segment, the address space) runs on over the other
    planes. Planes named twice are left to the destination's overlap check."""
    ordered = sorted(set(bases))
    following = dict(zip(ordered, ordered[1:]))
    span = min(min(reach, following.get(base, base + reach) - base) for base, reach in zip(bases, reaches))
    step = row if stride is None else stride
    return 0 if span < row else (span - row) // max(step, 1) + 1
