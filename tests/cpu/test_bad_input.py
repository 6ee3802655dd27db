"""Bad input raises a clear error before anything is written (CPU; runs in CI).

Together with test_plan.py, test_streams.py and test_blocks_plan.py this covers
copy_batch, swap_blocks, resolve_stream, the host-memory helpers and
TransferQueue arguments. None of these cases needs a GPU: every check runs
before the driver is touched.
"""

from __future__ import annotations

import mmap
import re

import numpy as np
import pytest

import kvcopy
from kvcopy._plans.copies import find_overlap


def u64(values):
    return np.asarray(values, dtype=np.uint64)


# ------------------------------------------------------------------ copy_batch


@pytest.mark.parametrize(
    "kwargs, kind, match",
    [
        (dict(src_ptrs=[1, 2], dst_ptrs=[3], sizes=[1, 1]), ValueError, "differ in length"),
        (dict(src_ptrs=[1], dst_ptrs=[3], sizes=[-1]), ValueError, r"sizes\[0\] = -1 is negative"),
        (dict(src_ptrs=[1], dst_ptrs=[3], sizes=[2**63]), ValueError, "larger than 2\\*\\*63"),
        (dict(src_ptrs=[1], dst_ptrs=[3], sizes=[2**64 + 1]), ValueError, "64 bits"),
        (dict(src_ptrs=[1.5], dst_ptrs=[3], sizes=[1]), TypeError, r"src_ptrs\[0\] is float"),
        (dict(src_ptrs=[1], dst_ptrs=["3"], sizes=[1]), TypeError, r"dst_ptrs\[0\] is str"),
        (dict(src_ptrs=[None], dst_ptrs=[3], sizes=[1]), TypeError, r"src_ptrs\[0\] is NoneType"),
        (dict(src_ptrs=[1], dst_ptrs=[3], sizes=[True]), TypeError, r"sizes\[0\] is bool"),
        (dict(src_ptrs=None, dst_ptrs=[3], sizes=[1]), TypeError, "src_ptrs: expected a sequence"),
        (dict(src_ptrs="0x10", dst_ptrs=[3], sizes=[1]), TypeError, "got str"),
        (dict(src_ptrs=np.array([1.0]), dst_ptrs=[3], sizes=[1]), TypeError, "integer dtype, got float64"),
        (dict(src_ptrs=[1], dst_ptrs=[3], sizes=np.array([[1]])), ValueError, "1-D"),
        (dict(src_ptrs=[0], dst_ptrs=[3], sizes=[8]), ValueError, r"src_ptrs\[0\] is a null pointer"),
        (dict(src_ptrs=[1], dst_ptrs=[0], sizes=[8]), ValueError, r"dst_ptrs\[0\] is a null pointer"),
        (dict(src_ptrs=[2**64 - 2], dst_ptrs=[8], sizes=[8]), ValueError, "past the end of the address"),
        (dict(src_ptrs=[1], dst_ptrs=[3], sizes=[1], method="dma"), ValueError, "method must be one of"),
        (
            dict(src_ptrs=[1], dst_ptrs=[3], sizes=[1], src_access_order="never"),
            ValueError,
            "src_access_order",
        ),
        (dict(src_ptrs=[1], dst_ptrs=[3], sizes=[1], max_ctas=0), ValueError, "max_ctas"),
        (dict(src_ptrs=[1], dst_ptrs=[3], sizes=[1], max_ctas=True), TypeError, "max_ctas"),
        (dict(src_ptrs=[1], dst_ptrs=[3], sizes=[1], max_ctas=2.0), TypeError, "max_ctas"),
        (dict(src_ptrs=[1], dst_ptrs=[3], sizes=[1], stream="default"), TypeError, "stream"),
        (dict(src_ptrs=[1], dst_ptrs=[3], sizes=[1], stream=-5), ValueError, "not a valid CUstream"),
        (
            dict(src_ptrs=[10, 20], dst_ptrs=[100, 104], sizes=[8, 8], check_overlap=True),
            ValueError,
            r"dst_ptrs\[0\] and dst_ptrs\[1\] write overlapping bytes",
        ),
    ],
)
def test_copy_batch_rejects(kwargs, kind, match):
    with pytest.raises(kind, match=match):
        kvcopy.copy_batch(**kwargs)


def test_a_pointer_tensor_without_memory_is_rejected():
    torch = pytest.importorskip("torch")
    meta = torch.empty(2, dtype=torch.int64, device="meta")
    with pytest.raises(TypeError, match="^src_ptrs: a meta tensor"):
        kvcopy.copy_batch(meta, [1, 2], [1, 1])


def test_find_overlap():
    assert find_overlap(u64([0, 8, 16]), u64([8, 8, 8])) is None
    assert find_overlap(u64([16, 0, 12]), u64([8, 8, 8])) == (0, 2)
    assert find_overlap(u64([0, 4]), u64([4, 0])) is None  # empty copies never overlap


# ------------------------------------------------------------------ swap_blocks


def test_swap_blocks_rejects_duplicate_destination_blocks():
    a = np.zeros((4, 8), np.uint8)
    with pytest.raises(
        ValueError,
        match=r"block_mapping\[0\] and block_mapping\[2\] both write "
        "destination block 3",
    ):
        kvcopy.swap_blocks(a, a.copy(), [[0, 3], [1, 2], [2, 3]])


def test_swap_blocks_rejects_mixed_block_sizes_across_pairs():
    with pytest.raises(ValueError, match="call swap_blocks once per size"):
        kvcopy.swap_blocks(
            [np.zeros((4, 8), np.uint8), np.zeros((4, 16), np.uint8)],
            [np.zeros((4, 8), np.uint8), np.zeros((4, 16), np.uint8)],
            [[0, 0]],
        )


def test_swap_blocks_rejects_bad_stream_before_copying():
    with pytest.raises(TypeError, match="stream"):
        kvcopy.swap_blocks(np.zeros((4, 8)), np.zeros((4, 8)), [[0, 1]], stream=3.0)


def test_swap_blocks_rejects_overlapping_block_stride():
    base = np.zeros(64, np.uint8)
    overlapping = np.lib.stride_tricks.as_strided(base, shape=(4, 16), strides=(8, 1))
    with pytest.raises(ValueError, match="overlap or run backwards"):
        kvcopy.swap_blocks(overlapping, np.zeros((4, 16), np.uint8), [[0, 1]])


# ------------------------------------------------------------------ host memory helpers


def test_pinned_empty_validation():
    with pytest.raises(ValueError, match="negative dimension"):
        kvcopy.pinned_empty((4, -1))
    with pytest.raises(TypeError, match="holds Python objects"):
        kvcopy.pinned_empty(4, dtype=object)


@pytest.mark.parametrize(
    "obj, kind, match",
    [
        (object(), TypeError, "does not expose a buffer"),
        (np.zeros((4, 4))[:, ::2], ValueError, "C-contiguous"),
        (bytearray(), ValueError, "empty"),
        (42, TypeError, "does not expose a buffer"),
    ],
)
def test_register_validation(obj, kind, match):
    with pytest.raises(kind, match=match):
        kvcopy.register(obj)


@pytest.mark.parametrize(
    "chunk, kind", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError), ("8", TypeError)]
)
def test_register_chunk_size(chunk, kind):
    with pytest.raises(kind, match="chunk_bytes"):
        kvcopy.register(np.zeros(16), chunk_bytes=chunk)


def test_register_accepts_mmap_and_readonly_buffers_before_the_driver():
    region = mmap.mmap(-1, 4096)
    reg = kvcopy.register(region)
    assert reg.nbytes == 4096 and not reg.readonly
    ro = kvcopy.register(bytes(64))
    assert ro.readonly
    del reg
    region.close()


# ------------------------------------------------------------------ TransferQueue arguments


def test_transfer_queue_validates_before_the_driver():
    with pytest.raises(ValueError, match="method must be one of"):
        kvcopy.TransferQueue(np.zeros((4, 4)), np.zeros((4, 4)), method="fastest")
    with pytest.raises(ValueError, match="different numbers of tensors"):
        kvcopy.TransferQueue([np.zeros((4, 4))] * 2, [np.zeros((4, 4))])
    with pytest.raises(ValueError, match="contiguous"):
        kvcopy.TransferQueue(np.zeros((4, 4))[:, ::2], np.zeros((4, 2)))
    ro = np.zeros((4, 4))
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kvcopy.TransferQueue(np.zeros((4, 4)), ro)


# ------------------------------------------------------------------ resolve_stream extras


@pytest.mark.parametrize("obj", [3.0, "1", b"2", [0], {"stream": 0}, object])
def test_resolve_stream_type_errors(obj):
    with pytest.raises(TypeError):
        kvcopy.resolve_stream(obj)


# ------------------------------------------------------------------ copy_both_ways


@pytest.mark.parametrize(
    "store, message",
    [
        (([1], [2]), "store must be a (src_ptrs, dst_ptrs, sizes) triple; got a tuple of 2"),
        ("abc", "store must be a (src_ptrs, dst_ptrs, sizes) triple; got str"),
        (([1.5], [2], [3]), "store: src_ptrs[0] is float"),
    ],
)
def test_copy_both_ways_rejects_bad_sides(store, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        kvcopy.copy_both_ways(store, ([1 << 20], [2 << 20], [8]))


def test_copy_both_ways_names_the_side_of_a_bad_copy():
    with pytest.raises(ValueError, match=re.escape("load: src_ptrs[0] is a null pointer with size 3")):
        kvcopy.copy_both_ways(([1 << 20], [2 << 20], [8]), ([0], [4 << 20], [3]))
    with pytest.raises(ValueError, match=r"^store: sizes\[1\] = -1 is negative"):
        kvcopy.copy_both_ways(([1 << 20, 3 << 20], [2 << 20, 5 << 20], [8, -1]), ([6 << 20], [7 << 20], [3]))


def test_copy_both_ways_rejects_an_unknown_method():
    with pytest.raises(ValueError, match="method must be one of"):
        kvcopy.copy_both_ways(([1], [2], [3]), ([4], [5], [6]), method="fast")
