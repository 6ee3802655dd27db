"""copy_rows_both_ways with the driver faked: with GPU indices each side is a layout
launch (the store on the caller's stream, the load on a side stream forked from it and
joined back; one stream under capture); arguments are checked and named by side, and
with host indices a store and a load that touch the same bytes are refused, all before
anything is issued."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import Layout
from kvcopy.testing import plans
from helpers.rows_fakes import DEVICE, PINNED, STREAM, GpuIndices, caches, install_rows_fakes

SIDE = 0x5151


@pytest.fixture
def slot_memory():
    return np.zeros(1 << 16, np.uint8)


def launched(call):
    """(rows, stream) of a recorded launch."""
    return call[4], call[7]


def test_gpu_indices_run_each_side_on_its_stream_forked_and_joined(seams, slot_memory):
    driver = install_rows_fakes(seams, slot_memory, DEVICE, PINNED, side_stream=lambda handle, index=0: SIDE)
    paged, chunk = caches()
    ran = kvcopy.copy_rows_both_ways(
        (paged, chunk, GpuIndices(40)), (chunk, paged, None, GpuIndices(24, 0x7100_0000)), stream=STREAM
    )
    assert ran == ("kernel", "kernel")
    assert driver.calls[0] == ("wait", SIDE, STREAM)  # the side starts after the caller's work
    assert launched(driver.calls[1]) == (40, STREAM)  # the store on the caller's stream
    assert launched(driver.calls[2]) == (24, SIDE)  # the load beside it
    assert driver.calls[3] == ("wait", STREAM, SIDE)  # and the caller's next work waits
    assert len(driver.calls) == 4


def test_under_capture_both_sides_go_on_the_callers_stream_in_order(seams, slot_memory):
    driver = install_rows_fakes(
        seams, slot_memory, DEVICE, PINNED, capturing=1, side_stream=lambda handle, index=0: SIDE
    )
    paged, chunk = caches()
    kvcopy.copy_rows_both_ways(
        (paged, chunk, GpuIndices(40)), (chunk, paged, None, GpuIndices(24)), stream=STREAM
    )
    assert [launched(c) for c in driver.calls] == [(40, STREAM), (24, STREAM)]


def test_bad_sides_are_named_before_anything_is_issued(seams, slot_memory):
    driver = install_rows_fakes(seams, slot_memory, DEVICE, PINNED)
    paged, chunk = caches()
    with pytest.raises(TypeError, match=r"store must be a \(src, dst"):
        kvcopy.copy_rows_both_ways(paged, (chunk, paged, None, GpuIndices(2)), stream=STREAM)
    with pytest.raises(ValueError, match=r"load: dst_indices\[1\] = 500 is out of range"):
        kvcopy.copy_rows_both_ways(
            (paged, chunk, GpuIndices(2)), (chunk, paged, None, [1, 500]), stream=STREAM
        )
    with pytest.raises(TypeError, match="load: src must be a kvcopy.Layout"):
        kvcopy.copy_rows_both_ways((paged, chunk, GpuIndices(2)), ("chunk", paged, None, [1]), stream=STREAM)
    assert driver.calls == []


def test_host_indices_touching_the_same_bytes_are_refused_naming_both():
    cache = np.zeros((64, 128), np.uint8)
    host = np.zeros((64, 128), np.uint8)
    a, b = Layout.of(cache, slot=0), Layout.of(host, slot=0)
    # the load writes cache slot 5, which the store reads
    with pytest.raises(
        ValueError,
        match=r"load: row 1 writes slot 5 of its dst, which "
        r"store: row 0 reads \(its src\)",
    ):
        kvcopy.copy_rows_both_ways((a, b, [5, 6], [0, 1]), (b, a, [9, 10], [4, 5]))
    # both write host slot 3
    with pytest.raises(
        ValueError,
        match=r"store: row 0 writes slot 3 of its dst, which "
        r"load: row 0 writes \(its dst\)",
    ):
        kvcopy.copy_rows_both_ways((a, b, [1], [3]), (b, b, [7], [3]))


@pytest.mark.parametrize("slots", [64, 100_000])  # a bitmap of slots, or a hash table
def test_a_shared_layout_races_only_on_common_slots(slots):
    cache = np.zeros((slots, 16), np.uint8)
    c = Layout.of(cache, slot=0)
    out, into = (Layout.of(np.zeros((8, 16), np.uint8), slot=0) for _ in range(2))
    store = (c, out, [5, 6, 11, 9], [0, 1, -1, 3])  # row 2 skipped: slot 11 is not read
    with pytest.raises(ValueError, match="load: row 2 writes slot 5 of its dst, which store: row 0 reads"):
        move_both(store, (into, c, None, [7, 8, 5, -1]))
    move_both(store, (into, c, None, [7, 8, 11, 4]))


@pytest.mark.parametrize("slots", [64, 100_000])  # a bitmap of slots, or a hash table
def test_sides_with_indices_on_the_shared_layout_only_race_on_common_slots(slots):
    """A serving step's pair: only the shared layout's side of each has indices."""
    c = Layout.of(np.zeros((slots, 16), np.uint8), slot=0)
    out, into = (Layout.of(np.zeros((8, 16), np.uint8), slot=0) for _ in range(2))
    with pytest.raises(ValueError, match="load: row 2 writes slot 5 of its dst, which store: row 0 reads"):
        move_both((c, out, [5, -1, 11, 5]), (into, c, None, [-1, 8, 5, 4]))
    move_both((c, out, [5, -1, 11, 9]), (into, c, None, [-1, 8, 6, 4]))  # -1 twice: no race


def test_indices_on_one_side_race_as_the_same_rows_named_on_both_sides():
    """Indices on the shared layout's side alone are read as given; the same rows with
    the other side named slot by slot (its rows listed) must be refused, or not, alike."""
    refused = 0
    for seed in range(60):
        rng = np.random.default_rng(seed)
        slots = int(rng.choice([16, 64, 5000]))
        c = Layout.of(np.zeros((slots, 8), np.uint8), slot=0)
        out, into = (Layout.of(np.zeros((12, 8), np.uint8), slot=0) for _ in range(2))
        store = rng.integers(-2, min(slots, 40), 12)
        load = rng.permutation(np.arange(-12, min(slots, 40)))[:12]
        rows = np.arange(12)
        outcomes = []
        for extra in ((), (rows,)):
            try:
                move_both((c, out, store, *extra), (into, c, rows if extra else None, load))
                outcomes.append(None)
            except ValueError as exc:
                outcomes.append(str(exc))
        assert outcomes[0] == outcomes[1], seed
        refused += outcomes[0] is not None
    assert 0 < refused < 60  # both outcomes were compared


def test_layouts_that_meet_otherwise_are_compared_byte_by_byte():
    cache = np.zeros((64, 32), np.uint8)
    whole = Layout.of(cache, slot=0)
    halves = Layout.of(cache.reshape(128, 16), slot=0)  # the same bytes, other rows
    host = Layout.of(np.zeros((8, 32), np.uint8), slot=0)
    half_host = Layout.of(np.zeros((8, 16), np.uint8), slot=0)
    with pytest.raises(
        ValueError,
        match=r"load: dst_ptrs\[0\] writes bytes that store: "
        r"src_ptrs\[0\] reads",
    ):
        move_both((whole, host, [3], [0]), (half_host, halves, None, [7]))  # 7: slot 3's half
    move_both((whole, host, [3], [0]), (half_host, halves, None, [8]))  # slot 4's half


def move_both(store, load):
    """Only the check: the sides planned and refused as copy_rows_both_ways refuses them."""
    plans.refuse_rows_crossing(plans.plan_rows(*store), plans.plan_rows(*load))
