"""SGLang's test of its JIT HiCache kernels (``sglang.jit_kernel.hicache``), run on
kvcopy.compat.sglang_jit.

Ported from sgl-project/sglang, ``python/sglang/jit_kernel/tests/test_hicache.py``
at commit 191eac96edd703ca40e475004cc068501529be35: ``test_hicache`` with its grid
whole (batch sizes 32 to 4096 and their unaligned neighbours, both block quotas,
world sizes 1 to 16 slicing a token's 1024 elements, int32 and int64 indices), the
one-layer and the all-layer transfers both ways, sorted random indices, bytes
compared exactly. The pools are SGLang's on the GPU (512 Ki slots on the GPU, twice
that in pinned host memory, 4 layers of K and V); on the CPU they hold 8 Ki and
16 Ki slots, enough for the largest batch.
"""

from __future__ import annotations

import itertools

import pytest

from kvcopy.compat import sglang_jit

torch = pytest.importorskip("torch")

LAYERS = 4
DTYPE = torch.float16
ROW = 1024
SLOTS = {"cuda": 512 * 1024, "host": 8 * 1024}  # the GPU-side pool; the host's is twice
BS_LIST = [2**n for n in range(5, 13)]
BS_LIST += [x + i + 1 for i, x in enumerate(BS_LIST)]
BLOCK_QUOTA = [1, 2]
WORLD_SIZE = [1, 2, 4, 8, 16]
IDTYPES = [torch.int32, torch.int64]

_pools: dict[str, tuple] = {}


def _pools_of(place) -> tuple:
    """(device pool, host pool, their K and V tables of layer addresses, slots): made
    once per place, as SGLang's module makes them once."""
    if place.name not in _pools:
        size = SLOTS[place.name]
        device = torch.empty((2, LAYERS, size, ROW), dtype=DTYPE, device=place.device)
        host = place.pinned(torch.empty((2, LAYERS, 2 * size, ROW), dtype=DTYPE))

        def tables(pool):
            return tuple(
                torch.tensor(
                    [pool[kv][i].data_ptr() for i in range(LAYERS)], dtype=torch.uint64, device=place.device
                )
                for kv in (0, 1)
            )

        _pools.clear()  # (one place's pools at a time)
        _pools[place.name] = (device, host, tables(device), tables(host), size)
    return _pools[place.name]


def _indices(place, count: int, size: int, dtype) -> "torch.Tensor":
    found = torch.randperm(size, dtype=dtype, device=place.device)[:count].sort().values
    assert bool(torch.all(found >= 0)) and bool(torch.all(found < size))
    return found


@pytest.mark.parametrize(
    "batch_size, block_quota, world_size, dtype",
    list(itertools.product(BS_LIST, BLOCK_QUOTA, WORLD_SIZE, IDTYPES)),
)
def test_hicache(place, batch_size, block_quota, world_size, dtype):
    device_kv, host_kv, device_tables, host_tables, size = _pools_of(place)
    dim = ROW // world_size
    stride = device_kv.stride(-2) * DTYPE.itemsize
    assert stride == host_kv.stride(-2) * DTYPE.itemsize
    device_kv, host_kv = device_kv[..., :dim], host_kv[..., :dim]

    # one layer at a time: host -> device, then device -> host
    host_at = _indices(place, batch_size, 2 * size, dtype)
    device_at = _indices(place, batch_size, size, dtype)
    values = torch.randn((2, LAYERS, batch_size, dim), dtype=DTYPE)
    host_kv[:, :, host_at.cpu(), :] = values
    for i in range(LAYERS):
        sglang_jit.transfer_hicache_one_layer(
            k_cache_dst=device_kv[0, i],
            v_cache_dst=device_kv[1, i],
            indices_dst=device_at,
            k_cache_src=host_kv[0, i],
            v_cache_src=host_kv[1, i],
            indices_src=host_at,
            block_quota=block_quota,
        )
    assert torch.equal(device_kv[:, :, device_at, :].cpu(), values)
    values = torch.randn((2, LAYERS, batch_size, dim), dtype=DTYPE)
    device_kv[:, :, device_at, :] = values.to(place.device)
    for i in range(LAYERS):
        sglang_jit.transfer_hicache_one_layer(
            k_cache_dst=host_kv[0, i],
            v_cache_dst=host_kv[1, i],
            indices_dst=host_at,
            k_cache_src=device_kv[0, i],
            v_cache_src=device_kv[1, i],
            indices_src=device_at,
            block_quota=block_quota,
        )
    place.sync()
    assert torch.equal(host_kv[:, :, host_at.cpu(), :], values)

    # every layer at once, by address: host -> device, then device -> host
    host_at = _indices(place, batch_size, 2 * size, dtype)
    device_at = _indices(place, batch_size, size, dtype)
    values = torch.randn((2, LAYERS, batch_size, dim), dtype=DTYPE)
    host_kv[:, :, host_at.cpu(), :] = values
    sglang_jit.transfer_hicache_all_layer(
        k_ptr_dst=device_tables[0],
        v_ptr_dst=device_tables[1],
        indices_dst=device_at,
        k_ptr_src=host_tables[0],
        v_ptr_src=host_tables[1],
        indices_src=host_at,
        kv_cache_src_stride_bytes=stride,
        kv_cache_dst_stride_bytes=stride,
        element_size=dim * DTYPE.itemsize,
        block_quota=block_quota,
    )
    assert torch.equal(device_kv[:, :, device_at, :].cpu(), values)
    values = torch.randn((2, LAYERS, batch_size, dim), dtype=DTYPE)
    device_kv[:, :, device_at, :] = values.to(place.device)
    sglang_jit.transfer_hicache_all_layer(
        k_ptr_dst=host_tables[0],
        v_ptr_dst=host_tables[1],
        indices_dst=host_at,
        k_ptr_src=device_tables[0],
        v_ptr_src=device_tables[1],
        indices_src=device_at,
        kv_cache_src_stride_bytes=stride,
        kv_cache_dst_stride_bytes=stride,
        element_size=dim * DTYPE.itemsize,
        block_quota=block_quota,
    )
    place.sync()
    assert torch.equal(host_kv[:, :, host_at.cpu(), :], values)
