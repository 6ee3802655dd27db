"""copy_rows' engine with the driver faked (kvcopy.testing's seams): which path a plan
takes, what the layout kernel is launched with, and what is refused before any launch."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import policy
from kvcopy.testing import engine, plans
from helpers.rows_fakes import DEVICE, PAGEABLE, PINNED, STREAM, GpuIndices, caches, install_rows_fakes


@pytest.fixture
def slot_memory():
    return np.zeros(1 << 16, np.uint8)  # the ring slot's host side: indices are written there


@pytest.fixture
def fake(seams, slot_memory):
    def make(src, dst, capturing=0):
        return install_rows_fakes(seams, slot_memory, src, dst, capturing)

    return make


def test_gpu_indices_are_read_in_place_by_one_launch(fake):
    driver = fake(DEVICE, PINNED)
    paged, chunk = caches()
    plan = plans.plan_rows(paged, chunk, GpuIndices(40))
    assert engine.rows.execute_rows(plan, STREAM) == "kernel"
    assert driver.calls == [
        (
            "launch",
            42,
            (0x7000_0000, 128, 16, 16 * 256, 256, 256),
            (0, 40, 1, 256, 256, 256),
            40,
            1,
            256,
            STREAM,
        )
    ]


def test_host_indices_are_read_in_a_ring_slot_then_fenced(fake, slot_memory):
    """20 rows' indices a side: read by the launch where they were written (the slot as
    the device maps it, 0x2000), no upload before it."""
    driver = fake(DEVICE, PINNED)
    paged, chunk = caches()
    slots = np.arange(100, 120)
    plan = plans.plan_rows(paged, chunk, slots, np.arange(20) * 2)
    assert engine.rows.execute_rows(plan, STREAM) == "kernel"
    assert driver.calls == [
        (
            "launch",
            42,
            (0x2000, 128, 16, 4096, 256, 256),
            (0x2000 + 160, 40, 1, 256, 256, 256),
            20,
            1,
            256,
            STREAM,
        ),
        ("fence", 0x77, STREAM),
    ]
    written = slot_memory[:320].view(np.int64)
    np.testing.assert_array_equal(written, np.concatenate([slots, np.arange(20) * 2]))


def test_ring_indices_are_uploaded_where_their_readers_would_read_too_much_in_place(fake, slot_memory):
    """The same 320 bytes of indices each read by 256 of the kernel's units (80 KiB over
    the link): uploaded on the stream first, read from the slot's device side."""
    driver = fake(DEVICE, PINNED)
    host = engine.rows.Indices(20, host=np.arange(100, 120, dtype=np.int64))
    sides = ((host, 20), (engine.rows.Indices(20, host=np.arange(20, dtype=np.int64)), 20))
    assert not policy.indices_in_place(320, 256) and policy.indices_in_place(320, 204)
    with engine.rows.ring_indices(sides, STREAM, readers=256) as where:
        assert where == [0x3000, 0x3000 + 160]
    with engine.rows.ring_indices(sides, STREAM, readers=204) as where:
        assert where == [0x2000, 0x2000 + 160]
    assert driver.calls == [("upload", 0x3000, 320, STREAM), ("fence", 0x77, STREAM), ("fence", 0x77, STREAM)]


def test_gpu_indices_with_pageable_memory_are_refused_before_any_launch(fake):
    driver = fake(DEVICE, PAGEABLE)
    paged, chunk = caches()
    with pytest.raises(ValueError, match="indices on the GPU need both layouts in memory"):
        engine.rows.execute_rows(plans.plan_rows(paged, chunk, GpuIndices(4)), STREAM)
    assert driver.calls == []


def test_no_rows_issue_nothing(fake):
    driver = fake(DEVICE, PINNED)
    paged, chunk = caches()
    assert engine.rows.execute_rows(plans.plan_rows(paged, chunk, rows=0), STREAM) == "none"
    assert driver.calls == []


@pytest.mark.parametrize("src, dst, direction", [(DEVICE, PINNED, "d2h"), (PINNED, DEVICE, "h2d")])
def test_layout_kernel_launches_with_its_own_host_ctas(fake, src, dst, direction):
    from kvcopy.config import config
    from kvcopy.policy import ROWS_HOST_CTAS

    driver = fake(src, dst)
    paged, chunk = caches()
    a, b = (paged, chunk) if direction == "d2h" else (chunk, paged)
    indices = (GpuIndices(40), None) if direction == "d2h" else (None, GpuIndices(40))
    engine.rows.execute_rows(plans.plan_rows(a, b, *indices), STREAM)
    config.host_ctas = 7
    try:
        engine.rows.execute_rows(plans.plan_rows(a, b, *indices), STREAM)
    finally:
        config.host_ctas = None
    assert driver.ctas == [ROWS_HOST_CTAS[direction], 7]


def test_a_prepared_transfer_is_built_once_and_launched_by_each_call(fake):
    import kvcopy

    driver = fake(DEVICE, PINNED)
    paged, chunk = caches()
    prepared = kvcopy.prepare_rows(paged, chunk, GpuIndices(40), stream=STREAM)
    assert driver.calls == []  # nothing enqueued by preparing
    assert [prepared() for _ in range(3)] == ["kernel"] * 3
    launch = (
        "launch",
        42,
        (0x7000_0000, 128, 16, 16 * 256, 256, 256),
        (0, 40, 1, 256, 256, 256),
        40,
        1,
        256,
        STREAM,
    )
    assert driver.calls == [launch] * 3
    assert driver.contexts == [0xC0] * 3  # made current for each launch
    assert (prepared.rows, prepared.stream) == (40, STREAM)
    assert kvcopy.last_decision().method == "kernel"


def test_a_prepared_transfer_refuses_host_indices(fake):
    import kvcopy

    driver = fake(DEVICE, PINNED)
    paged, chunk = caches()
    with pytest.raises(ValueError, match="prepare_rows: indices on the host"):
        kvcopy.prepare_rows(paged, chunk, np.arange(4), stream=STREAM)
    assert driver.calls == []


def test_a_prepared_transfer_refuses_pageable_memory(fake):
    import kvcopy

    driver = fake(DEVICE, PAGEABLE)
    paged, chunk = caches()
    with pytest.raises(ValueError, match="prepare_rows: the layout kernel needs both layouts"):
        kvcopy.prepare_rows(paged, chunk, rows=4, stream=STREAM)
    with pytest.raises(ValueError, match="indices on the GPU need both layouts"):
        kvcopy.prepare_rows(paged, chunk, GpuIndices(4), stream=STREAM)
    assert driver.calls == []


def test_a_prepared_transfer_of_no_rows_issues_nothing(fake):
    import kvcopy

    driver = fake(DEVICE, PINNED)
    paged, chunk = caches()
    prepared = kvcopy.prepare_rows(paged, chunk, GpuIndices(0), stream=STREAM)
    assert prepared() == "none" and driver.calls == []


def test_indices_each_read_by_a_rows_pieces_in_every_plane_are_uploaded_where_many(fake, slot_memory):
    """256 rows' indices a side (4 KiB) over 2 planes of rows cut into 16 pieces: each
    index read by 32 units, 128 KiB over the link in place, so uploaded first; the same
    rows of one piece each (8 KiB in place) are read where they were written."""
    driver = fake(DEVICE, PINNED)
    memory = np.zeros((2, 2, 512, 1024), np.uint8)  # (a side, 2 planes a side)
    slots = np.arange(256, dtype=np.int64)

    def layout(side: int, pieces: int) -> kvcopy.Layout:
        bases = [memory[side, p].ctypes.data for p in range(2)]
        return kvcopy.Layout.from_pointers(bases, slots=512, row_bytes=1024, pieces=pieces)

    for pieces, first in ((16, "upload"), (1, "launch")):
        driver.calls.clear()
        plan = plans.plan_rows(layout(0, pieces), layout(1, pieces), slots, slots[::-1].copy())
        assert engine.rows.execute_rows(plan, STREAM) == "kernel"
        assert driver.calls[0][0] == first, pieces
        assert policy.indices_in_place(4096, 2 * pieces) is (pieces == 1)


def test_ring_indices_fence_their_slot_whether_the_block_raises_or_not(fake, slot_memory):
    driver = fake(DEVICE, PINNED)
    host = engine.rows.Indices(2, host=np.array([3, 1], np.int64))
    sides = ((host, 2), (None, 2))  # (the destination's rows by number)
    with engine.rows.ring_indices(sides, STREAM) as where:  # (no readers given: uploaded)
        assert where == [0x3000, 0]
        assert slot_memory[:16].view(np.int64).tolist() == [3, 1]
    with pytest.raises(RuntimeError, match="launch failed"):
        with engine.rows.ring_indices(sides, STREAM):
            raise RuntimeError("launch failed")
    assert driver.calls == [("upload", 0x3000, 16, STREAM), ("fence", 0x77, STREAM)] * 2
