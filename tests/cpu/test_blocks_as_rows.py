"""swap_blocks by the layout kernel: where each side's tensors share one stride, the
block ids go up as one array per side and the launch computes every address (a tensor
a plane, a block a row, a split block a slot of a page); otherwise the block kernel's
tensor table is needed. The driver is faked (kvcopy.testing's seams)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcopy import policy
from kvcopy.policy import ROWS_HOST_CTAS
from kvcopy.testing import cuda, engine, plans
from helpers.rows_fakes import DEVICE, PINNED, STREAM, install_rows_fakes

SIDE = 0x5100


@pytest.fixture
def slot_memory():
    return np.zeros(1 << 16, np.uint8)


@pytest.mark.parametrize("split", [False, True])
def test_blocks_of_one_stride_per_side_are_read_as_two_id_arrays(seams, slot_memory, split):
    """A few pairs' ids are read where the CPU wrote them (the ring slot as the device
    maps it, 0x2000): no upload before the launch."""
    driver = install_rows_fakes(seams, slot_memory, PINNED, DEVICE)
    src = [np.zeros((16, 1024) if split else (64, 512), np.uint8) for _ in range(3)]
    dst = [np.zeros((80, 256) if split else (40, 512), np.uint8) for _ in range(3)]
    mapping = np.array([[5, 1], [7, 0], [63, 39]])
    plan = plans.plan_blocks(src, dst, mapping, split_blocks=split)
    assert engine.blocks.execute_blocks(plan, STREAM) == "kernel"
    # a split side: 4 slots per page of 1024 bytes, each slot 256 bytes on
    src_side = (0x3000, 64, 4, 1024, 256, 256) if split else (0x3000, 64, 1, 512, 512, 512)
    block = 256 if split else 512
    dst_side = (0x3000 + 24, 80, 1, 256, 256, 256) if split else (0x3000 + 24, 40, 1, 512, 512, 512)
    assert policy.indices_in_place(48, 3)
    assert driver.calls == [
        ("launch", 42, (0x2000, *src_side[1:]), (0x2000 + 24, *dst_side[1:]), 3, 1, block, STREAM),
        ("fence", 0x77, STREAM),
    ]
    np.testing.assert_array_equal(slot_memory[:48].view(np.int64), [5, 7, 63, 1, 0, 39])
    assert driver.ctas == [ROWS_HOST_CTAS["h2d"]]


def test_ids_that_many_tensors_read_go_up_before_the_launch(seams, slot_memory):
    """One chunk of 1,024 pairs read by each of 8 tensors a side: 128 KiB of reads over
    the link in place, so the ids are uploaded once and read from GPU memory."""
    driver = install_rows_fakes(seams, slot_memory, PINNED, DEVICE)
    src = [np.zeros((1024, 64), np.uint8) for _ in range(8)]
    dst = [np.zeros((1024, 64), np.uint8) for _ in range(8)]
    mapping = np.stack([np.arange(1024), np.arange(1024)[::-1]], axis=1)
    assert not policy.indices_in_place(16 * 1024, 8) and policy.id_chunks(1024) == [1024]
    engine.blocks.execute_blocks(plans.plan_blocks(src, dst, mapping), STREAM)
    side = (1024, 1, 64, 64, 64)
    assert driver.calls == [
        ("upload", 0x3000, 16 * 1024, STREAM),
        ("launch", 42, (0x3000, *side), (0x3000 + 8 * 1024, *side), 1024, 1, 64, STREAM),
        ("fence", 0x77, STREAM),
    ]


def test_ids_go_up_in_chunks_each_launched_once_written(seams, slot_memory):
    """Each chunk's ids go up on a side stream and only its own launch waits for them:
    no upload sits on the caller's stream between two launches."""
    driver = install_rows_fakes(
        seams, slot_memory, DEVICE, PINNED, side_stream=lambda handle, index=0: SIDE + index
    )
    src, dst = np.zeros((4096, 64), np.uint8), np.zeros((4096, 64), np.uint8)
    mapping = np.stack([np.arange(3000), np.arange(3000)[::-1] + 7], axis=1)
    assert policy.id_chunks(3000) == [1024, 1976]
    engine.blocks.execute_blocks(plans.plan_blocks(src, dst, mapping), STREAM)
    assert driver.calls == chunked_calls()
    assert_chunked_ids(slot_memory, mapping)


def chunked_calls() -> list[tuple]:
    """What issuing 3,000 pairs of 64-byte blocks between 4,096-block sides asks: each
    of two chunks' ids uploaded on side stream 3, waited for, launched."""
    side = (4096, 1, 64, 64, 64)
    first, second = 0x3000, 0x3000 + 16 * 1024
    uploads = SIDE + 3
    return [
        ("upload", first, 16 * 1024, uploads),
        ("wait", STREAM, uploads),
        ("launch", 42, (first, *side), (first + 8 * 1024, *side), 1024, 1, 64, STREAM),
        ("upload", second, 16 * 1976, uploads),
        ("wait", STREAM, uploads),
        ("launch", 42, (second, *side), (second + 8 * 1976, *side), 1976, 1, 64, STREAM),
        ("fence", 0x77, STREAM),
    ]


def assert_chunked_ids(slot_memory: np.ndarray, mapping: np.ndarray) -> None:
    """Each chunk's ids in the slot: its sources, then its destinations."""
    ids = slot_memory[: 16 * 3000].view(np.int64)
    np.testing.assert_array_equal(ids[:1024], mapping[:1024, 0])
    np.testing.assert_array_equal(ids[1024:2048], mapping[:1024, 1])
    np.testing.assert_array_equal(ids[2048 : 2048 + 1976], mapping[1024:, 0])
    np.testing.assert_array_equal(ids[2048 + 1976 :], mapping[1024:, 1])


def test_a_repeat_of_chunked_ids_launches_each_chunks_launches_built_once(seams, slot_memory):
    """The same call again with new ids (3,000 pairs: two chunks) goes to the launches
    the first call's chunks built, each chunk's new ids uploaded and read at its offset;
    no launch is built again."""
    driver = install_rows_fakes(
        seams, slot_memory, DEVICE, PINNED, side_stream=lambda handle, index=0: SIDE + index
    )
    src, dst = np.zeros((4096, 64), np.uint8), np.zeros((4096, 64), np.uint8)
    first = np.stack([np.arange(3000), np.arange(3000)[::-1] + 7], axis=1)
    engine.blocks.execute_blocks(plans.plan_blocks(src, dst, first), STREAM)
    built = []
    real = driver.RowsLaunches
    driver.RowsLaunches = lambda *args: built.append(args) or real(*args)
    driver.calls.clear()
    again = np.stack([np.arange(3000)[::-1], np.arange(3000) + 9], axis=1)
    assert engine.blocks.execute_blocks(plans.plan_blocks(src, dst, again), STREAM) == "kernel"
    assert built == []
    assert driver.calls == chunked_calls()
    assert_chunked_ids(slot_memory, again)


def test_sides_whose_tensors_differ_in_stride_need_the_tensor_table():
    wide = np.zeros((64, 1024), np.uint8)
    src = [np.zeros((64, 512), np.uint8), wide[:, :512]]
    dst = [np.zeros((64, 512), np.uint8) for _ in range(2)]
    mapping = np.array([[1, 2]])
    assert plans.plan_blocks(src, dst, mapping).layout_sides() is None
    assert plans.plan_blocks(dst, dst[::-1], mapping).layout_sides() == (
        (64, 1, 512, 512, 512),
        (64, 1, 512, 512, 512),
    )


def test_split_block_ids_writes_each_column_as_one_array():
    mapping = np.arange(10, dtype=np.int64).reshape(5, 2)
    out = np.full(12, -1, np.int64)
    assert cuda.plan_arrays.split_block_ids(mapping, out.ctypes.data) == 80
    np.testing.assert_array_equal(out, [0, 2, 4, 6, 8, 1, 3, 5, 7, 9, -1, -1])
    with pytest.raises(ValueError, match="two columns"):
        cuda.plan_arrays.split_block_ids(np.zeros((2, 3), np.int64), out.ctypes.data)


def test_split_block_ids_writes_a_run_of_pairs_and_refuses_one_past_the_end():
    mapping = np.arange(10, dtype=np.int64).reshape(5, 2)
    out = np.full(8, -1, np.int64)
    assert cuda.plan_arrays.split_block_ids(mapping, out.ctypes.data, 1, 3) == 48
    np.testing.assert_array_equal(out, [2, 4, 6, 3, 5, 7, -1, -1])
    assert cuda.plan_arrays.split_block_ids(mapping, out.ctypes.data, 5, 0) == 0
    for start, count in ((3, 3), (-1, 2), (6, -1)):
        with pytest.raises(ValueError, match="split_block_ids: pairs"):
            cuda.plan_arrays.split_block_ids(mapping, out.ctypes.data, start, count)
    np.testing.assert_array_equal(out, [2, 4, 6, 3, 5, 7, -1, -1])


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 64, 1001])
@pytest.mark.parametrize("offset", [0, 8])  # ids at a 16-byte boundary, or 8 bytes past
def test_split_block_ids_writes_every_id_whatever_the_alignment(count, offset):
    """The streaming stores take aligned 16-byte pieces: the source array at either
    alignment, the destination array after it at the other one for odd counts."""
    rng = np.random.default_rng(count)
    mapping = rng.integers(-5, 1 << 40, size=(count, 2), dtype=np.int64)
    memory = np.full(2 * count + 8, -7, np.int64)
    base = memory.ctypes.data
    first = (-base % 16 + offset) // 8  # int64s to skip so that the ids start at `offset`
    assert (base + 8 * first) % 16 == offset
    written = cuda.plan_arrays.split_block_ids(mapping, base + 8 * first)
    assert written == 16 * count
    np.testing.assert_array_equal(memory[first : first + count], mapping[:, 0])
    np.testing.assert_array_equal(memory[first + count : first + 2 * count], mapping[:, 1])
    assert (memory[:first] == -7).all() and (memory[first + 2 * count :] == -7).all()


@pytest.mark.parametrize("n", [0, 1, 5, 8, 9, 63, 1000])
@pytest.mark.parametrize("offset", [0, 8])
def test_write_indices_copies_every_byte_and_nothing_beside(n, offset):
    values = np.arange(n, dtype=np.int64) * 3 - 1
    memory = np.full(n + 6, -7, np.int64)
    first = (-memory.ctypes.data % 16 + offset) // 8
    assert cuda.plan_arrays.write_indices(memory.ctypes.data + 8 * first, values) == 8 * n
    np.testing.assert_array_equal(memory[first : first + n], values)
    assert (memory[:first] == -7).all() and (memory[first + n :] == -7).all()
