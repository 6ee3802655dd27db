"""The SGLang and LMCache drop-ins refuse bad arguments by name before any driver call;
SGLang's page-head layout puts each head where SGLang's offsets do, run between host
buffers (the drop-ins' bytes are checked on a GPU: tests/gpu/test_gpu_compat_layouts.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcopy import Layout
from kvcopy.compat import lmcache, pointer_tables, sglang
from kvcopy.testing import plans
from helpers.host_copies import random_bytes, run_on_host

torch = pytest.importorskip("torch")


def test_lmcache_checks_its_chunk_and_sizes():
    ptrs = torch.tensor([4096], dtype=torch.int64)
    slots = torch.tensor([0])
    with pytest.raises(TypeError, match="key_value must be a 4-D torch.Tensor"):
        lmcache.multi_layer_kv_transfer(torch.zeros(2, 3), ptrs, slots, None, 8, True)
    with pytest.raises(ValueError, match="dimension 0 is 2, expected 1 \\(NL_X_NB_BS_HS\\)"):
        lmcache.multi_layer_kv_transfer(torch.zeros(2, 1, 1, 8), ptrs, slots, None, 8, True, True)
    with pytest.raises(ValueError, match="page_buffer_size must be at least 1, got 0"):
        lmcache.multi_layer_kv_transfer(torch.zeros(2, 1, 1, 8), ptrs, slots, None, 0, True)
    with pytest.raises(ValueError, match="key_value_ptrs has 1 layers, key_value 2"):
        lmcache.multi_layer_kv_transfer(torch.zeros(2, 2, 1, 8), ptrs, slots, None, 8, True)


def test_pointer_tables_are_checked_and_read_once_per_version():
    with pytest.raises(TypeError, match="key_value_ptrs must be a 1-D int64"):
        pointer_tables.addresses_of(torch.zeros(2, dtype=torch.float32), "key_value_ptrs")
    with pytest.raises(ValueError, match="an address is 0"):
        pointer_tables.addresses_of(torch.tensor([4096, 0]), "t")
    table = torch.tensor([4096, 8192])
    assert pointer_tables.addresses_of(table, "t") == [4096, 8192]
    table[1] = 12288  # an in-place write bumps the version: read again
    assert pointer_tables.addresses_of(table, "t") == [4096, 12288]


def test_a_new_table_where_an_old_one_was_is_read_anew():
    memory = np.array([4096, 8192], dtype=np.int64)
    first = torch.from_numpy(memory)
    assert pointer_tables.addresses_of(first, "t") == [4096, 8192]
    del first
    memory[:] = [12288, 16384]  # another table at the same address, length and version
    second = torch.from_numpy(memory)
    assert pointer_tables.addresses_of(second, "t") == [12288, 16384]
    memory[0] = 20480  # written behind torch's back: the same table is kept
    assert pointer_tables.addresses_of(second, "t") == [12288, 16384]


@pytest.mark.parametrize(
    "call, error, words",
    [
        (
            lambda b, i: sglang.transfer_kv_per_layer(b, b, b, b, i, i, 0),
            ValueError,
            "item_size must be at least 1, got 0",
        ),
        (
            lambda b, i: sglang.transfer_kv_per_layer(None, b, b, b, i, i, 64),
            TypeError,
            "src_k must be a torch.Tensor",
        ),
        (
            lambda b, i: sglang.transfer_kv_per_layer_pf_lf(b, b, b, b, i, i, -1, 64, 128),
            ValueError,
            "layer_id must be at least 0, got -1",
        ),
        (
            lambda b, i: sglang.transfer_kv_per_layer_mla(b, b, i, i, 1024),
            ValueError,
            "src: 512 bytes hold no item of 1024 bytes",
        ),
        (
            lambda b, i: sglang.transfer_kv_all_layer_mla(b, b, i, i, 64, 0),
            ValueError,
            "num_layers must be at least 1, got 0",
        ),
        (
            lambda b, i: sglang.transfer_kv_per_layer_ph_lf(b, b, b, b, i, i, 0, 48, 96, 4, 5),
            ValueError,
            "item_size (48) and the layout_dim (96) must be multiples of head_num (5)",
        ),
        (
            lambda b, i: sglang.transfer_kv_per_layer_ph_lf(b, b, b, b, i, i, 2, 64, 128, 1, 2),
            ValueError,
            "src_k: layer 2 of 64 bytes does not fit a layout_dim of 128",
        ),
        (
            lambda b, i: sglang.transfer_kv_per_layer_ph_lf(b, b, b, b, i, i, 0, 64, 128, 8, 2),
            ValueError,
            "src_k: holds no page of 8 tokens of 128 bytes",
        ),
        (
            lambda b, i: sglang.transfer_kv_all_layer_lf_ph(b, b, b, b, i, i, 64, 128, 2, 0, 2),
            ValueError,
            "page_size must be at least 1, got 0",
        ),
        # a layer past a token's layout_dim, or a layout_dim below one item, would read
        # another token's layers
        (
            lambda b, i: sglang.transfer_kv_per_layer_pf_lf(b, b, b, b, i, i, 2, 16, 32),
            ValueError,
            "layer_id 2: its item of 16 bytes ends at byte 48 of a token, past src_layout_dim (32)",
        ),
        (
            lambda b, i: sglang.transfer_kv_per_layer_pf_lf(b, b, b, b, i, i, 0, 64, 32),
            ValueError,
            "layer_id 0: its item of 64 bytes ends at byte 64 of a token, past src_layout_dim (32)",
        ),
        (
            lambda b, i: sglang.transfer_kv_per_layer_mla_pf_lf(b, b, i, i, 4, 8, 32),
            ValueError,
            "layer_id 4: its item of 8 bytes ends at byte 40 of a token, past src_layout_dim (32)",
        ),
    ],
)
def test_sglang_bad_arguments_are_named(call, error, words):
    buf = torch.zeros((8, 64), dtype=torch.uint8)
    with pytest.raises(error) as info:
        call(buf, torch.tensor([0]))
    assert words in str(info.value)


def _page_head_offset(
    token: int, layer: int, head: int, item: int, dim: int, page_size: int, heads: int
) -> int:
    """Where SGLang's kernel puts a head of a token's layer in a page-head buffer
    (get_global_offset_ph), byte for byte."""
    return (
        token // page_size * page_size * dim
        + dim // heads * head * page_size
        + token % page_size * dim // heads
        + layer * item // heads
    )


@pytest.mark.parametrize(
    "page_size, heads, layers, layer", [(4, 2, 3, 2), (1, 4, 2, 0), (16, 1, 1, 0), (3, 3, 2, 1)]
)
def test_sglang_page_head_rows_sit_where_sglangs_offsets_put_them(page_size, heads, layers, layer):
    head_dim, pages = 8, 3
    item, dim, tokens = heads * head_dim, layers * heads * head_dim, pages * page_size
    ph = (
        torch.from_numpy(random_bytes((tokens * dim,), 1)),
        torch.from_numpy(random_bytes((tokens * dim,), 2)),
    )
    lf = tuple(torch.zeros((tokens, item), dtype=torch.uint8) for _ in range(2))
    rng = np.random.default_rng(3)
    s = rng.permutation(tokens)[: tokens // 2 + 1]
    d = rng.permutation(tokens)[: len(s)]
    load = plans.plan_rows(
        sglang._page_head(ph, ("src_k", "src_v"), item, dim, range(layer, layer + 1), page_size, heads),
        sglang._buffers(lf, ("dst_k", "dst_v"), item, item),
        s,
        d,
    )
    run_on_host(*plans.expand(load))
    for page_head, layer_first in zip(ph, lf):
        want = np.zeros((tokens, item), np.uint8)
        for a, b in zip(s, d):
            for h in range(heads):
                at = _page_head_offset(a, layer, h, item, dim, page_size, heads)
                want[b, h * head_dim : (h + 1) * head_dim] = page_head.numpy()[at : at + head_dim]
        np.testing.assert_array_equal(layer_first.numpy(), want)

    back = tuple(torch.zeros(tokens * dim, dtype=torch.uint8) for _ in range(2))
    per_layer = [torch.from_numpy(random_bytes((tokens, item), 10 + k)) for k in range(2 * layers)]
    store = plans.plan_rows(
        Layout.from_pointers([t.data_ptr() for t in per_layer], slots=tokens, row_bytes=item),
        sglang._page_head(back, ("dst_k", "dst_v"), item, dim, range(layers), page_size, heads),
        d,
        s,
    )
    run_on_host(*plans.expand(store))
    for side, page_head in enumerate(back):
        want = np.zeros(tokens * dim, np.uint8)
        for b, a in zip(d, s):
            for lay in range(layers):
                row = per_layer[side * layers + lay].numpy()[b]
                for h in range(heads):
                    at = _page_head_offset(a, lay, h, item, dim, page_size, heads)
                    want[at : at + head_dim] = row[h * head_dim : (h + 1) * head_dim]
        np.testing.assert_array_equal(page_head.numpy(), want)


def _tokens_of(pages: list[int], page_size: int) -> torch.Tensor:
    return torch.tensor([p * page_size + i for p in pages for i in range(page_size)])


@pytest.mark.parametrize("mla", [False, True])
def test_sglang_direct_transfers_move_pages_as_sglang_does(mla):
    from kvcopy.testing import rows_on_host

    layers, page, heads, head_dim = 3, 4, 2, 8
    buffers = 1 if mla else 2
    device = [
        torch.from_numpy(random_bytes((10 * page, heads, head_dim), 20 + k)) for k in range(buffers * layers)
    ]  # K's layers, then V's
    host = [
        torch.zeros((6, layers, page, heads, head_dim), dtype=torch.uint8) for _ in range(buffers)
    ]  # page-first direct
    device_pages, host_pages = [2, 7, 4], [3, 0, 5]
    on_device, on_host = _tokens_of(device_pages, page), _tokens_of(host_pages, page)
    with rows_on_host():
        sglang.transfer_kv_all_layer_direct_lf_pf(device, host, on_device, on_host, page)
        back = [torch.zeros_like(device[0]) for _ in range(buffers)]
        sglang.transfer_kv_per_layer_direct_pf_lf(host, back, on_host, on_device, 1, page)
        moved = [torch.zeros_like(t) for t in device]
        order = torch.randperm(len(on_device), generator=torch.Generator().manual_seed(4))
        sglang.transfer_kv_direct(device, moved, on_device, order, page)
    for b in range(buffers):
        want = torch.zeros_like(host[b])
        for d, h in zip(device_pages, host_pages):
            for layer in range(layers):
                want[h, layer] = device[b * layers + layer][d * page : (d + 1) * page]
        assert torch.equal(host[b], want)
        want_back = torch.zeros_like(back[b])
        want_back[on_device] = device[b * layers + 1][on_device]
        assert torch.equal(back[b], want_back)
    for src, dst in zip(device, moved):
        want = torch.zeros_like(dst)
        want[order] = src[on_device]
        assert torch.equal(dst, want)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (
            lambda d, h, i: sglang.transfer_kv_all_layer_direct_lf_pf(d, h, i, i, 8),
            ValueError,
            "dst_ptrs: shape (6, 3, 4, 16) is not [pages, layers, page_size=8, ...]",
        ),
        (
            lambda d, h, i: sglang.transfer_kv_all_layer_direct_lf_pf(d[:5], h, i, i, 4),
            ValueError,
            "src_ptrs: 5 tensors are not 2 equal lists of layers",
        ),
        (
            lambda d, h, i: sglang.transfer_kv_per_layer_direct_pf_lf(h, d[:2], i, i, 3, 4),
            ValueError,
            "src_ptrs: layers 3 to 3 of 3",
        ),
        (
            lambda d, h, i: sglang.transfer_kv_per_layer_direct_pf_lf(h[0], d, i, i, 0, 4),
            TypeError,
            "src_ptrs must be a list of one or two page-first tensors",
        ),
        (
            lambda d, h, i: sglang.transfer_kv_direct(d, d[:2], i, i, 4),
            ValueError,
            "src_layers has 6 tensors and dst_layers 2",
        ),
        (
            lambda d, h, i: sglang.transfer_kv_direct(d[0], d, i, i, 4),
            TypeError,
            "src_layers must be a list of tensors, got Tensor",
        ),
    ],
)
def test_sglang_direct_arguments_are_named(call, error, words):
    device = [torch.zeros((40, 16), dtype=torch.uint8) for _ in range(6)]
    host = [torch.zeros((6, 3, 4, 16), dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(error) as info:
        call(device, host, torch.arange(4))
    assert words in str(info.value)


@pytest.mark.parametrize("mla", [False, True])
def test_sglang_all_layer_tables_must_hold_exactly_num_layers(mla):
    layers = [torch.zeros((8, 64), dtype=torch.uint8) for _ in range(3)]
    table = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    indices = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="src_(k_)?layers has 3 layers, num_layers is 2"):
        if mla:
            sglang.transfer_kv_all_layer_mla(table, table, indices, indices, 64, 2)
        else:
            sglang.transfer_kv_all_layer(table, table, table, table, indices, indices, 64, 2)


def test_a_tables_planes_are_counted_no_further_than_the_next_plane():
    # three layers of 5120 bytes in one allocator segment: each address reaches the
    # segment's end, so only the next layer's base says where a layer stops
    bases = [1 << 20, (1 << 20) + 5120, (1 << 20) + 10240]
    reaches = [1 << 21, (1 << 21) - 5120, (1 << 21) - 10240]
    assert pointer_tables.slots_apart(bases, reaches, 128) == 40
    assert pointer_tables.slots_apart(bases[::-1], reaches[::-1], 128) == 40
    # a plane named twice is left to the destination's overlap check
    assert pointer_tables.slots_apart([4096, 4096], [1024, 1024], 128) == 8
