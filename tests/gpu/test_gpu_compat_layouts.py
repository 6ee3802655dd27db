"""The SGLang and LMCache drop-ins on a real GPU, each against an oracle in torch of
what the original op does (read from their kernels: item addresses, -1 skipped).
Random bytes seen as bf16 hold NaNs: values are compared as bytes."""

from __future__ import annotations

import pytest

from kvcopy.compat import lmcache, sglang


def rand(torch, shape, seed, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return t.cuda() if device == "cuda" else t.pin_memory()


def slots(torch, n, pool, seed, skip=()):
    g = torch.Generator().manual_seed(seed)
    s = torch.randperm(pool, generator=g)[:n]
    for i in skip:
        s[i] = -1
    return s.cuda()


@pytest.mark.parametrize("use_mla", [False, True])
@pytest.mark.parametrize("direction", [True, False])
def test_lmcache_multi_layer_kv_transfer(torch_cuda, use_mla, direction):
    torch = torch_cuda
    planes, layers, tokens, hidden, pbs = (1 if use_mla else 2), 4, 24, 64, 96
    paged = [rand(torch, (planes, pbs, hidden * 2), i).view(torch.bfloat16) for i in range(layers)]
    before = [p.clone() for p in paged]
    chunk = rand(torch, (planes, layers, tokens, hidden * 2), 9, device="host").view(torch.bfloat16)
    original = chunk.clone()
    ptrs = torch.tensor([p.data_ptr() for p in paged], dtype=torch.int64, device="cuda")
    mapping = slots(torch, tokens, pbs, 3, skip=(2,))
    lmcache.multi_layer_kv_transfer(chunk, ptrs, mapping, torch.device("cuda"), pbs, direction, use_mla)
    torch.cuda.synchronize()
    for t, s in enumerate(mapping.tolist()):
        for layer in range(layers):
            if direction:
                want = paged[layer][:, s].cpu() if s >= 0 else original[:, layer, t]
                assert torch.equal(chunk[:, layer, t].view(torch.uint8), want.view(torch.uint8))
            elif s >= 0:
                assert torch.equal(
                    paged[layer][:, s].cpu().view(torch.uint8), original[:, layer, t].view(torch.uint8)
                )
    if not direction:
        untouched = sorted(set(range(pbs)) - set(mapping.tolist()))
        for layer in range(layers):
            assert torch.equal(
                paged[layer][:, untouched].view(torch.uint8), before[layer][:, untouched].view(torch.uint8)
            )


@pytest.mark.parametrize("fmt", ["NL_X_NB_TWO_NH_BS_HS", "NL_X_NB_NH_BS_TWO_HS"])
def test_lmcache_formats_by_heads_and_blocks(torch_cuda, fmt):
    torch = torch_cuda
    F = lmcache.EngineKVFormat
    layers, blocks, block, heads, head, tokens = 3, 10, 16, 4, 64, 40
    fused = fmt == "NL_X_NB_NH_BS_TWO_HS"
    shape = (blocks, heads, block, 2 * head) if fused else (blocks, 2, heads, block, head)
    paged = [
        rand(torch, shape + (2,), 40 + layer).view(torch.bfloat16).squeeze(-1) for layer in range(layers)
    ]
    planes, hidden = (1, heads * 2 * head) if fused else (2, heads * head)
    with torch.inference_mode():  # (as an engine's table often is: no version counter)
        ptrs = torch.tensor([p.data_ptr() for p in paged], dtype=torch.int64, device="cuda")
    mapping = slots(torch, tokens, blocks * block, 11, skip=(5,))
    chunk = torch.zeros((planes, layers, tokens, hidden), dtype=torch.bfloat16).pin_memory()

    def cache_row(caches, layer, kv, s):  # a token's heads, as LMCache's format lays them out
        b, at = divmod(s, block)
        return (caches[layer][b, :, at] if fused else caches[layer][b, kv, :, at]).reshape(-1)

    def transfer(direction):
        lmcache.multi_layer_kv_transfer(
            chunk, ptrs, mapping, torch.device("cuda"), blocks * block, direction, F[fmt], block, head, 2
        )
        torch.cuda.synchronize()

    moved = [(t, s) for t, s in enumerate(mapping.tolist()) if t >= 2 and s >= 0]  # 2 skipped
    transfer(lmcache.TransferDirection.D2H)
    rows = [(layer, kv) for layer in range(layers) for kv in range(planes)]
    for t, s in moved:
        for layer, kv in rows:
            assert torch.equal(
                chunk[kv, layer, t].view(torch.uint8), cache_row(paged, layer, kv, s).cpu().view(torch.uint8)
            )
    assert not chunk[:, :, [t for t in range(tokens) if t not in dict(moved)]].any()
    before = [p.clone() for p in paged]
    for p in paged:
        p.zero_()
    transfer(lmcache.TransferDirection.H2D)
    for t, s in moved:
        for layer, kv in rows:
            assert torch.equal(
                cache_row(paged, layer, kv, s).view(torch.uint8),
                cache_row(before, layer, kv, s).view(torch.uint8),
            )
    assert sum(int(p.count_nonzero()) for p in paged) <= len(moved) * len(rows) * hidden


def test_lmcache_single_layer_hnd_and_sglang(torch_cuda):
    torch = torch_cuda
    blocks, block, heads, head, tokens = 8, 16, 4, 128, 50
    layer = rand(torch, (2, blocks, heads, block, head * 2), 60).view(torch.bfloat16)
    k, v = (rand(torch, (blocks, block, heads, head * 2), seed).view(torch.bfloat16) for seed in (61, 62))
    mapping = slots(torch, tokens, blocks * block, 13, skip=(7,))
    chunk = torch.zeros((tokens, 2, heads * head), dtype=torch.bfloat16).pin_memory()
    sgl_chunk = torch.zeros((2, tokens, heads * head), dtype=torch.bfloat16).pin_memory()
    lmcache.single_layer_kv_transfer(
        chunk,
        layer,
        mapping,
        lmcache.TransferDirection.D2H,
        lmcache.EngineKVFormat.NL_X_TWO_NB_NH_BS_HS,
        True,
    )
    lmcache.single_layer_kv_transfer_sgl(sgl_chunk, k, v, mapping, True, False)
    torch.cuda.synchronize()
    for t, s in enumerate(mapping.tolist()):
        b, at = divmod(s, block)
        for kv, sgl in ((0, k), (1, v)):
            got, got_sgl = chunk[t, kv].view(torch.uint8), sgl_chunk[kv, t].view(torch.uint8)
            if s < 0:
                assert not got.any() and not got_sgl.any()
                continue
            assert torch.equal(got, layer[kv, b, :, at].reshape(-1).view(torch.uint8).cpu())
            assert torch.equal(got_sgl, sgl[b, at].reshape(-1).view(torch.uint8).cpu())


def test_sglang_per_layer_and_mla(torch_cuda):
    torch = torch_cuda
    item = 256
    src_k, src_v = rand(torch, (64, item), 1), rand(torch, (64, item), 2)
    dst_k = torch.zeros((80, item), dtype=torch.uint8).pin_memory()
    dst_v = torch.zeros((80, item), dtype=torch.uint8).pin_memory()
    s, d = slots(torch, 20, 64, 3), slots(torch, 20, 80, 4, skip=(0,))
    sglang.transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, s, d, item)
    sglang.transfer_kv_per_layer_mla(src_v, dst_k, s, d, item)
    torch.cuda.synchronize()
    for a, b in zip(s.tolist(), d.tolist()):
        if b >= 0:
            assert torch.equal(dst_k[b], src_v[a].cpu())  # the MLA call wrote K last
            assert torch.equal(dst_v[b], src_v[a].cpu())
    assert not dst_k[[i for i in range(80) if i not in d.tolist()]].any()


def test_sglang_page_first_host_and_layer_tables(torch_cuda):
    torch = torch_cuda
    layers, tokens, item = 3, 50, 128
    dim = layers * item
    host_k = rand(torch, (tokens, layers, item), 5, device="host")
    host_v = rand(torch, (tokens, layers, item), 6, device="host")
    dev_k = [torch.zeros((40, item), dtype=torch.uint8, device="cuda") for _ in range(layers)]
    dev_v = [torch.zeros((40, item), dtype=torch.uint8, device="cuda") for _ in range(layers)]
    s, d = slots(torch, 16, tokens, 7), slots(torch, 16, 40, 8)
    for layer in range(layers):  # load: page-first host -> layer-first device, layer by layer
        sglang.transfer_kv_per_layer_pf_lf(host_k, dev_k[layer], host_v, dev_v[layer], s, d, layer, item, dim)
    torch.cuda.synchronize()
    for a, b in zip(s.tolist(), d.tolist()):
        for layer in range(layers):
            assert torch.equal(dev_k[layer][b].cpu(), host_k[a, layer])
            assert torch.equal(dev_v[layer][b].cpu(), host_v[a, layer])
    # backup: layer-first device (a table of layer addresses) -> page-first host
    k_table = torch.tensor([t.data_ptr() for t in dev_k], dtype=torch.int64, device="cuda")
    v_table = torch.tensor([t.data_ptr() for t in dev_v], dtype=torch.int64, device="cuda")
    back_k = torch.zeros_like(host_k).pin_memory()
    back_v = torch.zeros_like(host_v).pin_memory()
    sglang.transfer_kv_all_layer_lf_pf(k_table, back_k, v_table, back_v, d, s, item, dim, layers)
    sglang.transfer_kv_all_layer_mla_lf_pf(v_table, back_k, d, s, item, dim, layers)
    other_k = [torch.zeros_like(t) for t in dev_k]
    other_v = [torch.zeros_like(t) for t in dev_v]
    sglang.transfer_kv_all_layer(
        k_table,
        torch.tensor([t.data_ptr() for t in other_k], device="cuda"),
        v_table,
        torch.tensor([t.data_ptr() for t in other_v], device="cuda"),
        d,
        d,
        item,
        layers,
    )
    sglang.transfer_kv_all_layer_mla(
        v_table, torch.tensor([t.data_ptr() for t in other_k], device="cuda"), d, d, item, layers
    )
    torch.cuda.synchronize()
    for a in s.tolist():
        for layer in range(layers):
            assert torch.equal(back_v[a, layer], host_v[a, layer])
            assert torch.equal(back_k[a, layer], host_v[a, layer])  # the MLA call wrote V there
    for b in d.tolist():
        for layer in range(layers):
            assert torch.equal(other_k[layer][b], dev_v[layer][b])
            assert torch.equal(other_v[layer][b], dev_v[layer][b])
    back = torch.zeros((40, item), dtype=torch.uint8, device="cuda")
    sglang.transfer_kv_per_layer_mla_pf_lf(host_k, back, s, d, 1, item, dim)
    torch.cuda.synchronize()
    for a, b in zip(s.tolist(), d.tolist()):
        assert torch.equal(back[b].cpu(), host_k[a, 1])


def test_sglang_page_head_host_and_layer_tables(torch_cuda):
    torch = torch_cuda
    layers, heads, head_dim, page_size, pages = 3, 4, 32, 8, 6
    item, tokens = heads * head_dim, page_size * pages
    dim = layers * item
    dev_k = [rand(torch, (40, item), 20 + layer) for layer in range(layers)]
    dev_v = [rand(torch, (40, item), 30 + layer) for layer in range(layers)]
    k_table = torch.tensor([t.data_ptr() for t in dev_k], dtype=torch.int64, device="cuda")
    v_table = torch.tensor([t.data_ptr() for t in dev_v], dtype=torch.int64, device="cuda")
    host_k = torch.zeros((pages, heads, page_size, layers, head_dim), dtype=torch.uint8).pin_memory()
    host_v = torch.zeros_like(host_k).pin_memory()
    d, s = slots(torch, 16, 40, 9), slots(torch, 16, tokens, 10, skip=(3,))
    # backup: layer-first device (by address) -> page-head host, every layer in one call
    sglang.transfer_kv_all_layer_lf_ph(
        k_table, host_k, v_table, host_v, d, s, item, dim, layers, page_size, heads
    )
    torch.cuda.synchronize()
    written = set()
    for a, b in zip(d.tolist(), s.tolist()):
        if b < 0:
            continue
        written.add(b)
        for layer in range(layers):
            for host, dev in ((host_k, dev_k), (host_v, dev_v)):
                want = dev[layer][a].cpu().view(heads, head_dim)
                assert torch.equal(host[b // page_size, :, b % page_size, layer], want)
    for t in set(range(tokens)) - written:
        assert not host_k[t // page_size, :, t % page_size].any()
    # load: page-head host -> layer-first device, one layer
    back_k = torch.zeros((40, item), dtype=torch.uint8, device="cuda")
    back_v = torch.zeros_like(back_k)
    sglang.transfer_kv_per_layer_ph_lf(host_k, back_k, host_v, back_v, s, d, 1, item, dim, page_size, heads)
    torch.cuda.synchronize()
    for b, a in zip(s.tolist(), d.tolist()):
        if b >= 0:
            assert torch.equal(back_k[a], dev_k[1][a])
            assert torch.equal(back_v[a], dev_v[1][a])
        else:
            assert not back_k[a].any()


def test_sglang_direct_page_first_host_and_device_layers(torch_cuda):
    torch = torch_cuda
    layers, page, heads, head_dim = 4, 16, 8, 64
    device = [
        rand(torch, (64 * page, heads, head_dim * 2), 50 + k).view(torch.bfloat16) for k in range(2 * layers)
    ]  # K's layers, then V's
    host = [
        torch.zeros((12, layers, page, heads, head_dim), dtype=torch.bfloat16).pin_memory() for _ in range(2)
    ]
    device_pages, host_pages = [9, 2, 40, 17, 63], [11, 0, 5, 6, 3]

    def tokens(pages):
        return torch.tensor([p * page + i for p in pages for i in range(page)], device="cuda")

    on_device, on_host = tokens(device_pages), tokens(host_pages)
    sglang.transfer_kv_all_layer_direct_lf_pf(device, host, on_device, on_host, page)
    back = [torch.zeros_like(device[0]) for _ in range(2)]
    sglang.transfer_kv_per_layer_direct_pf_lf(host, back, on_host, on_device, 2, page)
    moved = [torch.zeros_like(t) for t in device]
    sglang.transfer_kv_direct(device, moved, on_device, on_device.flip(0), page)
    torch.cuda.synchronize()
    as_bytes = [t.view(torch.uint8) for t in device]
    for kv in range(2):
        for d, h in zip(device_pages, host_pages):
            for layer in range(layers):
                assert torch.equal(
                    host[kv][h, layer].view(torch.uint8),
                    as_bytes[kv * layers + layer][d * page : (d + 1) * page].cpu(),
                )
        assert torch.equal(back[kv][on_device].view(torch.uint8), as_bytes[kv * layers + 2][on_device])
    for src, dst in zip(as_bytes, moved):
        assert torch.equal(dst.view(torch.uint8)[on_device.flip(0)], src[on_device])
    untouched = [t for t in range(64 * page) if t not in set(on_device.tolist())]
    assert not back[0].view(torch.uint8)[untouched].any()


def test_vllm_copy_backend_moves_runs_of_fragments(torch_cuda):
    from kvcopy.compat.vllm import CopyBackendAdapter, CopyRunDescriptor

    torch = torch_cuda
    gpu = rand(torch, (1 << 20,), 11)
    host = torch.zeros(1 << 23, dtype=torch.uint8).pin_memory()
    g, h = gpu.data_ptr(), host.data_ptr()
    store = [CopyRunDescriptor(g + k * 65536, h + k * 512, 512, 128, 512, 4096) for k in range(8)]
    store += [CopyRunDescriptor(g + 600000, h + 7000000, 128, 100, 128, 1024)]
    load = [(h + k * 512, g + 700000 + k * 64, 64, 32, 4096, 256) for k in range(3)]
    back = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    load += [(h + 7000000, back.data_ptr(), 128, 100, 1024, 128)]
    stores = CopyBackendAdapter(layer_refs_per_group=[], gpu_to_cpu=True)
    loads = CopyBackendAdapter(layer_refs_per_group=[], gpu_to_cpu=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # vLLM's worker submits on a stream of its own
        stores.submit(1, store)
        loads.submit(2, load, is_src_access_order_any=True)  # an earlier worker's call
    side.synchronize()
    stores.finish_transfer(1)
    loads.finish_transfer(2)
    data, host_data = gpu.cpu(), host.clone()
    for src, dst, size, count, src_stride, dst_stride in store:
        for j in range(count):
            lo, to = src - g + j * src_stride, dst - h + j * dst_stride
            assert torch.equal(host[to : to + size], data[lo : lo + size])
    for k in range(3):  # the loads read back what the stores wrote
        for j in range(32):
            lo, to = k * 512 + j * 4096, 700000 + k * 64 + j * 256
            assert torch.equal(data[to : to + 64], host_data[lo : lo + 64])
    assert torch.equal(back[:12800].cpu(), data[600000:612800])
