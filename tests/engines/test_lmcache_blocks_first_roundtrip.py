"""LMCache's round trip of vLLM's blocks-first pools through its per-layer
content-fused formats, run on kvcopy.compat.lmcache.

Ported from LMCache/LMCache, ``tests/v1/gpu_connector/test_blocks_first_kernel_
roundtrip.py`` at commit 0a353d636bbf6cf8a5a2370a07317fedf9bc9a5c:
``test_kernel_roundtrip_matches_torch`` with its grid whole (both head orders, with
and without padding layers in a block), the same pool, slots and call
(``head_size`` of half a head's content, the real block step), the gather compared
with a torch gather and the scatter into zeroed blocks compared with the pool.
Left out: the check of LMCache's own format detection (``detect_format``, not an op
kvcopy replaces); the format it must detect is passed directly.
"""

from __future__ import annotations

import pytest

from kvcopy.compat.lmcache import EngineKVFormat, TransferDirection, multi_layer_kv_transfer

torch = pytest.importorskip("torch")

NB, NL, NH, BS, CS = 8, 3, 2, 4, 16
SPT = NH * CS  # scalars per token
FORMATS = {"BLHNC": EngineKVFormat.NL_X_NB_NH_BS_CS, "BLNHC": EngineKVFormat.NL_X_NB_BS_NH_CS}


def _pool(place, order: str, pad_layers: int) -> tuple:
    """A blocks-first pool (``pad_layers`` more layer slots a block, as a pool shared
    with other groups has) and its layers' views."""
    inner = (NH, BS, CS) if order == "BLHNC" else (BS, NH, CS)
    total = NL + pad_layers
    pool = torch.arange(NB * total * NH * BS * CS, dtype=torch.float32, device=place.device).reshape(
        NB, total, *inner
    )
    return pool, [pool[:, layer] for layer in range(NL)]


def _gathered(pool, order: str, slots) -> "torch.Tensor":
    """[1, NL, tokens, SPT]: each token's layers, heads flattened, by torch indexing."""
    blocks, offsets = (slots // BS).tolist(), (slots % BS).tolist()
    layers = pool[:, :NL]
    rows = [
        (layers[b, :, :, o] if order == "BLHNC" else layers[b, :, o]).reshape(NL, SPT)
        for b, o in zip(blocks, offsets)
    ]
    return torch.stack(rows, dim=1).unsqueeze(0)


@pytest.mark.parametrize("order", ["BLHNC", "BLNHC"])
@pytest.mark.parametrize("pad_layers", [0, 2])
def test_kernel_roundtrip_matches_torch(place, order, pad_layers):
    pool, views = _pool(place, order, pad_layers)
    fmt = FORMATS[order]
    ptrs = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=place.device)
    block_stride = views[0].stride(0)
    assert block_stride == pool.stride(0)
    slots = torch.tensor([5, 6, 7, 12, 13, 14, 15, 28], device=place.device)
    staging = torch.zeros(1, NL, len(slots), SPT, dtype=torch.float32, device=place.device)

    multi_layer_kv_transfer(
        staging,
        ptrs,
        slots,
        torch.device(place.device),
        NB * BS,
        int(TransferDirection.D2H),
        int(fmt),
        BS,
        CS // 2,
        0,
        block_stride,
    )
    place.sync()
    assert torch.equal(staging.cpu(), _gathered(pool.cpu(), order, slots.cpu()))

    original = pool.clone()
    touched = sorted({int(s) // BS for s in slots.cpu()})
    for b in touched:
        pool[b, :NL].zero_()
    multi_layer_kv_transfer(
        staging,
        ptrs,
        slots,
        torch.device(place.device),
        NB * BS,
        int(TransferDirection.H2D),
        int(fmt),
        BS,
        CS // 2,
        0,
        block_stride,
    )
    place.sync()
    for b in touched:
        used = [int(s) % BS for s in slots.cpu() if int(s) // BS == b]
        if order == "BLHNC":
            assert torch.equal(pool[b, :NL, :, used], original[b, :NL, :, used])
        else:
            assert torch.equal(pool[b, :NL, used], original[b, :NL, used])
