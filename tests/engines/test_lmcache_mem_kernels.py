"""LMCache's tests of its transfer kernels, run on kvcopy.compat.lmcache.

Ported from LMCache/LMCache, ``tests/v1/test_mem_kernels.py`` at commit
0256be78a62a80f56d008e3b408f0549f3f24fcd: ``test_multi_layer_kernel``,
``test_multi_layer_kernel_use_mla`` and ``test_single_layer_kernel``, their grids
whole (256, 500, 1024 and 8000 tokens; token-major or not), the same caches
(vLLM's flash-attention layers ``[2, 1000 blocks, 16, 8 heads, 128]`` and MLA layers
``[1000 blocks, 64, 576]``, bfloat16), random slots, chunks of 256 tokens, the op
called with that commit's arguments (``multi_layer_kv_transfer``'s seventh argument
``use_mla``, kvcopy's ``engine_kv_format`` place) and the caches compared at the
slots after a round trip. Where LMCache's test builds its expected chunks with its
older per-layer op (``load_and_reshape_flash``), this one gathers them with torch;
the older single-layer op took a layer's K and V as two tensors, kvcopy's takes
the layer's tensor and its format. The caches hold 32 layers on the GPU and 4 on
the CPU (host memory for 32 such layers is 4 GiB). Left out:
``test_extract_and_load_back``, a test of LMCache's per-layer
``load_and_reshape_flash`` and ``reshape_and_cache_back_flash`` (ops kvcopy does
not replace), LMCache's NPU branches and its timing prints.
"""

from __future__ import annotations

import random

import pytest

from kvcopy.compat.lmcache import EngineKVFormat, multi_layer_kv_transfer, single_layer_kv_transfer

torch = pytest.importorskip("torch")

TOKENS = pytest.mark.parametrize("num_tokens", [256, 500, 1024, 8000])
NUM_BLOCKS, HEADS, HEAD = 1000, 8, 128
CHUNK = 256
DTYPE = torch.bfloat16


def _layers(place) -> int:
    return 32 if place.gpu else 4


def _flash_caches(place, block_size: int = 16) -> list:
    return [
        torch.rand(2, NUM_BLOCKS, block_size, HEADS, HEAD, dtype=DTYPE, device=place.device)
        for _ in range(_layers(place))
    ]


def _slots(place, block_size: int, count: int) -> "torch.Tensor":
    return torch.tensor(random.sample(range(NUM_BLOCKS * block_size), count), device=place.device)


def _ptrs(place, caches) -> "torch.Tensor":
    """The layers' addresses in pinned host memory, as LMCache's test keeps them."""
    return place.pinned(torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64))


def _equal_at(old, new, slots, mla: bool) -> None:
    for a, b in zip(old, new):
        rows = (lambda c: c.reshape(-1, c.shape[-1])) if mla else (lambda c: c.reshape(2, -1, HEADS, HEAD))
        if mla:
            assert torch.equal(rows(a)[slots], rows(b)[slots])
        else:
            assert torch.equal(rows(a)[:, slots], rows(b)[:, slots])


@TOKENS
def test_multi_layer_kernel(place, num_tokens):
    layers = _layers(place)
    caches = _flash_caches(place)
    slots = _slots(place, 16, num_tokens)
    pages = NUM_BLOCKS * 16
    chunks = []
    for part in torch.split(slots, CHUNK):
        chunk = place.pinned(torch.empty(2, layers, len(part), HEADS * HEAD, dtype=DTYPE))
        multi_layer_kv_transfer(chunk, _ptrs(place, caches), part, caches[0].device, pages, True, False)
        chunks.append(chunk)
    place.sync()
    for part, chunk in zip(torch.split(slots, CHUNK), chunks):
        for layer, cache in enumerate(caches):
            flat = cache.reshape(2, -1, HEADS * HEAD)
            assert torch.equal(chunk[:, layer].to(place.device), flat[:, part])

    back = _flash_caches(place)
    for part, chunk in zip(torch.split(slots, CHUNK), chunks):
        multi_layer_kv_transfer(chunk, _ptrs(place, back), part, back[0].device, pages, False, False)
    place.sync()
    _equal_at(caches, back, slots, mla=False)


@TOKENS
def test_multi_layer_kernel_use_mla(place, num_tokens):
    layers, block_size, head_size = _layers(place), 64, 576

    def mla_caches():
        return [
            torch.rand(NUM_BLOCKS, block_size, head_size, dtype=DTYPE, device=place.device)
            for _ in range(layers)
        ]

    caches = mla_caches()
    slots = _slots(place, block_size, num_tokens)
    chunks = []
    for part in torch.split(slots, CHUNK):
        chunk = place.pinned(torch.empty(1, layers, len(part), head_size, dtype=DTYPE))
        multi_layer_kv_transfer(chunk, _ptrs(place, caches), part, caches[0].device, 0, True, True)
        chunks.append(chunk)
    place.sync()
    for part, chunk in zip(torch.split(slots, CHUNK), chunks):
        for layer, cache in enumerate(caches):
            expected = cache.reshape(-1, head_size)[part]
            assert torch.equal(chunk[0, layer].to(place.device), expected)

    back = mla_caches()
    for part, chunk in zip(torch.split(slots, CHUNK), chunks):
        multi_layer_kv_transfer(chunk, _ptrs(place, back), part, back[0].device, 0, False, True)
    place.sync()
    _equal_at(caches, back, slots, mla=True)


@TOKENS
@pytest.mark.parametrize("token_major", [True, False])
def test_single_layer_kernel(place, num_tokens, token_major):
    caches, back = _flash_caches(place), _flash_caches(place)
    slots = _slots(place, 16, num_tokens)
    shape = (num_tokens, 2, HEADS * HEAD) if token_major else (2, num_tokens, HEADS * HEAD)
    buffer = torch.empty(shape, dtype=DTYPE, device=place.device)
    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    for cache, new in zip(caches, back):
        single_layer_kv_transfer(buffer, cache, slots, True, fmt, token_major)
        single_layer_kv_transfer(buffer, new, slots, False, fmt, token_major)
    place.sync()
    _equal_at(caches, back, slots, mla=False)
