"""SGLang's tests of its HiCache transfer ops (``sgl_kernel.kvcacheio``), run on
kvcopy.compat.sglang.

Ported from sgl-project/sglang, ``sgl-kernel/tests/test_kvcacheio.py`` at commit
0c52a1fd30bc9e8d7c8acd750c707fbea289b4e2: ``test_transfer_kv``,
``test_transfer_kv_pf_direct`` and ``test_transfer_kv_page_head``, their parameter
grids whole, the same pools, index draws, calls and oracles (torch indexing;
the page-head oracle assigns a token's heads at once where SGLang's loops over
them, the same assignment). Left out: SGLang's skip of the whole module on
CUDA 13 (a fault of its own kernel) and its HIP skip; a case SGLang returns from
early (fewer items than one page) is reported as skipped.
"""

from __future__ import annotations

import pytest

from kvcopy.compat import sglang

torch = pytest.importorskip("torch")

LAYERS = 4
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


def _pages(total_items: int, page_size: int, items: int) -> tuple:
    """SGLang's draw: the items of ``items // page_size`` random pages for the source
    and of as many others for the destination, as host int64 tensors."""
    pages = items // page_size
    if pages == 0:
        pytest.skip("fewer items than one page: SGLang's test returns early")
    order = torch.randperm(total_items // page_size, dtype=torch.int64)

    def slots(chosen):
        return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in chosen])

    return slots(order[:pages]), slots(order[pages : 2 * pages])


def _table(place, tensors) -> "torch.Tensor":
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=place.device)


@DTYPES
@pytest.mark.parametrize("num_items_to_transfer", [1, 128, 1024])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("item_size", [256])
@pytest.mark.parametrize("total_items_in_pool", [10240])
@pytest.mark.parametrize("is_mla", [False, True])
@pytest.mark.parametrize("all_layers", [False, True])
def test_transfer_kv(
    place, dtype, num_items_to_transfer, page_size, item_size, total_items_in_pool, is_mla, all_layers
):
    src_host, dst_host = _pages(total_items_in_pool, page_size, num_items_to_transfer)
    src_dev, dst_dev = src_host.to(place.device), dst_host.to(place.device)
    nbytes = item_size * dtype.itemsize
    sides = 1 if is_mla else 2  # (MLA: one pool; else K's and V's)
    src = [place.pinned(torch.randn(LAYERS, total_items_in_pool, item_size).to(dtype)) for _ in range(sides)]
    ref = [torch.zeros_like(s, device=place.device) for s in src]
    kernel = [torch.zeros_like(r) for r in ref]
    direct = [torch.zeros_like(r) for r in ref]
    layers = range(LAYERS) if all_layers else [0]
    for s, r in zip(src, ref):
        for layer in layers:
            r[layer][dst_dev] = s[layer][src_host].to(place.device)
    place.sync()

    if all_layers:
        if is_mla:
            sglang.transfer_kv_all_layer_mla(
                _table(place, src[0]),
                _table(place, kernel[0]),
                src_dev,
                dst_dev,
                item_size=nbytes,
                num_layers=LAYERS,
            )
        else:
            sglang.transfer_kv_all_layer(
                _table(place, src[0]),
                _table(place, kernel[0]),
                _table(place, src[1]),
                _table(place, kernel[1]),
                src_dev,
                dst_dev,
                item_size=nbytes,
                num_layers=LAYERS,
            )
    elif is_mla:
        sglang.transfer_kv_per_layer_mla(src[0][0], kernel[0][0], src_dev, dst_dev, item_size=nbytes)
    else:
        sglang.transfer_kv_per_layer(
            src[0][0], kernel[0][0], src[1][0], kernel[1][0], src_dev, dst_dev, item_size=nbytes
        )
    # the direct form: per-layer tensors (K's, then V's), host source indices beside
    # device destination indices, as SGLang's test passes them
    sglang.transfer_kv_direct(
        [s[layer] for s in src for layer in layers],
        [d[layer] for d in direct for layer in layers],
        src_host,
        dst_dev,
        page_size=page_size,
    )
    place.sync()
    for r, k, d in zip(ref, kernel, direct):
        torch.testing.assert_close(k, r)
        torch.testing.assert_close(d, r)


@DTYPES
@pytest.mark.parametrize("num_items_to_transfer", [128, 1024, 8192])
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("item_size", [256])
@pytest.mark.parametrize("total_items_in_pool", [20480])
@pytest.mark.parametrize("is_mla", [False, True])
@pytest.mark.parametrize("lf_to_pf", [False, True])
def test_transfer_kv_pf_direct(
    place, dtype, num_items_to_transfer, page_size, item_size, total_items_in_pool, is_mla, lf_to_pf
):
    src_host, dst_host = _pages(total_items_in_pool, page_size, num_items_to_transfer)
    pages = total_items_in_pool // page_size
    sides = 1 if is_mla else 2
    stream = torch.cuda.Stream() if place.gpu else None
    on_stream = torch.cuda.stream(stream) if place.gpu else _nothing()
    starts = range(0, len(src_host), page_size)
    if lf_to_pf:
        # per-layer device tensors -> page-first pinned host pools, every layer
        src = [
            torch.randn(LAYERS, total_items_in_pool, item_size).to(dtype).to(place.device)
            for _ in range(sides)
        ]
        ref = [
            place.pinned(torch.zeros(pages, LAYERS, page_size, item_size, dtype=dtype)) for _ in range(sides)
        ]
        direct = [place.pinned(torch.zeros_like(r)) for r in ref]
        place.sync()
        with on_stream:
            sglang.transfer_kv_all_layer_direct_lf_pf(
                [s[layer] for s in src for layer in range(LAYERS)], direct, src_host, dst_host, page_size
            )
        if stream is not None:
            stream.synchronize()
        for s, r in zip(src, ref):
            for layer in range(LAYERS):
                for i in starts:
                    r[int(dst_host[i]) // page_size][layer] = s[layer][
                        src_host[i : i + page_size].to(place.device)
                    ].cpu()
    else:
        # page-first pinned host pools -> layer 0's per-layer device tensors
        src = [place.pinned(torch.randn(pages, LAYERS, page_size, item_size).to(dtype)) for _ in range(sides)]
        ref = [
            torch.zeros(LAYERS, total_items_in_pool, item_size, dtype=dtype, device=place.device)
            for _ in range(sides)
        ]
        direct = [torch.zeros_like(r) for r in ref]
        place.sync()
        with on_stream:
            sglang.transfer_kv_per_layer_direct_pf_lf(
                src, [d[0] for d in direct], src_host, dst_host, 0, page_size
            )
        if stream is not None:
            stream.synchronize()
        for s, r in zip(src, ref):
            for i in starts:
                r[0][dst_host[i : i + page_size].to(place.device)] = s[int(src_host[i]) // page_size][0].to(
                    place.device
                )
    place.sync()
    for r, d in zip(ref, direct):
        torch.testing.assert_close(d, r)


@DTYPES
@pytest.mark.parametrize("num_items_to_transfer", [256, 1024])
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("item_size", [1024])
@pytest.mark.parametrize("head_num", [8, 16])
@pytest.mark.parametrize("total_items_in_pool", [4096])
@pytest.mark.parametrize("lf_to_ph", [False, True])
def test_transfer_kv_page_head(
    place, dtype, num_items_to_transfer, page_size, item_size, head_num, total_items_in_pool, lf_to_ph
):
    src_host, dst_host = _pages(total_items_in_pool, page_size, num_items_to_transfer)
    src_dev, dst_dev = src_host.to(place.device), dst_host.to(place.device)
    pages = total_items_in_pool // page_size
    head_dim = item_size // head_num
    nbytes = item_size * dtype.itemsize
    page_head = (pages, head_num, page_size, LAYERS, head_dim)
    if lf_to_ph:
        # every layer of per-layer device pools (by address) -> page-head pinned pools
        src = [
            torch.randn(LAYERS, total_items_in_pool, head_num, head_dim).to(dtype).to(place.device)
            for _ in range(2)
        ]
        ref = [place.pinned(torch.zeros(page_head, dtype=dtype)) for _ in range(2)]
        kernel = [place.pinned(torch.zeros_like(r)) for r in ref]
        place.sync()
        sglang.transfer_kv_all_layer_lf_ph(
            _table(place, src[0]),
            kernel[0],
            _table(place, src[1]),
            kernel[1],
            src_dev,
            dst_dev,
            nbytes,
            nbytes * LAYERS,
            LAYERS,
            page_size,
            head_num,
        )
        place.sync()
        for s, r in zip(src, ref):
            for layer in range(LAYERS):
                r[dst_host // page_size, :, dst_host % page_size, layer] = s[layer][src_dev].cpu()
    else:
        # page-head pinned pools -> layer 0 of per-layer device pools
        src = [place.pinned(torch.randn(page_head).to(dtype)) for _ in range(2)]
        ref = [
            torch.zeros(LAYERS, total_items_in_pool, head_num, head_dim, dtype=dtype, device=place.device)
            for _ in range(2)
        ]
        kernel = [torch.zeros_like(r) for r in ref]
        place.sync()
        sglang.transfer_kv_per_layer_ph_lf(
            src[0],
            kernel[0][0],
            src[1],
            kernel[1][0],
            src_dev,
            dst_dev,
            0,
            nbytes,
            nbytes * LAYERS,
            page_size,
            head_num,
        )
        place.sync()
        for s, r in zip(src, ref):
            r[0][dst_dev] = s[src_host // page_size, :, src_host % page_size, 0].to(place.device)
    place.sync()
    for r, k in zip(ref, kernel):
        torch.testing.assert_close(k, r)


class _nothing:
    """No stream to enter (the host runs every copy in order)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
