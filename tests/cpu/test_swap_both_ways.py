"""swap_blocks_both_ways without a GPU: its arguments are checked and named by side
before anything is issued, and what reaches copy_both_ways' engine is every block
copy of both sides, at the addresses the block ids name."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import testing

BLOCK = 4096


def caches(blocks: int, tensors: int = 2) -> list[np.ndarray]:
    return [np.zeros((blocks, BLOCK), dtype=np.uint8) for _ in range(tensors)]


class Issued(list):
    """execute_both's calls; ``offered``: the block plans execute_blocks_both got first
    (it declines here, as it does where the block kernel does not apply)."""

    offered: list[tuple]


@pytest.fixture
def issued(monkeypatch):
    """What swap_blocks_both_ways hands to both_ways.execute_both. The driver is never
    reached: the handles these tests pass are not streams."""
    calls = Issued()
    calls.offered = []

    def execute_both(first, second, handle, method, names):
        calls.append((first, second, handle, method, names))
        return "kernel", "kernel"

    def execute_blocks_both(first, second, handle, method):
        calls.offered.append((first, second, handle, method))
        return None

    monkeypatch.setattr(testing.engine.both_ways, "execute_both", execute_both)
    monkeypatch.setattr(testing.engine.both_ways, "execute_blocks_both", execute_blocks_both)
    return calls


def test_both_sides_reach_the_engine_as_every_block_copy_named_by_side(issued):
    gpu, host = caches(8), caches(12)
    store, load = np.array([[0, 11], [3, 2]]), np.array([[5, 7]])
    ran = kvcopy.swap_blocks_both_ways((gpu, host, store), (host, gpu, load), stream=0x1234, method="kernel")
    assert ran == ("kernel", "kernel")
    ((first, second, handle, method, names),) = issued
    assert (handle, method, names) == (0x1234, "kernel", ("store", "load"))
    # the block kernel's path was offered both validated plans first
    ((plan_a, plan_b, handle, method),) = issued.offered
    assert (handle, method) == (0x1234, "kernel")
    assert plan_a.mapping.tolist() == store.tolist() and plan_b.mapping.tolist() == load.tolist()
    assert plan_a.geometry.src_base.tolist() == [a.ctypes.data for a in gpu]
    assert plan_b.geometry.dst_base.tolist() == [a.ctypes.data for a in gpu]

    def at(arrays, tensor, block):
        return arrays[tensor].ctypes.data + block * BLOCK

    # tensor-major: each tensor's pairs in mapping order
    assert first[0].tolist() == [at(gpu, t, s) for t in range(2) for s, _ in store]
    assert first[1].tolist() == [at(host, t, d) for t in range(2) for _, d in store]
    assert second[0].tolist() == [at(host, t, s) for t in range(2) for s, _ in load]
    assert second[1].tolist() == [at(gpu, t, d) for t in range(2) for _, d in load]
    assert first[2].tolist() == [BLOCK] * 4 and second[2].tolist() == [BLOCK] * 2


@pytest.mark.parametrize(
    "store, load, error, message",
    [
        ("nope", None, TypeError, r"^store must be a \(src, dst, block_mapping\) triple; got str$"),
        (
            (1, 2, 3, 4),
            None,
            TypeError,
            r"^store must be a \(src, dst, block_mapping\) triple; "
            r"got a tuple of 4$",
        ),
        (
            None,
            [1, 2],
            TypeError,
            r"^load must be a \(src, dst, block_mapping\) triple; "
            r"got a list of 2$",
        ),
        (
            "ids",
            None,
            ValueError,
            r"^store: block_mapping\[1\]: destination block 12 is out of "
            r"range for dst\[0\], which has 12 blocks$",
        ),
        (
            None,
            "ids",
            ValueError,
            r"^load: block_mapping\[0\] and block_mapping\[1\] both write "
            r"destination block 4$",
        ),
        (
            None,
            "sizes",
            ValueError,
            r"^load: src\[0\] has blocks of 4096 bytes but dst\[0\] of "
            r"2048",
        ),
    ],
)
def test_bad_sides_are_named_and_nothing_is_issued(issued, store, load, error, message):
    gpu, host = caches(8), caches(12)
    good_store, good_load = (gpu, host, [[0, 1]]), (host, gpu, [[2, 3]])
    if store == "ids":
        store = (gpu, host, [[0, 1], [1, 12]])
    if load == "ids":
        load = (host, gpu, [[0, 4], [1, 4]])
    if load == "sizes":
        load = (host, [np.zeros((8, 2048), np.uint8)] * 2, [[0, 1]])
    with pytest.raises(error, match=message):
        kvcopy.swap_blocks_both_ways(
            good_store if store is None else store, good_load if load is None else load, stream=0x1234
        )
    assert issued == [] and issued.offered == []


@pytest.mark.parametrize(
    "options, error", [({"method": "fast"}, ValueError), ({"split_blocks": 1}, TypeError)]
)
def test_bad_options_are_refused(issued, options, error):
    gpu, host = caches(8), caches(12)
    with pytest.raises(error):
        kvcopy.swap_blocks_both_ways((gpu, host, [[0, 1]]), (host, gpu, [[2, 3]]), stream=0x1234, **options)
    assert issued == [] and issued.offered == []


def test_a_load_back_between_the_stores_caches_reads_them_once(issued, monkeypatch):
    """Lists of torch tensors of one layout per side (per-layer caches): the load's
    geometry is the store's reversed, not read again, and the copies are the same as
    when the lists are read side by side."""
    torch = pytest.importorskip("torch")
    from kvcopy._plans import blocks

    gpu = [torch.zeros(8, 16, 128, dtype=torch.bfloat16) for _ in range(4)]
    host = [torch.zeros(12, 16, 128, dtype=torch.bfloat16) for _ in range(4)]
    store, load = np.array([[0, 11], [3, 2]]), np.array([[5, 7], [9, 1]])
    reads = []
    layout = blocks.uniform_torch_layout
    monkeypatch.setattr(
        blocks, "uniform_torch_layout", lambda tensors: reads.append(len(tensors)) or layout(tensors)
    )
    kvcopy.swap_blocks_both_ways((gpu, host, store), (host, gpu, load), stream=0x1234)
    assert reads == [4, 4]  # each side's list once
    kvcopy.swap_blocks_both_ways((gpu, host, store), (list(host), list(gpu), load), stream=0x1234)
    assert reads == [4, 4] + [4] * 4  # other lists: each direction read
    shared, apart = issued
    for a, b in zip(shared[:2], apart[:2]):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    # the load's sources are host blocks 5 and 9, its destinations GPU blocks 7 and 1
    block = 16 * 128 * 2
    assert shared[1][0][:2].tolist() == [host[0].data_ptr() + 5 * block, host[0].data_ptr() + 9 * block]
    assert shared[1][1][:2].tolist() == [gpu[0].data_ptr() + 7 * block, gpu[0].data_ptr() + 1 * block]


def test_a_bad_load_id_is_named_when_the_geometry_is_shared(issued):
    torch = pytest.importorskip("torch")
    gpu = [torch.zeros(8, 1024, dtype=torch.uint8) for _ in range(2)]
    host = [torch.zeros(12, 1024, dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(
        ValueError,
        match=r"^load: block_mapping\[0\]: destination block 8 is "
        r"out of range for dst\[0\], which has 8 blocks$",
    ):
        kvcopy.swap_blocks_both_ways((gpu, host, [[0, 1]]), (host, gpu, [[2, 8]]), stream=0x1234)
    assert issued == [] and issued.offered == []


def test_the_reversed_geometry_is_what_reading_the_other_way_gives():
    torch = pytest.importorskip("torch")
    from kvcopy._plans.blocks import block_geometry, geometry_and_reverse

    a = [torch.zeros(2, 8, 16, 64)[k] for k in range(2)]  # K and V views of one layer
    b = [torch.zeros(30, 16, 64) for _ in range(2)]
    forward, backward = (geometry for geometry, _ in geometry_and_reverse(a, b))
    for got, want in ((forward, block_geometry(a, b)), (backward, block_geometry(b, a))):
        assert got.block_bytes == want.block_bytes
        for field in (
            "src_base",
            "dst_base",
            "src_extent",
            "dst_extent",
            "src_stride",
            "dst_stride",
            "src_factor",
            "dst_factor",
            "src_blocks",
            "dst_blocks",
        ):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field), field)
    assert geometry_and_reverse(a, b[:1]) is None  # unequal lists
    assert geometry_and_reverse(a, [torch.zeros(30, 8, 64)] * 2) is None  # two block sizes
