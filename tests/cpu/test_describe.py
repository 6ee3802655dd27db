"""The kernel path's describe pass on the CPU, with memory ranges given in advance
instead of asked of the driver: the vectorised pass writes exactly what the
general loop writes, both plan exactly like the planner, and the device views
carry each range's offset."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcopy.testing import cuda

kv_classify, kv_describe, kv_launch, kv_testing = (cuda.classify, cuda.describe, cuda.launch, cuda.testing)
from kvcopy._plans.copies import plan_copies

from helpers.described import described_fields

TILE = kv_launch.TILE_BYTES
HOST_A, HOST_B, DEVICE = 0x7F00_0000_0000, 0x7F10_0000_0000, 0x7000_0000_0000
POOL = 1 << 30
DELTA = 0x1000  # pinned host memory seen by the device at another address
RANGES = np.array(
    [
        [HOST_A, HOST_A + POOL, kv_classify.KIND_HOST_MAPPED, -1, DELTA],
        [HOST_B, HOST_B + POOL, kv_classify.KIND_HOST_MAPPED, -1, 0],
        [DEVICE, DEVICE + POOL, kv_classify.KIND_DEVICE, 0, 0],
        # allocations right after two of them: a copy may run from one into the next
        [HOST_A + POOL, HOST_A + 2 * POOL, kv_classify.KIND_HOST_MAPPED, -1, 2 * DELTA],
        [DEVICE + POOL, DEVICE + 2 * POOL, kv_classify.KIND_DEVICE, 0, 0],
    ],
    dtype=np.int64,
)


def describe(src, dst, sizes, merge=True, fast=True, misalign=0):
    """describe_copies_in into a buffer 32-byte aligned (streaming stores), or
    ``misalign`` bytes past that (plain stores)."""
    src, dst, sizes = (np.asarray(a, dtype=np.uint64) for a in (src, dst, sizes))
    raw = np.zeros(4 * max(len(sizes), 1) + 8, dtype=np.uint64)
    skip = (-raw.ctypes.data % 32 + misalign) // 8
    out = raw[skip : skip + 4 * max(len(sizes), 1)]
    batch, used = kv_testing.describe_copies_in(RANGES, src, dst, sizes, out.ctypes.data, merge, fast)
    return described_fields(batch), used, out.reshape(-1, 4)[: batch.count]


def sides(src, dst, sizes, merge=True, fast=True, compact=False):
    """What the pass found of each side: (src spans, dst spans, largest copy, empty
    copies), and whether the vectorised pass applied."""
    src, dst, sizes = (np.asarray(a, dtype=np.uint64) for a in (src, dst, sizes))
    out = np.zeros(4 * max(len(sizes), 1) + 4, dtype=np.uint64)
    batch, used = kv_testing.describe_copies_in(
        RANGES, src, dst, sizes, out.ctypes.data, merge, fast, compact
    )
    return (batch.src_spans, batch.dst_spans, batch.largest_copy, batch.empty_copies), used


def assert_sides(found, want, sizes) -> None:
    """The pass's sides as counted by hand; where the vectorised pass met copies of
    several sizes, its largest copy is the whole number of tiles every copy kept within."""
    (spans_and_empty, largest), used = (found[0][:2] + found[0][3:], found[0][2]), found[1]
    assert spans_and_empty == want[:2] + want[3:]
    if used and len(set(int(z) for z in sizes)) > 1:
        tiles = -(-int(sizes[0]) // TILE)
        assert largest == tiles * TILE >= want[2]
    else:
        assert largest == want[2]


def sides_oracle(src, dst, sizes) -> tuple[int, int, int, int]:
    """Runs of copies each starting where the one before ends, per side, empty copies
    skipped; the largest copy; the empty ones."""

    def spans(addresses):
        count, end = 0, None
        for address, size in zip(addresses, sizes):
            if size:
                count += end is None or address != end
                end = address + size
        return count

    return (spans(src), spans(dst), max(sizes, default=0), sum(1 for size in sizes if size == 0))


def expected_descriptors(src, dst, sizes, merge):
    plan = plan_copies(
        np.asarray(src, np.uint64), np.asarray(dst, np.uint64), np.asarray(sizes, np.uint64), merge=merge
    )
    in_a = (plan.src >= np.uint64(HOST_A)) & (plan.src < np.uint64(HOST_A + POOL))
    view = plan.src + np.where(in_a, np.uint64(DELTA), np.uint64(0))
    tiles = (plan.sizes + np.uint64(TILE - 1)) // np.uint64(TILE)
    starts = (np.cumsum(tiles) - tiles).astype(np.uint64)
    return np.stack([view, plan.dst, plan.sizes, starts], axis=1), plan


def scattered(n, block, seed=0):
    rng = np.random.default_rng(seed)
    src = HOST_A + rng.permutation(2 * n)[:n].astype(np.uint64) * np.uint64(block)
    dst = DEVICE + rng.permutation(2 * n)[:n].astype(np.uint64) * np.uint64(block)
    return src, dst, np.full(n, block, dtype=np.uint64)


@pytest.mark.skipif(not kv_describe.fast_describe_available(), reason="no AVX2 on this CPU")
@pytest.mark.parametrize("n", [8192, 8190, 1, 2, 5])
@pytest.mark.parametrize("misalign", [0, 8])
def test_a_scattered_batch_of_one_tile_copies_takes_the_vectorised_pass(n, misalign):
    src, dst, sizes = scattered(n, 16 << 10)
    (count, total, src_kinds, src_dev, dst_kinds, dst_dev, tiles), used, descs = describe(
        src, dst, sizes, misalign=misalign
    )
    assert used
    assert (count, total, tiles) == (n, n * (16 << 10), n)
    assert (src_kinds, src_dev, dst_kinds, dst_dev) == (
        kv_classify.KIND_HOST_MAPPED,
        -1,
        kv_classify.KIND_DEVICE,
        0,
    )
    np.testing.assert_array_equal(descs[:, 0], src + np.uint64(DELTA))
    np.testing.assert_array_equal(descs[:, 1], dst)
    np.testing.assert_array_equal(descs[:, 2], sizes)
    np.testing.assert_array_equal(descs[:, 3], np.arange(n, dtype=np.uint64))


@pytest.mark.skipif(not kv_describe.fast_describe_available(), reason="no AVX2 on this CPU")
@pytest.mark.parametrize("n", [8192, 8190, 1, 2, 5])
@pytest.mark.parametrize("block", [TILE + 1, 2 * TILE, 3 * TILE + 16, 64 << 10])
def test_a_batch_of_one_size_of_several_tiles_takes_the_vectorised_pass(n, block):
    """Each copy then counts as the same number of tiles: copy i starts at tile i * k."""
    src, dst, sizes = scattered(n, block)
    per_copy = -(-block // TILE)
    (count, total, *kinds, tiles), used, descs = describe(src, dst, sizes)
    reference, _, ref_descs = describe(src, dst, sizes, fast=False)
    assert used
    assert (count, total, tiles) == (n, n * block, n * per_copy)
    assert (count, total, *kinds, tiles) == reference
    np.testing.assert_array_equal(descs, ref_descs)
    want, _ = expected_descriptors(src, dst, sizes, True)
    np.testing.assert_array_equal(descs, want)
    np.testing.assert_array_equal(descs[:, 3], np.arange(n, dtype=np.uint64) * np.uint64(per_copy))


@pytest.mark.parametrize("case", ["empty copy", "a longer copy after shorter ones", "second allocation"])
def test_batches_the_vectorised_pass_cannot_take_fall_back_to_the_general_loop(case):
    src, dst, sizes = scattered(64, 4096)
    if case == "empty copy":
        sizes[5] = 0
    elif case == "a longer copy after shorter ones":
        sizes[:] = TILE + 16
        sizes[40] = 2 * TILE + 1  # three tiles where the first copy has two
        src, dst = (
            HOST_A + np.arange(64, dtype=np.uint64) * np.uint64(4 * TILE),
            DEVICE + np.arange(64, dtype=np.uint64)[::-1].copy() * np.uint64(4 * TILE),
        )
    else:
        src[7] = HOST_B + 4096
    result, used, descs = describe(src, dst, sizes)
    reference, _, ref_descs = describe(src, dst, sizes, fast=False)
    assert not used
    assert result == reference
    np.testing.assert_array_equal(descs, ref_descs)
    want, plan = expected_descriptors(src, dst, sizes, True)
    np.testing.assert_array_equal(descs, want)
    assert result[0] == plan.count


@pytest.mark.skipif(not kv_describe.fast_describe_available(), reason="no AVX2 on this CPU")
@pytest.mark.parametrize(
    "case",
    [
        "one pair merges",
        "every other copy merges",
        "runs of eight",
        "the last copy merges",
        "multi-tile of two sizes",
    ],
)
@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("misalign", [0, 8])
def test_merges_and_mixed_multi_tile_sizes_stay_on_the_vectorised_pass(case, merge, misalign):
    """Copies that continue each other (an allocator that hands out consecutive blocks;
    a random placement of 16,384 blocks has one such pair four times in ten), and
    multi-tile copies of two sizes: every copy is still in range, so a scalar pass
    rewrites the entries without classifying anything, exactly as the general loop."""
    n = 1000
    src, dst, sizes = scattered(n, 4096, seed=3)
    if case == "multi-tile of two sizes":
        sizes[:] = TILE + 16
        sizes[400] = TILE + 8  # two tiles as well, but another size
        src = HOST_A + np.arange(n, dtype=np.uint64) * np.uint64(4 * TILE)
        dst = DEVICE + np.arange(n, dtype=np.uint64)[::-1].copy() * np.uint64(4 * TILE)
    else:
        step = {
            "one pair merges": n,
            "every other copy merges": 2,
            "runs of eight": 8,
            "the last copy merges": n,
        }[case]
        first = n - 1 if case == "the last copy merges" else 1
        for i in range(first, n, step):
            for j in range(i, min(i + (7 if step == 8 else 1), n)):
                src[j], dst[j] = src[j - 1] + sizes[j - 1], dst[j - 1] + sizes[j - 1]
    result, used, descs = describe(src, dst, sizes, merge, misalign=misalign)
    reference, _, ref_descs = describe(src, dst, sizes, merge, fast=False)
    assert used
    assert result == reference
    np.testing.assert_array_equal(descs, ref_descs)
    want, plan = expected_descriptors(src, dst, sizes, merge)
    np.testing.assert_array_equal(descs, want)
    assert (result[0], result[1]) == (plan.count, plan.total_bytes)
    if merge and case != "multi-tile of two sizes":
        assert plan.count < n  # the batch did merge


def test_a_bad_copy_is_reported_alike_by_both_passes():
    src, dst, sizes = scattered(100, 4096)
    src[42] = 0
    with pytest.raises(ValueError) as fast:
        describe(src, dst, sizes)
    with pytest.raises(ValueError) as general:
        describe(src, dst, sizes, fast=False)
    assert str(fast.value) == str(general.value) == "src_ptrs[42] is a null pointer with size 4096"


@st.composite
def batches(draw):
    n = draw(st.integers(1, 48))
    src, dst, sizes = [], [], []
    dst_cursor = DEVICE
    for _ in range(n):
        size = draw(st.sampled_from([0, 1, 7, 16, 4096, TILE, TILE + 1, 3 * TILE]))
        base = draw(st.sampled_from([HOST_A, HOST_A, HOST_A, HOST_B]))
        src.append(base + draw(st.integers(0, 1 << 20)))
        dst_cursor += draw(st.sampled_from([0, 0, 64, 4096]))  # 0: may merge with the previous
        dst.append(dst_cursor)
        dst_cursor += size
        sizes.append(size)
        if draw(st.booleans()) and len(src) > 1:  # continue the previous copy on both sides
            src[-1] = src[-2] + sizes[-2]
            dst[-1] = dst[-2] + sizes[-2]
    return src, dst, sizes


@st.composite
def batches_of_one_size(draw):
    """Copies of one size (one tile or several), scattered or continuing each other."""
    n = draw(st.integers(1, 40))
    size = draw(st.sampled_from([1, 16, 4096, TILE, TILE + 1, 2 * TILE, 3 * TILE - 5]))
    slots = draw(st.permutations(range(2 * n)))
    src = [HOST_A + k * 4 * TILE for k in slots[:n]]
    dst = [DEVICE + k * 4 * TILE for k in slots[n:]]
    for i in range(1, n):
        if draw(st.integers(0, 4)) == 0:  # continue the previous copy on both sides
            src[i], dst[i] = src[i - 1] + size, dst[i - 1] + size
    if draw(st.integers(0, 5)) == 0:  # one copy of another size
        k = draw(st.integers(0, n - 1))
        src_sizes = [size] * n
        src_sizes[k] = draw(st.sampled_from([8, TILE - 1, TILE + 2, 4 * TILE]))
        return src, dst, src_sizes
    return src, dst, [size] * n


@given(st.one_of(batches(), batches_of_one_size()), st.booleans(), st.sampled_from([0, 8]))
@settings(max_examples=600, deadline=None)
def test_both_passes_describe_what_the_planner_plans(batch, merge, misalign):
    src, dst, sizes = batch
    result, _, descs = describe(src, dst, sizes, merge, misalign=misalign)
    reference, _, ref_descs = describe(src, dst, sizes, merge, fast=False)
    assert result == reference
    np.testing.assert_array_equal(descs, ref_descs)
    # each side's spans (the staged path's question), by either pass, as counted by hand
    assert_sides(sides(src, dst, sizes, merge), sides_oracle(src, dst, sizes), sizes)
    assert sides(src, dst, sizes, merge, fast=False)[0] == sides_oracle(src, dst, sizes)
    want, plan = expected_descriptors(src, dst, sizes, merge)
    np.testing.assert_array_equal(descs, want)
    assert (result[0], result[1]) == (plan.count, plan.total_bytes)


# ------------------------------------------------------------------ compact entries


def describe_compact(src, dst, sizes, merge=True, misalign=0):
    """describe_copies_in with compact entries allowed; the buffer as describe()'s.
    Returns the fields with compact_size last, whether the vectorised pass ran, and the
    raw words."""
    src, dst, sizes = (np.asarray(a, dtype=np.uint64) for a in (src, dst, sizes))
    raw = np.zeros(4 * max(len(sizes), 1) + 8, dtype=np.uint64)
    skip = (-raw.ctypes.data % 32 + misalign) // 8
    out = raw[skip : skip + 4 * max(len(sizes), 1)]
    batch, used = kv_testing.describe_copies_in(RANGES, src, dst, sizes, out.ctypes.data, merge, True, True)
    return described_fields(batch) + (batch.compact_size,), used, out


@pytest.mark.skipif(not kv_describe.fast_describe_available(), reason="no AVX2 on this CPU")
@pytest.mark.parametrize("n", [8192, 8191, 1001, 1, 2, 3, 6])
@pytest.mark.parametrize("misalign", [0, 8, 16])
def test_a_batch_of_one_block_size_is_described_as_pairs(n, misalign):
    src, dst, sizes = scattered(n, 2048, seed=n)
    (count, total, src_kinds, _, dst_kinds, _, tiles, compact_size), used, out = describe_compact(
        src, dst, sizes, misalign=misalign
    )
    assert used and compact_size == 2048 and kv_describe.COMPACT_BYTES == 16
    assert (count, total, tiles) == (n, n * 2048, n)
    assert (src_kinds, dst_kinds) == (kv_classify.KIND_HOST_MAPPED, kv_classify.KIND_DEVICE)
    pairs = out[: 2 * n].reshape(-1, 2)
    np.testing.assert_array_equal(pairs[:, 0], src + np.uint64(DELTA))
    np.testing.assert_array_equal(pairs[:, 1], dst)
    assert not out[2 * n :].any()  # nothing written past the pairs


@pytest.mark.parametrize(
    "case", ["one size differs", "last size differs", "merges", "second allocation", "multi-tile"]
)
def test_a_batch_pairs_cannot_describe_gets_the_descriptors_describe_copies_writes(case):
    src, dst, sizes = scattered(2000, 4096)
    if case == "one size differs":
        sizes[1234] = 4080
    elif case == "last size differs":
        sizes[-1] = 16
    elif case == "merges":
        src[1], dst[1] = src[0] + sizes[0], dst[0] + sizes[0]
    elif case == "second allocation":
        src[7] = HOST_B + 4096
    else:
        sizes[:] = TILE + 16
        src = HOST_A + np.arange(2000, dtype=np.uint64) * np.uint64(2 * TILE)
        dst = DEVICE + np.arange(2000, dtype=np.uint64)[::-1].copy() * np.uint64(2 * TILE)
    result, _, out = describe_compact(src, dst, sizes)
    reference, _, ref_descs = describe(src, dst, sizes)
    assert result[-1] == 0
    assert result[:-1] == reference
    np.testing.assert_array_equal(out[: 4 * result[0]].reshape(-1, 4), ref_descs)


def test_describe_copies_never_writes_pairs():
    src, dst, sizes = scattered(4096, 2048)
    result, _, descs = describe(src, dst, sizes)
    assert len(result) == 7
    np.testing.assert_array_equal(descs[:, 2], sizes)


@st.composite
def one_size_near_a_range_end(draw):
    """Copies of one size (pairs' case) placed up to a few blocks before the end of a
    range, some at it or over it, one maybe of another size: where the one-size pass's
    single compare per side must agree with the general loop's two."""
    n = draw(st.integers(2, 40))
    size = draw(st.sampled_from([1, 16, 2048, 4096, TILE]))
    ends = draw(st.lists(st.integers(-1, 3 * n), min_size=2 * n, max_size=2 * n))
    # block k from the end: k = 0 ends exactly at the range's end, k = -1 runs over it
    src = [HOST_A + POOL - (k + 1) * size for k in ends[:n]]
    dst = [DEVICE + POOL - (k + 1) * size for k in ends[n:]]
    sizes = [size] * n
    if draw(st.booleans()):
        sizes[draw(st.integers(0, n - 1))] = size + draw(st.sampled_from([-1, 1, size]))
    return src, dst, sizes


@pytest.mark.skipif(not kv_describe.fast_describe_available(), reason="no AVX2 on this CPU")
# a copy running over a range's end asks the driver whether the next allocation
# continues it; without one that lookup fails (reported, ignored) and the copy
# straddles, in both passes alike
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@given(
    st.one_of(batches_of_one_size(), one_size_near_a_range_end()), st.booleans(), st.sampled_from([0, 8, 16])
)
@settings(max_examples=600, deadline=None)
def test_compact_entries_describe_what_the_general_loop_describes(batch, merge, misalign):
    """describe_compact's one-size pass against the general loop: the same answer, and
    pairs exactly where every planned copy has the pairs' size."""
    src, dst, sizes = (np.asarray(a, dtype=np.uint64) for a in batch)
    try:
        reference, _, ref_descs = describe(src, dst, sizes, merge, fast=False)
    except ValueError as general:
        with pytest.raises(ValueError) as compact:
            describe_compact(src, dst, sizes, merge, misalign=misalign)
        assert str(compact.value) == str(general.value)
        return
    result, _, out = describe_compact(src, dst, sizes, merge, misalign=misalign)
    assert result[:-1] == reference
    assert_sides(sides(src, dst, sizes, merge, compact=True), sides_oracle(src, dst, sizes), sizes)
    count, compact_size = result[0], result[-1]
    if compact_size:
        assert (ref_descs[:, 2] == compact_size).all()
        np.testing.assert_array_equal(out[: 2 * count].reshape(-1, 2), ref_descs[:, :2])
    else:
        np.testing.assert_array_equal(out[: 4 * count].reshape(-1, 4), ref_descs)


@pytest.mark.parametrize("fast", [True, False])
def test_the_pass_counts_each_sides_spans_its_largest_and_its_empty_copies(fast):
    """A span: copies each starting where the one before ends on that side (the host
    side's spans decide staging); an empty copy breaks none and is counted."""
    a, d = HOST_A + 4096, DEVICE + 8 * TILE
    cases = [
        # (src, dst, sizes) -> (src spans, dst spans, largest, empty)
        (
            ([a, a + 4, a + 8, a + 100, a + 104], [d, d + 64, d + 128, d + 192, d + 256], [4, 4, 4, 4, 4]),
            (2, 5, 4, 0),
        ),
        (([a + 8, a + 4, a], [d, d + 4, d + 8], [4, 4, 4]), (3, 1, 4, 0)),  # backwards
        (([a, a], [d, d + 64], [4, 4]), (2, 2, 4, 0)),  # repeats
        (([a, a + 99, a + 4], [d, d + 64, d + 4], [4, 0, 8]), (1, 1, 8, 1)),  # empty skipped
    ]
    for (src, dst, sizes), want in cases:
        assert want == sides_oracle(src, dst, sizes)
        assert_sides(sides(src, dst, sizes, fast=fast), want, sizes)


def test_the_vectorised_pass_counts_spans_past_its_four_copy_steps():
    """A batch long enough for the AVX2 loop and its scalar tail: one span on the host
    side, every copy apart on the device side, in both entry kinds."""
    n = 1003
    src = HOST_A + np.arange(n, dtype=np.uint64) * np.uint64(4096)
    dst = DEVICE + np.arange(n, dtype=np.uint64)[::-1] * np.uint64(8192)
    sizes = np.full(n, 4096, dtype=np.uint64)
    for compact in (False, True):
        found, used = sides(src, dst, sizes, compact=compact)
        assert found == (1, n, 4096, 0) == sides_oracle(src.tolist(), dst.tolist(), sizes.tolist())
        assert used == kv_describe.fast_describe_available()
    sizes[500] = 2048  # another size: the pairs pass gives way to the descriptors' pass
    src[501:] -= np.uint64(2048)
    assert_sides(sides(src, dst, sizes, compact=True), (1, n, 4096, 0), sizes)


@pytest.mark.parametrize(
    "src_offsets, sizes",
    [
        ([0, 1, 2, 3, 4, 5], [1, 8, 1, 1, 1, 1]),  # copy 2 does not continue copy 1
        ([0, 100, 108, 109, 110, 111], [1, 8, 1, 1, 1, 1]),  # it does: copies 1.. merge
    ],
)
def test_a_head_copy_of_another_size_is_seen_by_the_one_size_pass(src_offsets, sizes):
    """The one-size pairs pass judges a copy's continuation by the one-size step; a copy of
    another size among the first ones (described before that pass) must keep it out, or
    spans and merges behind that copy are judged by the wrong size."""
    src = [HOST_A + o for o in src_offsets]
    dst = [DEVICE + 4096 + o for o in src_offsets]
    result, _, out = describe_compact(src, dst, sizes)
    reference, _, ref_descs = describe(src, dst, sizes, fast=False)
    assert result[:-1] == reference
    assert_sides(sides(src, dst, sizes, compact=True), sides_oracle(src, dst, sizes), sizes)
