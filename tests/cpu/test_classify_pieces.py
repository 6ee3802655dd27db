"""Memory the driver knows in many pieces, on the CPU with seeded driver answers.

SGLang registers its host pool with cudaHostRegister a GiB at a time, and the
driver knows each registration as a range of its own. kvcopy keeps 256 ranges
per side and call; a batch scattered over more pieces than that would ask the driver
again for nearly every copy. A new range is joined with its cached neighbours of
the same memory, and from 16 ranges on with neighbours asked of the driver, no more
questions per call than the batch has copies. Asserted here: every
copy still gets the device view of its own piece, the pieces are asked for about once
each, a gap or other memory beside a piece is never joined, sparse batches ask at most
twice per copy, and batches in a few allocations ask no more than before. And a batch
that cycles through more separate tensors than 64 (block by block over 80 layers' K and
V) asks about each a few times, not once per copy: each range remembers the one used
after it."""

from __future__ import annotations

import numpy as np

from kvcopy.testing import cuda

kv_classify, kv_testing = cuda.classify, cuda.testing

from helpers.described import described_fields

HOST, DEVICE = 0x7F00_0000_0000, 0x7000_0000_0000
MAPPED, ON_GPU = kv_classify.KIND_HOST_MAPPED, kv_classify.KIND_DEVICE
KiB, MiB = 1 << 10, 1 << 20


def pieces(base: int, count: int, size: int, kind: int, ordinal: int = -1, delta: int = 0) -> list[list[int]]:
    return [[base + i * size, base + (i + 1) * size, kind, ordinal, delta] for i in range(count)]


def describe(answers, src, dst, sizes, fast=True):
    src, dst, sizes = (np.asarray(a, dtype=np.uint64) for a in (src, dst, sizes))
    out = np.zeros((max(len(sizes), 1), 4), dtype=np.uint64)
    batch, _, queries = kv_testing.describe_copies_answered(
        np.asarray(answers, dtype=np.int64), src, dst, sizes, out.ctypes.data, False, fast
    )
    return described_fields(batch), queries, out[: batch.count]


def scattered(n, block, src_base, src_bytes, dst_base, dst_bytes, seed=0):
    rng = np.random.default_rng(seed)
    src = src_base + rng.permutation(src_bytes // block)[:n].astype(np.uint64) * np.uint64(block)
    dst = dst_base + rng.permutation(dst_bytes // block)[:n].astype(np.uint64) * np.uint64(block)
    return src, dst, np.full(n, block, dtype=np.uint64)


def test_a_pool_registered_in_pieces_is_asked_for_about_once_per_piece():
    """1 GiB of host memory in 512 registrations, 2 GiB of GPU memory in 103 mappings;
    4096 scattered 16 KiB copies between them."""
    answers = pieces(HOST, 512, 2 * MiB, MAPPED) + pieces(DEVICE, 103, 20 * MiB, ON_GPU, 0)
    src, dst, sizes = scattered(4096, 16 * KiB, HOST, 1 << 30, DEVICE, 103 * 20 * MiB)
    for fast in (True, False):
        result, queries, descs = describe(answers, src, dst, sizes, fast)
        count, total, src_kinds, _, dst_kinds, dst_ordinal, _ = result
        assert (count, total) == (4096, 4096 * 16 * KiB)
        assert (src_kinds, dst_kinds, dst_ordinal) == (MAPPED, ON_GPU, 0)
        np.testing.assert_array_equal(descs[:, 0], src)
        np.testing.assert_array_equal(descs[:, 1], dst)
        # each piece once, and a few more where joins start or pass a pool's end
        # (without joining: about one question per copy, 4096)
        assert queries[0] <= 512 + 16 and queries[1] <= 103 + 16, queries


def test_each_piece_keeps_its_own_device_view():
    """Pieces the device sees at different offsets are never joined: each copy gets
    its own piece's view, and a copy across two of them is flagged."""
    answers = [
        [HOST + i * MiB, HOST + (i + 1) * MiB, MAPPED, -1, 0x1000 * (i % 3)] for i in range(200)
    ] + pieces(DEVICE, 1, 1 << 30, ON_GPU, 0)
    src, dst, sizes = scattered(2000, 4 * KiB, HOST, 200 * MiB, DEVICE, 1 << 30, seed=1)
    result, queries, descs = describe(answers, src, dst, sizes)
    piece = (src - np.uint64(HOST)) // np.uint64(MiB)
    np.testing.assert_array_equal(descs[:, 0], src + np.uint64(0x1000) * (piece % np.uint64(3)))
    assert result[2] == MAPPED and queries[1] == 1
    across = describe(answers, [HOST + MiB - 2 * KiB], [DEVICE], [4 * KiB])[0]
    assert across[2] & kv_classify.KIND_STRADDLE


def test_a_gap_between_pieces_is_never_joined():
    """A piece left out (unregistered): copies from it are pageable to the kernel path,
    and copies from the pieces around it are not."""
    answers = [row for i, row in enumerate(pieces(HOST, 300, 2 * MiB, MAPPED)) if i != 150]
    answers += pieces(DEVICE, 1, 1 << 30, ON_GPU, 0)
    src, dst, sizes = scattered(3000, 16 * KiB, HOST, 600 * MiB, DEVICE, 1 << 30, seed=2)
    in_gap = (src >= np.uint64(HOST + 150 * 2 * MiB)) & (src < np.uint64(HOST + 151 * 2 * MiB))
    assert in_gap.any() and not in_gap.all()
    assert describe(answers, src, dst, sizes)[0][2] & kv_classify.KIND_PAGEABLE
    keep = ~in_gap
    result, queries, _ = describe(answers, src[keep], dst[keep], sizes[keep])
    assert result[2] == MAPPED and queries[0] <= 2 * 300


def test_device_memory_of_another_gpu_is_never_joined():
    answers = pieces(DEVICE, 100, 2 * MiB, ON_GPU, 0) + pieces(DEVICE + 200 * MiB, 100, 2 * MiB, ON_GPU, 1)
    src, dst, sizes = scattered(1000, 4 * KiB, DEVICE, 400 * MiB, HOST, 64 * MiB, seed=3)
    answers += pieces(HOST, 1, 64 * MiB, MAPPED)
    result = describe(answers, src, dst, sizes)[0]
    assert result[3] == -2  # the source side holds memory of two devices


def test_batches_in_a_few_allocations_ask_no_more_than_before():
    """One allocation per side: one question per side. Four tensors with gaps between
    them: one question each, nothing joined past them."""
    one = describe(
        pieces(HOST, 1, 1 << 30, MAPPED) + pieces(DEVICE, 1, 1 << 30, ON_GPU, 0),
        *scattered(4096, 4 * KiB, HOST, 1 << 30, DEVICE, 1 << 30),
    )
    assert one[1] == (1, 1)
    tensors = [[DEVICE + i * 256 * MiB, DEVICE + i * 256 * MiB + 64 * MiB, ON_GPU, 0, 0] for i in range(4)]
    rng = np.random.default_rng(4)
    src = np.array(
        [DEVICE + rng.integers(4) * 256 * MiB + rng.integers(4096) * 16 * KiB for _ in range(1000)],
        dtype=np.uint64,
    )
    dst = HOST + np.arange(1000, dtype=np.uint64) * np.uint64(16 * KiB)
    result, queries, _ = describe(
        tensors + pieces(HOST, 1, 1 << 30, MAPPED), src, dst, np.full(1000, 16 * KiB, dtype=np.uint64)
    )
    assert result[2] == ON_GPU and queries == (4, 1)


def test_sparse_batches_over_many_pieces_ask_at_most_twice_per_copy():
    """A few copies over thousands of pieces (a large cache mapped 20 MiB at a time):
    joining never asks the driver more often than the batch has copies, so such a
    batch costs at most two questions per copy, and a batch of fewer copies than
    ranges that start joining asks once per copy."""
    answers = pieces(HOST, 1, 1 << 30, MAPPED) + pieces(DEVICE, 3072, 20 * MiB, ON_GPU, 0)
    for n in (8, 64, 512, 4096):
        src, dst, sizes = scattered(n, 16 * KiB, HOST, 1 << 30, DEVICE, 3072 * 20 * MiB, seed=n)
        result, queries, descs = describe(answers, src, dst, sizes)
        assert result[4] == ON_GPU and queries[0] == 1
        np.testing.assert_array_equal(descs[:, 1], dst)
        assert queries[1] <= (n if n <= 16 else 2 * n), (n, queries)


def test_tiny_pieces_stay_within_the_budget():
    """20,000 registrations of 4 KiB: joining stops at its budget, and every copy is
    still classified as its piece."""
    answers = pieces(HOST, 20000, 4 * KiB, MAPPED) + pieces(DEVICE, 1, 1 << 30, ON_GPU, 0)
    src, dst, sizes = scattered(4096, 4 * KiB, HOST, 20000 * 4 * KiB, DEVICE, 1 << 30, seed=5)
    result, queries, descs = describe(answers, src, dst, sizes)
    assert result[2] == MAPPED
    np.testing.assert_array_equal(descs[:, 0], src)
    assert queries[0] <= 4096 + kv_classify.WIDEN_BUDGET


def interleaved(tensors: int, blocks: int):
    """Copies block by block over every tensor (each 64 MiB, 2 MiB apart), host to GPU:
    a batch built per block over every layer's K and V."""

    def pool(base, kind, ordinal):
        return [
            [base + i * 66 * MiB, base + i * 66 * MiB + 64 * MiB, kind, ordinal, 0] for i in range(tensors)
        ]

    src = np.array(
        [HOST + t * 66 * MiB + b * 16 * KiB for b in range(blocks) for t in range(tensors)], dtype=np.uint64
    )
    dst = np.array(
        [DEVICE + t * 66 * MiB + b * 48 * KiB for b in range(blocks) for t in range(tensors)], dtype=np.uint64
    )
    answers = pool(HOST, MAPPED, -1) + pool(DEVICE, ON_GPU, 0)
    return answers, src, dst, np.full(len(src), 16 * KiB, dtype=np.uint64)


def test_a_batch_cycling_through_many_tensors_asks_about_each_once():
    """160 tensors per side (80 layers' K and V), 32 blocks each, block by block: each
    tensor is asked for once, and (from 16 ranges on) its two neighbours, which are
    not the same memory; the 64 ranges kept before asked about once per copy (5215
    questions here)."""
    answers, src, dst, sizes = interleaved(160, 32)
    for fast in (True, False):
        result, queries, descs = describe(answers, src, dst, sizes, fast)
        assert result[:2] == (len(src), len(src) * 16 * KiB)
        np.testing.assert_array_equal(descs[:, 0], src)
        np.testing.assert_array_equal(descs[:, 1], dst)
        assert queries[0] <= 3 * 160 and queries[1] <= 3 * 160, queries


def test_more_tensors_than_ranges_kept_still_copy_right():
    """300 tensors per side, more than the classifier keeps: every copy still gets its
    own tensor's address, and the driver is asked at most twice per copy."""
    answers, src, dst, sizes = interleaved(300, 8)
    result, queries, descs = describe(answers, src, dst, sizes)
    assert (result[2], result[4]) == (MAPPED, ON_GPU)
    np.testing.assert_array_equal(descs[:, 0], src)
    np.testing.assert_array_equal(descs[:, 1], dst)
    assert max(queries) <= 2 * len(src), queries
