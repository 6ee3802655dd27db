"""Batches whose result would depend on the order of their copies are refused, from
memory ranges (CPU: every refusal comes before any driver call)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvcopy
from kvcopy._plans import races, overlaps
from kvcopy._plans.blocks import plan_blocks


def pool(blocks: int = 8, block: int = 64) -> np.ndarray:
    return np.zeros((blocks, block), dtype=np.uint8)


def test_a_block_read_and_written_in_one_call_is_refused():
    p = pool()
    with pytest.raises(
        ValueError,
        match=r"block_mapping\[1\] writes block 2 .*"
        r"block_mapping\[2\] reads block 2",
    ):
        plan_blocks(p, p, [[0, 1], [3, 2], [2, 4]])
    with pytest.raises(ValueError, match="run in no defined order"):
        plan_blocks(p, p, [[0, 1], [1, 2]])


def test_copies_inside_one_cache_that_do_not_cross_are_accepted():
    p = pool()
    assert plan_blocks(p, p, [[0, 4], [1, 5], [2, 6]]).num_pairs == 3
    assert plan_blocks(p, p, [[3, 3]]).num_pairs == 1  # a block onto itself: same bytes


def test_two_views_of_one_cache_are_compared_by_memory_not_identity():
    p = pool()
    with pytest.raises(ValueError, match="reads block 1"):
        plan_blocks(p, p[:], [[1, 2], [0, 1]])


def test_the_same_destination_memory_twice_in_a_layer_list_is_refused():
    src = [pool(), pool()]
    dst = pool()
    with pytest.raises(ValueError, match=r"dst\[0\].*dst\[1\]"):
        plan_blocks(src, [dst, dst[:]], [[0, 1]])
    halves = pool(8, 128)
    with pytest.raises(ValueError, match=r"dst\[1\]"):
        # two views whose blocks overlap by half: each pair writes bytes the other writes
        plan_blocks(src, [halves[:, :64], halves[:, 32:96]], [[0, 1]])


def test_one_cache_listed_twice_on_both_sides_copies_the_same_bytes_twice_and_is_accepted():
    gpu, host = pool(), pool()
    plan = plan_blocks([gpu, gpu], [host, host], [[0, 1], [2, 3]])
    assert plan.num_copies == 4


def test_k_and_v_views_that_interleave_without_meeting_are_accepted():
    cache = np.zeros((8, 2, 64), dtype=np.uint8)  # [blocks, K/V, bytes] as flashinfer's
    host = [pool(), pool()]
    plan = plan_blocks(host, [cache[:, 0], cache[:, 1]], [[0, 1], [1, 2]])
    assert plan.num_copies == 4


def test_a_load_writing_blocks_the_store_reads_is_refused_before_the_driver():
    gpu, host = pool(), pool()
    store = (gpu, host, [[0, 4], [1, 5]])
    load = (host, gpu, [[6, 1]])  # writes gpu block 1, which the store reads
    with pytest.raises(
        ValueError,
        match=r"load: block_mapping\[0\] writes block 1.*"
        r"store: block_mapping\[1\] reads block 1",
    ):
        kvcopy.swap_blocks_both_ways(store, load, stream=0)


def test_a_store_and_a_load_between_other_caches_are_compared_by_memory():
    gpu, host = pool(), pool()
    other_host = host[:]  # the same memory, another object
    with pytest.raises(ValueError, match="store: block_mapping.* writes block 4"):
        kvcopy.swap_blocks_both_ways((gpu, host, [[0, 4]]), (other_host, pool(), [[4, 0]]), stream=0)


def test_a_store_and_a_load_both_writing_a_block_are_refused():
    cache = pool()
    with pytest.raises(ValueError, match="writes block 5"):
        kvcopy.swap_blocks_both_ways((pool(), cache, [[0, 5]]), (pool(), cache, [[1, 5]]), stream=0)


def _triple(src, dst, size):
    return (np.array(src, np.uint64), np.array(dst, np.uint64), np.array(size, np.uint64))


@pytest.mark.parametrize(
    "store, load, message",
    [
        (
            (0x10000, 0x20000, 64),
            (0x20020, 0x30000, 64),
            r"store: dst_ptrs\[0\] writes bytes that "
            r"load: src_ptrs\[0\] reads",
        ),
        (
            (0x10000, 0x20000, 64),
            (0x40000, 0x10020, 64),
            r"load: dst_ptrs\[0\] writes bytes that "
            r"store: src_ptrs\[0\] reads",
        ),
        (
            (0x10000, 0x20000, 64),
            (0x40000, 0x20010, 8),
            r"store: dst_ptrs\[0\] writes bytes that "
            r"load: dst_ptrs\[0\] writes",
        ),
    ],
)
def test_copy_both_ways_refuses_crossing_sides_before_the_driver(store, load, message):
    with pytest.raises(ValueError, match=message):
        kvcopy.copy_both_ways(_triple(*[[v] for v in store]), _triple(*[[v] for v in load]), stream=0)


def test_check_overlap_covers_reads_of_bytes_another_copy_writes():
    src, dst, sizes = [0x10000, 0x20000], [0x20010, 0x30000], [64, 64]
    with pytest.raises(ValueError, match=r"src_ptrs\[1\] reads bytes that dst_ptrs\[0\] writes"):
        kvcopy.copy_batch(src, dst, sizes, check_overlap=True, stream=0)
    with pytest.raises(ValueError, match="copy 0 reads bytes that it writes itself"):
        kvcopy.copy_batch([0x10000], [0x10020], [64], check_overlap=True, stream=0)


# --- against a byte-level oracle -----------------------------------------------------------


def _brute(a_lo, a_sz, b_lo, b_sz):
    return any(x and y and s < t + y and t < s + x for s, x in zip(a_lo, a_sz) for t, y in zip(b_lo, b_sz))


ranges = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 12)), max_size=12)


@settings(max_examples=400, deadline=None)
@given(a=ranges, b=ranges, high=st.booleans())
def test_overlap_between_matches_the_oracle(a, b, high):
    base = (1 << 62) if high else 0  # high: addresses too wide to pack, the other sort
    a_lo = np.array([base + s for s, _ in a], np.uint64)
    b_lo = np.array([base + s for s, _ in b], np.uint64)
    a_sz = np.array([n for _, n in a], np.uint64)
    b_sz = np.array([n for _, n in b], np.uint64)
    found = overlaps.overlap_between(a_lo, a_sz, b_lo, b_sz)
    assert (found is not None) == _brute(a_lo.tolist(), a_sz.tolist(), b_lo.tolist(), b_sz.tolist())
    if found:
        i, j = found
        assert a_sz[i] and b_sz[j] and a_lo[i] < b_lo[j] + b_sz[j] and b_lo[j] < a_lo[i] + a_sz[i]


@pytest.mark.parametrize("others", [0, 6])  # few pairs (compared one by one) or a sort
def test_a_range_that_wraps_the_address_space_is_not_compared(others):
    end = 1 << 64
    a_lo = np.array([end - 16] + [0x1000 * (k + 1) for k in range(others)], np.uint64)
    a_sz = np.array([16] + [8] * others, np.uint64)  # reaches 2**64: wraps
    b_lo = np.array([end - 8] + [0x100000 * (k + 1) for k in range(others)], np.uint64)
    b_sz = np.array([4] + [8] * others, np.uint64)
    assert overlaps.overlap_between(a_lo, a_sz, b_lo, b_sz) is None
    a_sz[0] = 15  # ends one byte short: compared
    assert overlaps.overlap_between(a_lo, a_sz, b_lo, b_sz) == (0, 0)


@settings(max_examples=300, deadline=None)
@given(
    mapping=st.lists(
        st.tuples(st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=6, unique_by=lambda p: p[1]
    ),
    offset=st.sampled_from([0, 16, 32, 64]),
    kv=st.booleans(),
)
def test_swap_blocks_inside_one_buffer_refuses_exactly_the_racing_calls(mapping, offset, kv):
    """Source and destination views of one buffer, shifted by ``offset`` bytes: the call
    is refused exactly where some pair writes bytes another pair reads, or a pair's own
    source and destination overlap through views that are not the same (a block copied
    onto itself within one view is the same bytes, whatever the order)."""
    buffer = np.zeros(8 * 64 + 64, dtype=np.uint8)
    src = buffer[:512].reshape(8, 64)
    dst = buffer[offset : offset + 512].reshape(8, 64)
    if kv:  # blocks of 32 bytes every 64: a K-like and a V-like view
        src, dst = src[:, :32], dst[:, :32]
    size = src.shape[1]
    reads = [(0 + s * 64, size) for s, _ in mapping]
    writes = [(offset + d * 64, size) for _, d in mapping]
    racing = any(
        (i != j or offset != 0) and w0 < r0 + rn and r0 < w0 + wn
        for i, (w0, wn) in enumerate(writes)
        for j, (r0, rn) in enumerate(reads)
    )
    racing = racing or any(
        i != j and w0 < v0 + vn and v0 < w0 + wn
        for i, (w0, wn) in enumerate(writes)
        for j, (v0, vn) in enumerate(writes)
    )
    if racing:
        with pytest.raises(ValueError, match="no defined order"):
            plan_blocks(src, dst, mapping)
    else:
        plan_blocks(src, dst, mapping)


def test_the_tensor_pairs_of_a_geometry_are_worked_out_once():
    p = pool()
    plan_blocks([p], [pool()], [[0, 1]])
    before = len(races._pairs)
    for _ in range(3):
        plan_blocks([p], [pool()], [[0, 1]])
    assert len(races._pairs) <= before + 6


def test_copy_batch_refuses_order_dependent_batches_by_default():
    with pytest.raises(ValueError, match=r"dst_ptrs\[0\] and dst_ptrs\[1\] write overlapping"):
        kvcopy.copy_batch([0x10000, 0x20000], [0x30000, 0x30000], [64, 64], stream=0)
    with pytest.raises(ValueError, match=r"src_ptrs\[1\] reads bytes that dst_ptrs\[0\] writes"):
        kvcopy.copy_batch([0x10000, 0x20000], [0x20010, 0x30000], [64, 64], stream=0)
    with pytest.raises(ValueError, match=r"store: dst_ptrs\[0\] and dst_ptrs\[1\] write"):
        kvcopy.copy_both_ways(
            ([0x10000, 0x20000], [0x30000, 0x30020], [64, 64]), ([0x50000], [0x60000], [8]), stream=0
        )
    # a bad copy is named before any overlap it takes part in
    with pytest.raises(ValueError, match=r"dst_ptrs\[1\] is a null pointer"):
        kvcopy.copy_batch([0x10000, 0x20000], [0x30000, 0], [64, 64], stream=0)


def test_copy_batch_passes_disjoint_and_self_copies_to_the_driver():
    from kvcopy.testing import fake_cuda

    class Reached(Exception):
        pass

    class DriverReached:
        def __getattr__(self, name):
            raise Reached(name)

    # apart, out of order, continuing each other, onto exactly themselves: no refusal, so
    # the call goes on to the driver (stood in for: reaching it is the test)
    batches = [
        (([0x10000, 0x20000], [0x40000, 0x30000], [64, 64]), {}),
        (([0x10000, 0x10040], [0x30000, 0x30040], [64, 64]), {}),
        (([0x10000, 0x20000], [0x10000, 0x20000], [64, 64]), {}),
        (([0x10000, 0x20000], [0x30000, 0x30000], [64, 64]), {"check_overlap": False}),
    ]
    with fake_cuda(DriverReached(), ("driver", "describe", "launch", "classify", "dma")):
        for batch, options in batches:
            with pytest.raises(Reached):
                kvcopy.copy_batch(*batch, stream=0, **options)


def test_copies_oks_glance_never_passes_a_batch_the_exact_check_refuses():
    from kvcopy._plans.copies import find_overlap, find_read_of_written
    from kvcopy.testing import cuda

    rng = np.random.default_rng(3)
    passed = 0
    for _ in range(2000):
        n = int(rng.integers(1, 6))
        src = (rng.integers(1, 40, n) * 8).astype(np.uint64)
        dst = (rng.integers(1, 40, n) * 8).astype(np.uint64)
        sizes = (rng.integers(0, 4, n) * 8).astype(np.uint64)
        if cuda.plan_arrays.copies_ok(src, dst, sizes):
            passed += 1
            moved = src != dst
            assert find_overlap(dst, sizes) is None
            assert find_read_of_written(src, dst, sizes, moved) is None
    assert passed > 100


@pytest.mark.parametrize("spread", [(2, 8), (16, 64)])
@pytest.mark.parametrize("sizes_from", ["equal", "mixed"])
def test_copies_ok_passes_no_batch_the_exact_check_refuses_at_any_length(sizes_from, spread):
    """The bucket pass, which decides where the glance does not (sources and
    destinations interleaved, out of order), is sound for batches of any length, with
    its buckets indexed directly (destinations within 8 buckets a copy: ``spread`` (2,
    8)) or hashed (spread farther)."""
    from kvcopy._plans.copies import find_overlap, find_read_of_written
    from kvcopy.testing import cuda

    rng = np.random.default_rng(5)
    verdicts = {True: 0, False: 0}
    for _ in range(400):
        n = int(rng.integers(2, 200))
        span = int(rng.integers(spread[0] * n + 1, spread[1] * n))
        if rng.random() < 0.5:  # distinct slots: apart where sizes stay within a slot
            slots = rng.permutation(span)[: 2 * n] + 1
            src, dst = (slots[:n] * 64).astype(np.uint64), (slots[n:] * 64).astype(np.uint64)
        else:
            src = (rng.integers(1, span, n) * 64).astype(np.uint64)
            dst = (rng.integers(1, span, n) * 64).astype(np.uint64)
        sizes = (np.full(n, 64) if sizes_from == "equal" else rng.integers(0, 3, n) * 32).astype(np.uint64)
        exact_ok = (
            find_overlap(dst, sizes) is None and find_read_of_written(src, dst, sizes, src != dst) is None
        )
        ok = cuda.plan_arrays.copies_ok(src, dst, sizes)
        assert not ok or exact_ok
        verdicts[ok] += 1
    assert verdicts[True] > 20 and verdicts[False] > 20


def test_copies_ok_shows_a_shuffled_block_batch_apart_and_finds_one_clash():
    """Equal blocks in random order within one pool, sources and destinations mixed
    (as a copy inside one GPU's cache): shown apart in one pass, without the sort; one
    destination moved onto another's bytes, or a source onto a destination, is not."""
    from kvcopy.testing import cuda

    rng = np.random.default_rng(7)
    base, block, n = 0x7F0000000000, 2048, 8192
    slots = rng.permutation(2 * n).astype(np.uint64)
    src = base + slots[:n] * np.uint64(block)
    dst = base + slots[n:] * np.uint64(block)
    sizes = np.full(n, block, dtype=np.uint64)
    assert cuda.plan_arrays.copies_ok(src, dst, sizes)
    clash = dst.copy()
    clash[100] = dst[4000] + np.uint64(block // 2)  # half over another destination
    assert not cuda.plan_arrays.copies_ok(src, clash, sizes)
    twice = dst.copy()
    twice[100] = dst[4000]  # one block written twice (the pass of a bit a block sees it)
    assert not cuda.plan_arrays.copies_ok(src, twice, sizes)
    reads = src.copy()
    reads[7] = dst[8000] + np.uint64(1)  # reads what copy 8000 writes
    assert not cuda.plan_arrays.copies_ok(reads, dst, sizes)
    onto_itself = src.copy()
    onto_itself[9] = dst[9]  # a copy onto exactly itself
    assert cuda.plan_arrays.copies_ok(onto_itself, dst, sizes)
    partly_itself = src.copy()
    partly_itself[9] = dst[9] + np.uint64(8)  # a copy onto part of itself
    assert not cuda.plan_arrays.copies_ok(partly_itself, dst, sizes)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
def test_copies_ok_in_address_order_sees_a_destination_reaching_into_the_next(n):
    """The summary's own pass over a batch of non-empty copies between distinct places
    (vectors where the CPU has them) finds destinations in order apart, and one that
    reaches into the next one's bytes, or a source inside them, not; an empty copy or
    a copy onto itself among them is summarized copy by copy, to the same verdicts."""
    from kvcopy.testing import cuda

    block = np.uint64(4096)
    dst = 0x7F0000000000 + np.arange(n, dtype=np.uint64) * block
    src = 0x100000000 + np.arange(n, dtype=np.uint64)[::-1] * block
    sizes = np.full(n, block, dtype=np.uint64)
    assert cuda.plan_arrays.copies_ok(src, dst, sizes)
    for k in {0, n // 2, n - 1}:
        grown = sizes.copy()
        grown[k] += np.uint64(8)
        assert cuda.plan_arrays.copies_ok(src, dst, grown) == (k == n - 1)
        inside = src.copy()
        inside[k] = dst[n - 1 - k] + np.uint64(8)
        assert not cuda.plan_arrays.copies_ok(inside, dst, sizes)
        empty, onto_itself = sizes.copy(), src.copy()
        empty[k], onto_itself[k] = 0, dst[k]
        assert cuda.plan_arrays.copies_ok(src, dst, empty)
        assert cuda.plan_arrays.copies_ok(onto_itself, dst, sizes)
        if k < n - 1:  # (summarized copy by copy: the copy that reaches on is still seen)
            grown[n - 1] = 0
            assert cuda.plan_arrays.copies_ok(src, dst, grown) == (k == n - 2)


def test_copy_batch_names_the_copies_the_bucket_pass_finds():
    """Where the bucket pass finds two copies meeting, the exact check names them."""
    base, block = 0x7F0000000000, 4096
    dst = [base + k * block for k in (5, 1, 9, 3)]
    dst[2] = dst[0] + 64
    src = [base + 0x100000 + k * block for k in range(4)]
    with pytest.raises(ValueError, match=r"dst_ptrs\[0\] and dst_ptrs\[2\] write overlapping"):
        kvcopy.copy_batch(src, dst, [block] * 4, stream=0)
