"""LMCache's transfer ops as kvcopy rows (kvcopy.compat.lmcache): for each engine format,
the rows run between host buffers land where LMCache's kernel puts them
(page_buffer_offset, byte for byte), both ways; bad arguments are named (the ops'
bytes on a GPU: tests/gpu/test_gpu_compat_layouts.py)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kvcopy.compat import lmcache
from kvcopy.compat.lmcache import EngineKVFormat as F, TransferDirection
from kvcopy.testing import plans, rows_on_host
from helpers.host_copies import random_bytes, run_on_host

torch = pytest.importorskip("torch")

LAYERS, TOKENS, BLOCK, HEADS, HEAD = 2, 12, 4, 3, 4  # HEAD in int16 elements
SLOTS = 6 * BLOCK  # page_buffer_size


def lmcache_offset(fmt: F, kv: int, slot: int, row: int, head: int, step: int) -> np.ndarray:
    """Where LMCache's kernel reads or writes each byte of a token's row (its
    page_buffer_offset, in bytes)."""
    b = np.arange(row)
    block, at = divmod(slot, BLOCK)
    if fmt in (F.NB_NL_TWO_BS_NH_HS, F.NL_X_TWO_NB_BS_NH_HS):
        return kv * SLOTS * row + slot * row + b
    if fmt is F.NL_X_NB_TWO_BS_NH_HS:
        return block * 2 * BLOCK * row + kv * BLOCK * row + at * row + b
    if fmt in (F.NL_X_NB_BS_HS, F.NL_X_NBBS_ONE_HS):
        return slot * row + b
    if fmt in (F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_TWO_NH_BS_HS):
        h, o = divmod(b, head)
        heads = row // head
        if fmt is F.NL_X_TWO_NB_NH_BS_HS:
            return kv * SLOTS * row + block * heads * BLOCK * head + h * BLOCK * head + at * head + o
        return block * 2 * heads * BLOCK * head + kv * heads * BLOCK * head + h * BLOCK * head + at * head + o
    if fmt in (F.NL_X_NB_NH_BS_TWO_HS, F.NL_X_NB_NH_BS_CS):
        # [blocks, heads, block_size, content]: a head's K and V side by side
        h, o = divmod(b, 2 * head)
        return block * (step or row * BLOCK) + h * BLOCK * 2 * head + at * 2 * head + o
    assert fmt in (F.NL_X_NB_BS_NH_TWO_HS, F.NL_X_NB_BS_NH_CS)
    return block * (step or BLOCK * row) + at * row + b


CASES = [
    pytest.param(fmt, stride, id=f"{fmt.name}-{stride}")
    for fmt, stride in (
        (F.NB_NL_TWO_BS_NH_HS, 0),
        (F.NL_X_TWO_NB_BS_NH_HS, 0),
        (F.NL_X_NB_TWO_BS_NH_HS, 0),
        (F.NL_X_NB_BS_HS, 0),
        (F.NL_X_NBBS_ONE_HS, 0),
        (F.NL_X_TWO_NB_NH_BS_HS, 0),
        (F.NL_X_NB_TWO_NH_BS_HS, 0),
        (F.NL_X_NB_NH_BS_TWO_HS, 0),
        (F.NL_X_NB_NH_BS_TWO_HS, 400),
        (F.NL_X_NB_BS_NH_TWO_HS, 0),
        (F.NL_X_NB_BS_NH_TWO_HS, 300),
        (F.NL_X_NB_NH_BS_CS, 0),
        (F.NL_X_NB_NH_BS_CS, 400),
        (F.NL_X_NB_BS_NH_CS, 0),
        (F.NL_X_NB_BS_NH_CS, 300),
        (F.NL_X_TWO_NB_NH_ONE_BS_HS, 0),
    )
]

FUSED = (F.NL_X_NB_NH_BS_TWO_HS, F.NL_X_NB_BS_NH_TWO_HS, F.NL_X_NB_NH_BS_CS, F.NL_X_NB_BS_NH_CS)


@pytest.mark.parametrize("fmt, stride", CASES)
@pytest.mark.parametrize("direction", [TransferDirection.D2H, TransferDirection.H2D], ids=["D2H", "H2D"])
def test_each_format_moves_the_bytes_lmcaches_kernel_moves(fmt, stride, direction):
    fused = fmt in FUSED
    planes = 1 if fused or fmt in (F.NL_X_NB_BS_HS, F.NL_X_NBBS_ONE_HS) else 2
    hidden = HEADS * HEAD * (2 if fused else 1)
    row, head, step = hidden * 2, HEAD * 2, stride * 2
    # (LMCache's kernel takes half a content-fused head's content as its head size)
    head_size = HEAD
    oracle = F.NL_X_TWO_NB_NH_BS_HS if fmt is F.NL_X_TWO_NB_NH_ONE_BS_HS else fmt
    chunk = torch.from_numpy(random_bytes((planes, LAYERS, TOKENS, row), 1).view(np.int16))
    size = (
        max(
            int(lmcache_offset(oracle, kv, s, row, head, step)[-1])
            for kv in range(planes)
            for s in range(SLOTS)
        )
        + 1
    )
    paged = [random_bytes((size,), 2 + layer) for layer in range(LAYERS)]
    ptrs = torch.tensor([p.ctypes.data for p in paged], dtype=torch.int64)
    slot_mapping = np.random.default_rng(5).permutation(SLOTS)[:TOKENS].astype(np.int64)
    slot_mapping[4] = -1
    skip = 2
    before_chunk, before_paged = chunk.numpy().view(np.uint8).copy(), [p.copy() for p in paged]

    rows = lmcache.transfer_rows(
        chunk, ptrs, slot_mapping, SLOTS, direction, fmt, BLOCK, head_size, skip, stride
    )
    run_on_host(*plans.expand(plans.plan_rows(*rows[:4], rows=rows[4])))

    want_chunk, want_paged = before_chunk.copy(), [p.copy() for p in before_paged]
    for t in range(skip, TOKENS):
        s = int(slot_mapping[t])
        for layer in range(LAYERS):
            for kv in range(planes):
                at = lmcache_offset(oracle, kv, s, row, head, step)
                if s < 0:
                    continue
                if direction is TransferDirection.D2H:
                    want_chunk[kv, layer, t] = before_paged[layer][at]
                else:
                    want_paged[layer][at] = before_chunk[kv, layer, t]
    np.testing.assert_array_equal(chunk.numpy().view(np.uint8), want_chunk)
    for got, want in zip(paged, want_paged):
        np.testing.assert_array_equal(got, want)


def test_the_unilateral_op_takes_k_then_v_layers():
    row, slots = 32, 20
    chunk = torch.from_numpy(random_bytes((2, LAYERS, TOKENS, row), 3))
    paged = [np.zeros(slots * row, np.uint8) for _ in range(2 * LAYERS)]  # K's layers, V's
    ptrs = torch.tensor([p.ctypes.data for p in paged], dtype=torch.int64)
    slot_mapping = np.arange(TOKENS, dtype=np.int64)[::-1].copy()
    rows = lmcache.unilateral_rows(chunk, ptrs, slot_mapping, slots, TransferDirection.H2D)
    run_on_host(*plans.expand(plans.plan_rows(*rows[:4], rows=rows[4])))
    for t, s in enumerate(slot_mapping.tolist()):
        for layer in range(LAYERS):
            for kv in range(2):
                got = paged[kv * LAYERS + layer][s * row : (s + 1) * row]
                np.testing.assert_array_equal(got, chunk[kv, layer, t].numpy())


def test_formats_and_directions_come_by_name_value_or_the_older_bools():
    chunk = torch.zeros((1, 1, 2, 8), dtype=torch.int16)
    ptrs = torch.tensor([4096], dtype=torch.int64)
    theirs = types.SimpleNamespace(name="NL_X_NB_BS_HS", value=99)  # LMCache's pybind enum
    for fmt in (theirs, 3, np.int64(3), F.NL_X_NB_BS_HS, True):
        for direction in (types.SimpleNamespace(name="D2H"), 1, True):
            src, dst, src_indices, dst_indices, count = lmcache.transfer_rows(
                chunk, ptrs, np.array([0, 1]), 8, direction, fmt
            )
            assert (src.bases.tolist(), src_indices.tolist(), dst_indices, count) == ([4096], [0, 1], None, 2)
    skipped = lmcache.transfer_rows(chunk, ptrs, np.array([0, 1]), 8, False, True, 0, 0, 2)
    assert skipped is None
    longer = lmcache.transfer_rows(chunk, ptrs, np.array([5, 6, 7]), 8, False, True, 0, 0, 1)
    assert (longer[3].tolist(), longer[4]) == ([6], 1)  # LMCache reads the chunk's tokens' slots


@pytest.mark.parametrize(
    "args, error, words",
    [
        (
            dict(engine_kv_format=F.TWO_X_NL_X_NBBS_NH_HS),
            ValueError,
            "TWO_X_NL_X_NBBS_NH_HS: LMCache's multi_layer_kv_transfer does not take it (its layers go "
            "by multi_layer_kv_transfer_unilateral)",
        ),
        (dict(engine_kv_format=F.NB_NL_TWO_NH_BS_HS), ValueError, "does not take it"),
        (dict(engine_kv_format=18), ValueError, "engine_kv_format must be one of NB_NL_TWO_BS_NH_HS"),
        (
            dict(engine_kv_format=F.NL_X_NB_BSV_BSS),
            ValueError,
            "engine_kv_format NL_X_NB_BSV_BSS is not taken by kvcopy's drop-in: the DSA indexer's",
        ),
        (
            dict(engine_kv_format=types.SimpleNamespace(name="NL_X_TWO_X_NB_BS_NH_HS")),
            ValueError,
            "NL_X_TWO_X_NB_BS_NH_HS is not taken by kvcopy's drop-in: a layer's K and V come as a tuple",
        ),
        (dict(page_buffer_size=0), ValueError, "page_buffer_size must be at least 1, got 0"),
        (dict(engine_kv_format="vllm"), ValueError, "got 'vllm'"),
        (dict(direction="up"), ValueError, "direction must be one of H2D, D2H, got 'up'"),
        (
            dict(engine_kv_format=F.NL_X_NB_TWO_BS_NH_HS),
            ValueError,
            "block_size is needed for engine_kv_format NL_X_NB_TWO_BS_NH_HS",
        ),
        (
            dict(engine_kv_format=F.NL_X_TWO_NB_NH_BS_HS, block_size=4, head_size=3),
            ValueError,
            "head_size (3) must divide a token's row of 16 bytes into heads",
        ),
        (dict(skip_prefix_n_tokens=3), ValueError, "skip_prefix_n_tokens must be at most 2, got 3"),
        (dict(block_size=-1), ValueError, "block_size must be at least 0, got -1"),
    ],
)
def test_bad_arguments_are_named(args, error, words):
    call = dict(
        key_value=torch.zeros((2, 1, 2, 8), dtype=torch.int16),
        key_value_ptrs=torch.tensor([4096], dtype=torch.int64),
        slot_mapping=np.array([0, 1]),
        page_buffer_size=8,
        direction=True,
    )
    with pytest.raises(error) as info:
        lmcache.transfer_rows(**{**call, **args})
    assert words in str(info.value)


def test_a_kept_table_is_counted_against_every_chunk():
    ptrs = torch.tensor([4096, 8192], dtype=torch.int64)
    two = lmcache.transfer_rows(torch.zeros((2, 2, 2, 8)), ptrs, np.array([0, 1]), 8, True)
    assert two[0].num_planes == 4  # K and V of both layers
    with pytest.raises(ValueError, match="key_value_ptrs has 2 layers, key_value 3"):
        lmcache.transfer_rows(torch.zeros((2, 3, 2, 8)), ptrs, np.array([0, 1]), 8, True)
    with pytest.raises(
        ValueError,
        match=r"key_value_ptrs has 2 addresses, expected K's and V's "
        r"2 layers \(4\)",
    ):
        lmcache.unilateral_rows(torch.zeros((2, 2, 2, 8)), ptrs, np.array([0, 1]), 8, True)


def test_the_unilateral_op_counts_k_and_v_layers():
    with pytest.raises(
        ValueError,
        match=r"key_value_ptrs has 1 addresses, expected K's and V's "
        r"1 layers \(2\)",
    ):
        lmcache.unilateral_rows(torch.zeros((2, 1, 2, 8)), torch.tensor([4096]), np.array([0, 1]), 8, True)


def _layer_row(cache, fmt, kv, slot):
    """Where LMCache's single-layer kernel finds a token's row in a layer's vLLM tensor."""
    b, at = divmod(slot, BLOCK)
    return {
        F.NL_X_TWO_NB_BS_NH_HS: lambda: cache[kv, b, at],
        F.NL_X_NB_TWO_BS_NH_HS: lambda: cache[b, kv, at],
        F.NL_X_TWO_NB_NH_BS_HS: lambda: cache[kv, b, :, at],
        F.NL_X_NB_TWO_NH_BS_HS: lambda: cache[b, kv, :, at],
        F.NL_X_NB_BS_HS: lambda: cache[b, at],
    }[fmt]().reshape(-1)


LAYER_SHAPES = {
    F.NL_X_TWO_NB_BS_NH_HS: (2, 6, BLOCK, HEADS, HEAD),
    F.NL_X_NB_TWO_BS_NH_HS: (6, 2, BLOCK, HEADS, HEAD),
    F.NL_X_TWO_NB_NH_BS_HS: (2, 6, HEADS, BLOCK, HEAD),
    F.NL_X_NB_TWO_NH_BS_HS: (6, 2, HEADS, BLOCK, HEAD),
    F.NL_X_NB_BS_HS: (6, BLOCK, HEADS * HEAD),
}


@pytest.mark.parametrize("fmt", list(LAYER_SHAPES), ids=[f.name for f in LAYER_SHAPES])
@pytest.mark.parametrize("token_major", [True, False])
@pytest.mark.parametrize("direction", ["D2H", "H2D"])
def test_a_single_layer_moves_as_lmcaches_kernel_does(fmt, token_major, direction):
    from kvcopy.testing import rows_on_host

    mla = fmt is F.NL_X_NB_BS_HS
    hidden = HEADS * HEAD
    layer = torch.from_numpy(random_bytes(LAYER_SHAPES[fmt] + (2,), 6).view(np.int16)[..., 0])
    shape = (TOKENS, hidden) if mla else (TOKENS, 2, hidden) if token_major else (2, TOKENS, hidden)
    chunk = torch.from_numpy(random_bytes(shape + (2,), 7).view(np.int16)[..., 0])
    slot_mapping = torch.from_numpy(np.random.default_rng(8).permutation(6 * BLOCK)[:TOKENS])
    slot_mapping[3] = -1
    before_layer, before_chunk = layer.clone(), chunk.clone()
    with rows_on_host():
        lmcache.single_layer_kv_transfer(
            chunk, layer, slot_mapping, getattr(TransferDirection, direction), fmt, token_major
        )

    def chunk_row(tensor, t, kv):
        return tensor[t] if mla else tensor[t, kv] if token_major else tensor[kv, t]

    planes = range(1 if mla else 2)
    moved = [(t, s) for t, s in enumerate(slot_mapping.tolist()) if s >= 0]
    if direction == "D2H":
        want = before_chunk.clone()
        for t, s in moved:
            for kv in planes:
                chunk_row(want, t, kv).copy_(_layer_row(before_layer, fmt, kv, s))
        assert torch.equal(chunk, want) and torch.equal(layer, before_layer)
        return
    assert torch.equal(chunk, before_chunk)
    for t, s in moved:
        for kv in planes:
            assert torch.equal(_layer_row(layer, fmt, kv, s), chunk_row(chunk, t, kv))
    for s in set(range(6 * BLOCK)) - {s for _, s in moved}:
        for kv in planes:
            assert torch.equal(_layer_row(layer, fmt, kv, s), _layer_row(before_layer, fmt, kv, s))


def test_a_single_sglang_layer_moves_its_k_and_v_tensors():
    from kvcopy.testing import rows_on_host

    k, v = (torch.from_numpy(random_bytes((6, BLOCK, HEADS, HEAD), seed)) for seed in (9, 10))
    chunk = torch.zeros((TOKENS, 2, HEADS * HEAD), dtype=torch.uint8)
    slot_mapping = torch.arange(TOKENS) * 2
    with rows_on_host():
        lmcache.single_layer_kv_transfer_sgl(chunk, k, v, slot_mapping, True, True)
    for t, s in enumerate(slot_mapping.tolist()):
        assert torch.equal(chunk[t, 0], k[s // BLOCK, s % BLOCK].reshape(-1))
        assert torch.equal(chunk[t, 1], v[s // BLOCK, s % BLOCK].reshape(-1))


def test_a_single_layer_names_what_it_does_not_take():
    chunk, layer = torch.zeros((2, 4, 8)), torch.zeros((2, 3, 4, 2, 4))
    with pytest.raises(ValueError, match="NL_X_NB_NH_BS_TWO_HS: LMCache's single_layer_kv_"):
        lmcache.single_layer_kv_transfer(chunk, layer, [0], True, F.NL_X_NB_NH_BS_TWO_HS)
    with pytest.raises(
        TypeError,
        match=r"vllm_key_value_cache must be a 3-D torch.Tensor, got "
        r"shape \(2, 3, 4, 2, 4\)",
    ):
        lmcache.single_layer_kv_transfer(chunk, layer, [0], True, F.NL_X_NB_BS_HS)
    with pytest.raises(TypeError, match="token_major must be True or False"):
        lmcache.single_layer_kv_transfer(chunk, layer, [0], True, F.NL_X_TWO_NB_BS_NH_HS, "yes")


def test_a_block_stride_in_elements_is_kept_in_bytes_of_the_chunks_dtype():
    ptrs = torch.tensor([4096], dtype=torch.int64)
    strides = []
    for dtype, hidden in ((torch.int16, 16), (torch.int32, 8)):  # rows of 32 bytes each
        chunk = torch.zeros((1, 1, 2, hidden), dtype=dtype)
        paged = lmcache.transfer_rows(
            chunk, ptrs, np.array([0, 1]), 64, True, F.NL_X_NB_BS_NH_TWO_HS, BLOCK, 0, 0, 300
        )[0]
        strides.append(paged.page_stride)
    assert strides == [600, 1200]


def test_mla_takes_a_page_buffer_size_of_0_as_lmcaches_kernel_does():
    row = 16
    chunk = torch.from_numpy(random_bytes((1, LAYERS, 3, row), 7))
    paged = [np.zeros(40 * row, np.uint8) for _ in range(LAYERS)]
    ptrs = torch.tensor([p.ctypes.data for p in paged], dtype=torch.int64)
    slot_mapping = np.array([7, 39, 0], dtype=np.int64)
    for fmt in (F.NL_X_NB_BS_HS, F.NL_X_NBBS_ONE_HS):
        with rows_on_host():  # (the layers' extents from the host's mappings)
            rows = lmcache.transfer_rows(chunk, ptrs, slot_mapping, 0, TransferDirection.H2D, fmt)
        run_on_host(*plans.expand(plans.plan_rows(*rows[:4], rows=rows[4])))
        for t, s in enumerate(slot_mapping.tolist()):
            for layer in range(LAYERS):
                np.testing.assert_array_equal(
                    paged[layer][s * row : (s + 1) * row], chunk[0, layer, t].numpy()
                )
