"""Tables of per-layer addresses that engines keep in tensors (LMCache's
``key_value_ptrs``, SGLang's ``*_layers``), read once per table.

Such a table lives on the GPU and rarely changes: reading it costs a
synchronisation, so its values are kept, keyed by the tensor's address, length and
torch's version counter (bumped by every in-place write), and read again only
when one of them changes.
"""
from __future__ import annotations

from typing import Any

_KEPT = 64
_tables: dict[tuple, list[int]] = {}


def addresses_of(table: Any, name: str) -> list[int]:
    """The addresses in a 1-D int64/uint64 tensor (any device), as Python ints."""
    import torch

    if not isinstance(table, torch.Tensor) or table.dim() != 1 \
            or table.dtype not in (torch.int64, torch.uint64):
        raise TypeError(f"{name} must be a 1-D int64 (or uint64) torch.Tensor of addresses")
    key = (table.data_ptr(), table.numel(), table.device.type, table._version)
    found = _tables.get(key)
    if found is None:
        values = table.cpu().numpy().view("uint64").tolist()
        if any(v == 0 for v in values):
            raise ValueError(f"{name}: an address is 0")
        if len(_tables) >= _KEPT:
            _tables.clear()
        found = _tables[key] = [int(v) for v in values]
    return found


_reach: dict[int, int] = {}


def reach_of(address: int) -> int:
    """Bytes from ``address`` to the end of the allocation holding it (device memory or
    pinned host memory), as the driver reports it: how far a layer given only by its
    address may be addressed."""
    found = _reach.get(address)
    if found is None:
        from cuda.bindings import driver as cu

        attrs = (cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                 cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_SIZE)
        answers = []
        for attr in attrs:
            err, value = cu.cuPointerGetAttribute(attr, address)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise ValueError(f"address {address:#x} is not memory the CUDA driver knows "
                                 f"({err.name})")
            answers.append(int(value))
        start, size = answers
        found = _reach[address] = start + size - address
    return found
