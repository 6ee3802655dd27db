"""Property-based tests of planning: for random block maps, layouts and sizes the
planned copies move exactly the intended bytes (applied to NumPy buffers)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcopy._plans.blocks import plan_blocks
from kvcopy._plans.copies import plan_copies
from kvcopy.testing import cuda


def apply(plan) -> None:
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist()):
        ctypes.memmove(d, s, n)


@st.composite
def copy_lists(draw):
    pool = 4096
    n = draw(st.integers(0, 40))
    sizes = draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))
    src_off = [draw(st.integers(0, pool - 64)) for _ in range(n)]
    # non-overlapping destinations: sorted, spaced slots, sometimes back to back (merge)
    dst_off, cursor = [], 0
    for size in sizes:
        cursor += draw(st.sampled_from([0, 0, 1, 7]))
        dst_off.append(cursor)
        cursor += size
    order = draw(st.permutations(range(n)))
    return ([src_off[i] for i in order], [dst_off[i] for i in order], [sizes[i] for i in order])


@given(copy_lists(), st.booleans())
@settings(max_examples=200, deadline=None)
def test_planned_copies_move_exactly_the_intended_bytes(case, merge):
    src_off, dst_off, sizes = case
    src = np.random.default_rng(len(sizes)).integers(0, 255, 4096, dtype=np.uint8)
    dst = np.zeros(4096 + 64 * 48, dtype=np.uint8)
    expected = dst.copy()
    for s, d, n in zip(src_off, dst_off, sizes):
        expected[d : d + n] = src[s : s + n]
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    plan = plan_copies(
        np.asarray([base_s + o for o in src_off], dtype=np.uint64),
        np.asarray([base_d + o for o in dst_off], dtype=np.uint64),
        np.asarray(sizes, dtype=np.uint64),
        merge=merge,
    )
    apply(plan)
    np.testing.assert_array_equal(dst, expected)
    assert plan.total_bytes == sum(sizes)
    assert 0 not in plan.sizes.tolist()
    assert all(sizes[i] > 0 for i in plan.origin.tolist())


@st.composite
def block_cases(draw):
    layout = draw(st.sampled_from(["plain", "kv_2_by_blocks", "blocks_by_2", "split"]))
    num_src = draw(st.integers(1, 12))
    num_dst = draw(st.integers(1, 12))
    tail = draw(st.sampled_from([(4,), (2, 3), (1, 8)]))
    pairs = draw(st.integers(0, min(num_src, num_dst)))
    src_ids = draw(st.permutations(range(num_src)))[:pairs]
    factor = 2 if layout == "split" else 1
    dst_ids = draw(st.permutations(range(num_dst * factor)))[:pairs]
    tensors = draw(st.integers(1, 3))
    return layout, num_src, num_dst, tail, list(zip(src_ids, dst_ids)), tensors


@given(block_cases())
@settings(max_examples=150, deadline=None)
def test_block_plans_match_a_numpy_gather(case):
    layout, num_src, num_dst, tail, mapping, tensors = case
    rng = np.random.default_rng(num_src * 31 + num_dst)
    srcs, dsts, expect = [], [], []
    for _ in range(tensors):
        if layout == "kv_2_by_blocks":
            s_full = rng.integers(0, 255, (2, num_src) + tail, dtype=np.uint8)
            d_full = np.zeros((2, num_dst) + tail, dtype=np.uint8)
            pairs = [(s_full[k], d_full[k]) for k in range(2)]
        elif layout == "blocks_by_2":
            s_full = rng.integers(0, 255, (num_src, 2) + tail, dtype=np.uint8)
            d_full = np.zeros((num_dst, 2) + tail, dtype=np.uint8)
            pairs = [(s_full[:, k], d_full[:, k]) for k in range(2)]
        elif layout == "split":
            s = rng.integers(0, 255, (num_src,) + tail, dtype=np.uint8)
            d = np.zeros((num_dst, 2) + tail, dtype=np.uint8)  # each dst block holds 2 src blocks
            pairs = [(s, d)]
        else:
            pairs = [
                (
                    rng.integers(0, 255, (num_src,) + tail, dtype=np.uint8),
                    np.zeros((num_dst,) + tail, dtype=np.uint8),
                )
            ]
        for s, d in pairs:
            want = d.copy()
            flat = want.reshape(-1, *tail) if layout == "split" else want
            for a, b in mapping:
                flat[b] = s[a]
            srcs.append(s)
            dsts.append(d)
            expect.append(want)
    plan = plan_blocks(
        srcs, dsts, np.asarray(mapping, dtype=np.int64).reshape(-1, 2), split_blocks=layout == "split"
    ).copy_plan()
    apply(plan)
    for got, want in zip(dsts, expect):
        np.testing.assert_array_equal(got, want)


@settings(max_examples=300, deadline=None)
@given(
    src_blocks=st.integers(1, 300),
    dst_blocks=st.integers(1, 3000),
    ids=st.lists(st.tuples(st.integers(-2, 310), st.integers(-2, 3010)), max_size=60),
)
def test_block_ids_are_refused_exactly_when_out_of_range_or_written_twice(src_blocks, dst_blocks, ids):
    """The one-pass C check (dense destinations: a bitmap; sparse: bounds, then a sort)
    refuses exactly what the NumPy oracle does, with the same messages."""
    src = np.zeros((src_blocks, 8), np.uint8)
    dst = np.zeros((dst_blocks, 8), np.uint8)
    mapping = np.array(ids, dtype=np.int64).reshape(-1, 2)
    s, d = mapping[:, 0], mapping[:, 1]
    out_of_range = ((s < 0) | (s >= src_blocks) | (d < 0) | (d >= dst_blocks)).any()
    twice = len(np.unique(d)) < len(d)
    if not (out_of_range or twice):
        plan = plan_blocks(src, dst, mapping)
        assert np.array_equal(plan.mapping, mapping)
        return
    with pytest.raises(ValueError) as info:
        plan_blocks(src, dst, mapping)
    message = str(info.value)
    if out_of_range:
        assert "is out of range" in message
    else:
        assert "both write destination block" in message


def _numpy_addresses(mapping, column, base, stride, factor, block_bytes):
    """Block addresses by NumPy, tensor-major (the oracle of block_addresses)."""
    ids = mapping[:, column].astype(np.uint64)[None, :]
    factor = factor[:, None]
    return (
        base[:, None] + (ids // factor) * stride[:, None] + (ids % factor) * np.uint64(block_bytes)
    ).ravel()


@settings(max_examples=200, deadline=None)
@given(
    tensors=st.integers(1, 5),
    pairs=st.integers(0, 60),
    column=st.sampled_from([0, 1]),
    block_bytes=st.sampled_from([1, 64, 2048, 1 << 20]),
    data=st.data(),
)
def test_block_addresses_match_numpy(tensors, pairs, column, block_bytes, data):
    u64 = st.integers(0, 2**64 - 1)
    base = np.array(data.draw(st.lists(u64, min_size=tensors, max_size=tensors)), np.uint64)
    stride = np.array(
        data.draw(st.lists(st.integers(0, 2**40), min_size=tensors, max_size=tensors)), np.uint64
    )
    factor = np.array(
        data.draw(st.lists(st.sampled_from([1, 1, 2, 3, 8]), min_size=tensors, max_size=tensors)), np.uint64
    )
    mapping = np.array(
        data.draw(st.lists(st.integers(0, 2**31), min_size=2 * pairs, max_size=2 * pairs)), np.int64
    ).reshape(pairs, 2)
    with np.errstate(over="ignore"):
        expected = _numpy_addresses(mapping, column, base, stride, factor, block_bytes)
    found = cuda.plan_arrays.block_addresses(mapping[:, column], base, stride, factor, block_bytes)
    assert found.dtype == np.uint64
    np.testing.assert_array_equal(found, expected)


@settings(max_examples=200, deadline=None)
@given(
    tensors=st.integers(1, 5),
    pairs=st.integers(0, 60),
    block_bytes=st.sampled_from([1, 64, 2048, 1 << 20]),
    data=st.data(),
)
def test_block_copies_match_numpy_from_a_tensor_table(tensors, pairs, block_bytes, data):
    def column(values) -> np.ndarray:
        return np.array(data.draw(st.lists(values, min_size=tensors, max_size=tensors)), np.uint64)

    bases = [column(st.integers(0, 2**64 - 1)) for _ in range(2)]
    strides = [column(st.integers(0, 2**40)) for _ in range(2)]
    factors = [column(st.sampled_from([1, 1, 2, 3, 8])) for _ in range(2)]
    table = np.stack([*bases, *strides, *factors], axis=1)
    mapping = np.array(
        data.draw(st.lists(st.integers(0, 2**31), min_size=2 * pairs, max_size=2 * pairs)), np.int64
    ).reshape(pairs, 2)
    src, dst, sizes = cuda.plan_arrays.block_copies(mapping, table, block_bytes)
    with np.errstate(over="ignore"):
        for side, found in ((0, src), (1, dst)):
            expected = _numpy_addresses(mapping, side, bases[side], strides[side], factors[side], block_bytes)
            np.testing.assert_array_equal(found, expected)
    assert sizes.dtype == np.uint64 and sizes.tolist() == [block_bytes] * (tensors * pairs)


@pytest.mark.parametrize(
    "ids, lengths, match",
    [
        (np.zeros((3, 2), np.int64), (1, 1, 1), "wrong number of dimensions"),
        (np.zeros(3, np.int64), (2, 1, 2), "differ in length"),
    ],
)
def test_block_addresses_refuses_bad_arguments(ids, lengths, match):
    base, stride, factor = (np.ones(k, np.uint64) for k in lengths)
    with pytest.raises(ValueError, match=match):
        cuda.plan_arrays.block_addresses(ids, base, stride, factor, 64)
