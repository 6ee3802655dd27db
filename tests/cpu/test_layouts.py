"""Layouts and row plans on the CPU: every engine layout's addresses, checked by running
the plan's pointer copies between host arrays against an oracle in NumPy, and every
bad argument refused, named, before anything is enqueued."""

from __future__ import annotations

import numpy as np
import pytest

from kvcopy import Layout
from kvcopy.testing import cuda, plans
from helpers.host_copies import random_bytes, run_on_host
from helpers.rows_fakes import GpuIndices

BLOCKS, BLOCK_SIZE, HEADS, HEAD = 6, 4, 2, 8  # bytes: a head is 8 one-byte elements
LAYERS = 3


def move(src: Layout, dst: Layout, src_indices=None, dst_indices=None, rows=None) -> None:
    run_on_host(*plans.expand(plans.plan_rows(src, dst, src_indices, dst_indices, rows)))


def vllm_caches(seed: int) -> list[np.ndarray]:
    """vLLM flash-attention caches: one [2, blocks, block_size, heads, head] per layer."""
    return [random_bytes((2, BLOCKS, BLOCK_SIZE, HEADS, HEAD), seed + i) for i in range(LAYERS)]


def test_paged_caches_gather_into_a_token_chunk_by_slot_mapping():
    caches = vllm_caches(1)
    tokens = 7
    chunk = np.zeros((2, LAYERS, tokens, HEADS * HEAD), np.uint8)
    slots = np.array([5, 0, -1, 23, 9, 14, 2])
    move(Layout.of(caches, planes=(0,), page=1, slot=2), Layout.of(chunk, planes=(1, 0), slot=2), slots, None)
    for t, s in enumerate(slots):
        for layer in range(LAYERS):
            for kv in range(2):
                want = (
                    caches[layer][kv].reshape(-1, HEADS * HEAD)[s]
                    if s >= 0
                    else np.zeros(HEADS * HEAD, np.uint8)
                )
                np.testing.assert_array_equal(chunk[kv, layer, t], want)


def test_a_token_chunk_scatters_back_and_skipped_slots_stay_untouched():
    caches = vllm_caches(2)
    before = [c.copy() for c in caches]
    chunk = random_bytes((2, LAYERS, 4, HEADS * HEAD), 3)
    slots = [3, -1, 17, 8]
    move(Layout.of(chunk, planes=(1, 0), slot=2), Layout.of(caches, planes=(0,), page=1, slot=2), None, slots)
    for layer in range(LAYERS):
        want = before[layer].reshape(2, -1, HEADS * HEAD).copy()
        for t, s in enumerate(slots):
            if s >= 0:
                want[:, s] = chunk[:, layer, t]
        np.testing.assert_array_equal(caches[layer].reshape(2, -1, HEADS * HEAD), want)


def test_heads_first_pages_gather_into_tokens_piece_by_piece():
    # HND: [2, blocks, heads, block_size, head]; a token's heads lie block_size*head apart
    hnd = random_bytes((2, BLOCKS, HEADS, BLOCK_SIZE, HEAD), 4)
    chunk = np.zeros((2, 5, HEADS, HEAD), np.uint8)
    slots = np.array([1, 22, 7, 0, 13])
    src = Layout.of(hnd, planes=(0,), page=1, slot=3, pieces=2)
    assert (src.pieces, src.piece_bytes, src.row_bytes) == (HEADS, HEAD, HEADS * HEAD)
    move(src, Layout.of(chunk, planes=(0,), slot=1), slots, None)
    for t, s in enumerate(slots):
        page, within = divmod(int(s), BLOCK_SIZE)
        np.testing.assert_array_equal(chunk[:, t], hnd[:, page, :, within])


def test_one_layer_of_a_page_first_host_pool_into_a_layer_first_gpu_buffer():
    # SGLang: host [tokens, layers, item] (page first), device one [tokens, item] per layer
    host = random_bytes((40, LAYERS, 2, 16), 5)
    layer = np.zeros((40, 2, 16), np.uint8)
    src = Layout.of(host, planes=(1,), slot=0).select(1)
    move(src, Layout.of(layer, slot=0), [4, 9, 33], [0, 39, 7])
    for s, d in ((4, 0), (9, 39), (33, 7)):
        np.testing.assert_array_equal(layer[d], host[s, 1])
    assert not layer[[1, 2, 3]].any()


def test_whole_blocks_as_rows_between_per_layer_caches_and_a_cross_layer_pool():
    caches = vllm_caches(6)
    pool = np.zeros((4, LAYERS, 2, BLOCK_SIZE, HEADS, HEAD), np.uint8)  # [blocks, layers, 2, ...]
    src = Layout.of(caches, planes=(0,), slot=1)  # a row is a whole block
    dst = Layout.of(pool, planes=(1, 2), slot=0)
    move(src, dst, [5, 2], [3, 0])
    for layer in range(LAYERS):
        np.testing.assert_array_equal(pool[3, layer], caches[layer][:, 5])
        np.testing.assert_array_equal(pool[0, layer], caches[layer][:, 2])


def test_strided_runs_of_fragments():
    # a run: num_fragments fragments of fragment_size, each side at its own stride
    src = random_bytes((4096,), 7)
    dst = np.zeros(4096, np.uint8)
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    runs = Layout.from_pointers(
        [base_s + 0, base_s + 1024], slots=6, row_bytes=32, slot_stride=96, keep=(src,)
    )
    into = Layout.from_pointers(
        [base_d + 64, base_d + 2048], slots=6, row_bytes=32, slot_stride=40, keep=(dst,)
    )
    move(runs, into, rows=6)
    for plane, (s0, d0) in enumerate(((0, 64), (1024, 2048))):
        for f in range(6):
            np.testing.assert_array_equal(
                dst[d0 + 40 * f : d0 + 40 * f + 32], src[s0 + 96 * f : s0 + 96 * f + 32]
            )


def test_rows_copied_onto_themselves_inside_one_cache_are_allowed():
    cache = random_bytes((10, 16), 8)
    before = cache.copy()
    layout = Layout.of(cache, slot=0)
    move(layout, layout, [1, 2], [1, 2])
    move(layout, layout, [0, 3], [5, 6])
    np.testing.assert_array_equal(cache[[5, 6]], before[[0, 3]])


@pytest.mark.parametrize(
    "args, error, words",
    [
        (dict(src_indices=[0, 10]), ValueError, "src_indices[1] = 10 is out of range"),
        (dict(dst_indices=[0, 2, 2]), ValueError, "rows 1 and 2 both write slot 2"),
        (dict(src_indices=[0, 1], dst_indices=[0]), ValueError, "src_indices has 2 rows"),
        (dict(src_indices=[0.5]), TypeError, "src_indices: indices must be integers"),
        (dict(src_indices=[[1]]), ValueError, "one-dimensional"),
        (dict(dst_indices=np.array([2**63], np.uint64)), ValueError, "does not fit int64"),
        (dict(), ValueError, "rows: give the number of rows"),
        (dict(rows=11), ValueError, "src has 10 slots and no indices"),
        (dict(rows=-1), ValueError, "rows must be at least 0, got -1"),
        (
            dict(src_indices=[0, 1], dst_indices=GpuIndices(2)),
            ValueError,
            "must both be on the GPU or both on the host; got src_indices on the host and "
            "dst_indices on the GPU",
        ),
    ],
)
def test_bad_indices_are_named(args, error, words):
    a, b = np.zeros((10, 16), np.uint8), np.zeros((12, 16), np.uint8)
    with pytest.raises(error) as info:
        plans.plan_rows(Layout.of(a, slot=0), Layout.of(b, slot=0), **args)
    assert words in str(info.value)


def test_layouts_that_do_not_pair_are_refused():
    a = np.zeros((4, 2, 16), np.uint8)
    with pytest.raises(ValueError, match="src has 2 planes and dst 1"):
        plans.plan_rows(Layout.of(a, planes=(1,), slot=0), Layout.of(a[:, 0], slot=0), [0], [1])
    with pytest.raises(ValueError, match="src rows are 32 bytes and dst rows 16"):
        plans.plan_rows(Layout.of(a, slot=0), Layout.of(a[:, 0], slot=0), [0], [1])
    with pytest.raises(TypeError, match="src must be a kvcopy.Layout"):
        plans.plan_rows(a, Layout.of(a, slot=0), [0], [1])


def test_a_row_reading_what_another_writes_in_shared_memory_is_refused():
    cache = np.zeros((10, 16), np.uint8)
    layout = Layout.of(cache, slot=0)
    with pytest.raises(ValueError, match="a row reads bytes another row writes"):
        plans.plan_rows(layout, layout, [1, 2], [2, 3])


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(slot=5), "slot: 5 is not a dimension"),
        (dict(slot=0, page=0), "page: dimension 0 is already slot"),
        (dict(slot=0, planes=(True,)), "planes[0]: True is not a dimension"),
    ],
)
def test_bad_dimensions_are_named(kwargs, words):
    with pytest.raises(ValueError) as info:
        Layout.of(np.zeros((4, 2, 16), np.uint8), **kwargs)
    assert words in str(info.value)


def test_rows_that_are_not_contiguous_are_refused():
    with pytest.raises(ValueError, match="must be contiguous"):
        Layout.of(np.zeros((4, 2, 16), np.uint8)[:, :, ::2], slot=0)
    with pytest.raises(ValueError, match="differ from tensors\\[0\\]"):
        Layout.of([np.zeros((4, 16), np.uint8), np.zeros((5, 16), np.uint8)], slot=0)


def test_from_pointers_checks_its_numbers():
    with pytest.raises(ValueError, match="bases: every base address must be a positive"):
        Layout.from_pointers([0], slots=1, row_bytes=8)
    with pytest.raises(ValueError, match="row_bytes \\(10\\) must be a multiple of pieces"):
        Layout.from_pointers([64], slots=1, row_bytes=10, pieces=4)
    with pytest.raises(TypeError, match="slots must be an int"):
        Layout.from_pointers([64], slots="4", row_bytes=8)
    with pytest.raises(ValueError, match="piece_stride must be at least 0, got -8"):
        Layout.from_pointers([64], slots=1, row_bytes=8, piece_stride=-8)


@pytest.mark.parametrize("slots", [12, 100_000])  # a bitmap of the slots, or a sort
def test_repeated_destinations_are_found_whatever_the_layouts_size(slots):
    a, b = np.zeros((10, 16), np.uint8), np.zeros((slots, 16), np.uint8)
    src, dst = Layout.of(a, slot=0), Layout.of(b, slot=0)
    plans.plan_rows(src, dst, [0, 1, 2, 3], [-1, 5, -1, 11])  # skipped rows may repeat -1
    with pytest.raises(ValueError, match="rows 1 and 3 both write slot 11"):
        plans.plan_rows(src, dst, [0, 1, 2, 3], [-1, 11, 4, 11])
    with pytest.raises(ValueError, match=rf"dst_indices\[2\] = {slots} is out of range"):
        plans.plan_rows(src, dst, [0, 1, 2], [0, 1, slots])


def test_row_slots_ok_answers_in_one_pass():
    ok = cuda.plan_arrays.row_slots_ok
    slots = np.array([3, -1, 7, -1, 0], np.int64)
    assert ok(slots, 8, True) == 1
    assert ok(slots, 7, False) == 0  # 7 is out of range
    assert ok(np.array([3, 3], np.int64), 8, True) == 0  # a repeat
    assert ok(np.array([3, 3], np.int64), 8, False) == 1  # repeats allowed on a source side
    assert ok(np.array([3, 3], np.int64), 1000, True) == 0  # a repeat in a hash table
    assert ok(np.array([], np.int64), 0, True) == 1
