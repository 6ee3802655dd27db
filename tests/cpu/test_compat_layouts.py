"""The SGLang and LMCache drop-ins refuse bad arguments by name before any driver call
(their bytes are checked on a GPU: tests/gpu/test_gpu_compat_layouts.py)."""
from __future__ import annotations

import pytest

from kvcopy.compat import lmcache, pointer_tables, sglang

torch = pytest.importorskip("torch")


def test_lmcache_checks_its_chunk_and_sizes():
    ptrs = torch.tensor([4096], dtype=torch.int64)
    slots = torch.tensor([0])
    with pytest.raises(TypeError, match="key_value must be a 4-D torch.Tensor"):
        lmcache.multi_layer_kv_transfer(torch.zeros(2, 3), ptrs, slots, None, 8, True)
    with pytest.raises(ValueError, match="dimension 0 is 2, expected 1 \\(use_mla=True\\)"):
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
    table[1] = 12288          # an in-place write bumps the version: read again
    assert pointer_tables.addresses_of(table, "t") == [4096, 12288]


@pytest.mark.parametrize("call, error, words", [
    (lambda b, i: sglang.transfer_kv_per_layer(b, b, b, b, i, i, 0), ValueError,
     "item_size must be at least 1, got 0"),
    (lambda b, i: sglang.transfer_kv_per_layer(None, b, b, b, i, i, 64), TypeError,
     "src_k must be a torch.Tensor"),
    (lambda b, i: sglang.transfer_kv_per_layer_pf_lf(b, b, b, b, i, i, -1, 64, 128), ValueError,
     "layer_id must be at least 0, got -1"),
    (lambda b, i: sglang.transfer_kv_per_layer_mla(b, b, i, i, 1024), ValueError,
     "src: 512 bytes hold no item of 1024 bytes"),
    (lambda b, i: sglang.transfer_kv_all_layer_mla(b, b, i, i, 64, 0), ValueError,
     "num_layers must be at least 1, got 0"),
])
def test_sglang_bad_arguments_are_named(call, error, words):
    buf = torch.zeros((8, 64), dtype=torch.uint8)
    with pytest.raises(error) as info:
        call(buf, torch.tensor([0]))
    assert words in str(info.value)
