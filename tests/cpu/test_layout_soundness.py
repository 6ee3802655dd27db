"""Layouts that would write undefined bytes are refused before anything is planned: a
destination whose rows overlap, a destination that is read-only, a layout whose tensor
moved since it was made, rows past the 64-bit address space; a Layout built or selected
carelessly is refused by name. Engine layouts whose planes interleave stay accepted."""

from __future__ import annotations

import numpy as np
import pytest

from kvcopy import Layout
from kvcopy.testing import plans, rows_on_host
import kvcopy
from helpers.host_copies import random_bytes, run_on_host

ROW = 16


def plan(src: Layout, dst: Layout, src_indices=None, dst_indices=None, rows=None):
    return plans.plan_rows(src, dst, src_indices, dst_indices, rows)


def chunk(slots: int = 8, seed: int = 0) -> np.ndarray:
    return random_bytes((slots, ROW), seed)


@pytest.mark.parametrize(
    "make, words",
    [
        (
            lambda a: Layout.from_pointers([a.ctypes.data], slots=4, row_bytes=ROW, slot_stride=0),
            "plane 0 slot 0 and plane 0 slot 1 share bytes",
        ),
        (
            lambda a: Layout.from_pointers(
                [a.ctypes.data], slots=8, row_bytes=ROW, page_size=4, page_stride=2 * ROW
            ),
            "share bytes",
        ),
        (
            lambda a: Layout.from_pointers([a.ctypes.data] * 2, slots=4, row_bytes=ROW),
            "plane 0 and plane 1 share bytes",
        ),
        (lambda a: Layout.of([a, a], slot=0), "plane 0 and plane 1 share bytes"),
        (lambda a: Layout.of(a, slot=0).select([0, 0]), "share bytes"),
        (
            lambda a: Layout.from_pointers([a.ctypes.data], slots=4, row_bytes=ROW, pieces=2, piece_stride=4),
            "plane 0 slot 0 and plane 0 slot 0",
        ),
    ],
)
def test_a_destination_whose_rows_overlap_is_refused(make, words):
    memory = chunk()
    dst = make(memory)
    src = (
        Layout.of(chunk(8, 1), slot=0).select([0] * dst.num_planes)
        if dst.num_planes > 1
        else Layout.of(chunk(8, 1), slot=0)
    )
    before = memory.copy()
    with pytest.raises(ValueError, match="dst: its rows overlap") as error:
        plan(src, dst, rows=2)
    assert words in str(error.value)
    with rows_on_host(), pytest.raises(ValueError, match="dst: its rows overlap"):
        kvcopy.copy_rows(src, dst, rows=2)
    np.testing.assert_array_equal(memory, before)  # nothing written


def test_overlapping_rows_are_fine_as_a_source():
    memory, out = chunk(), np.zeros((4, ROW), np.uint8)
    broadcast = Layout.from_pointers([memory.ctypes.data], slots=4, row_bytes=ROW, slot_stride=0)
    run_on_host(*plans.expand(plan(broadcast, Layout.of(out, slot=0), rows=4)))
    np.testing.assert_array_equal(out, np.tile(memory[0], (4, 1)))


@pytest.mark.parametrize(
    "build",
    [
        # flashinfer: one [blocks, 2, block_size, heads, head] per layer, K and V interleaved
        lambda: Layout.of([random_bytes((5, 2, 4, 2, 8), s) for s in range(3)], planes=(1,), page=0, slot=2),
        # heads first: [blocks, heads, block_size, head], the heads as pieces
        lambda: Layout.of(random_bytes((5, 2, 4, 8), 0), page=0, slot=2, pieces=1),
        # SGLang page-first: a token's layers together, layer l at l * item
        lambda: Layout.from_pointers(
            [4096 + 64 * layer for layer in range(4)], slots=32, row_bytes=64, slot_stride=256
        ),
        # strides that do not nest, yet no two rows meet (shown by listing them)
        lambda: Layout.from_pointers(
            [4096],
            slots=3,
            row_bytes=2,
            page_size=3,
            slot_stride=5,
            page_stride=1 << 20,
            pieces=2,
            piece_stride=3,
        ),
    ],
)
def test_engine_layouts_whose_planes_interleave_are_accepted(build):
    assert build().rows_overlap is None


def test_a_read_only_destination_is_refused_and_left_alone(tmp_path):
    src = Layout.of(chunk(4, 2), slot=0)
    frozen = chunk(4, 3)
    frozen.flags.writeable = False
    path = tmp_path / "pool.bin"
    chunk(4, 4).tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=(4, ROW))
    from_bytes = np.frombuffer(bytes(4 * ROW), dtype=np.uint8).reshape(4, ROW)
    for target in (frozen, mapped, from_bytes):
        before = np.array(target)
        dst = Layout.of(target, slot=0)
        assert dst.readonly
        with rows_on_host(), pytest.raises(ValueError, match="dst: its memory is read-only"):
            kvcopy.copy_rows(src, dst, rows=4)
        np.testing.assert_array_equal(np.array(target), before)
        out = np.zeros((4, ROW), np.uint8)  # read-only memory is a fine source
        run_on_host(*plans.expand(plan(dst, Layout.of(out, slot=0), rows=4)))
        np.testing.assert_array_equal(out, before)


def test_a_layout_whose_tensor_moved_is_refused():
    torch = pytest.importorskip("torch")
    src = torch.arange(4 * ROW, dtype=torch.uint8).reshape(4, ROW)
    grown, swapped = torch.zeros(4, ROW, dtype=torch.uint8), torch.zeros(4, ROW, dtype=torch.uint8)
    src_layout = Layout.of(src, slot=0)
    grown_layout, swapped_layout = Layout.of(grown, slot=0), Layout.of(swapped, slot=0)
    with rows_on_host():
        kvcopy.copy_rows(src_layout, grown_layout, rows=4)  # fine while nothing moved
        assert torch.equal(grown, src)
        grown.resize_(1024, ROW)  # new memory: the old is freed
        with pytest.raises(ValueError, match="dst: tensor 0 of the layout has moved"):
            kvcopy.copy_rows(src_layout, grown_layout, rows=4)
        swapped.set_(torch.zeros(8, ROW, dtype=torch.uint8))
        with pytest.raises(ValueError, match="dst: tensor 0 of the layout has moved"):
            kvcopy.copy_rows(src_layout, swapped_layout, rows=4)
        src.resize_(2, ROW)  # the same memory, fewer rows
        with pytest.raises(ValueError, match="src: tensor 0 of the layout has moved"):
            kvcopy.copy_rows(src_layout, Layout.of(torch.zeros(4, ROW, dtype=torch.uint8), slot=0), rows=2)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bases": [(1 << 64) - 8], "slots": 1, "row_bytes": 16},
        {"bases": [4096], "slots": 1 << 62, "row_bytes": 16},
        {"bases": [4096], "slots": 2, "row_bytes": 8, "slot_stride": (1 << 64) - 1},
    ],
)
def test_rows_past_the_address_space_are_refused_by_name(kwargs):
    with pytest.raises(ValueError, match="bases: rows reach 0x.*past the end of the 64-bit"):
        Layout.from_pointers(**kwargs)


def test_a_layout_built_directly_is_checked_and_its_bases_are_read_only():
    with pytest.raises(ValueError, match="bases: every base address must be a positive"):
        Layout(np.array([0], np.uint64), 4, 16)
    with pytest.raises(ValueError, match="row_bytes must be at least 1"):
        Layout(np.array([4096], np.uint64), 4, 0)
    with pytest.raises(TypeError, match="slots must be an int"):
        Layout(np.array([4096], np.uint64), 4.0, 16)  # type: ignore[arg-type]
    mine = np.array([4096, 8192], np.uint64)
    layout = Layout(mine, 4, 16)
    mine[0] = 1  # the caller's array is not the layout's
    assert int(layout.bases[0]) == 4096
    with pytest.raises(ValueError, match="read-only"):
        layout.bases[0] = 1


@pytest.mark.parametrize(
    "planes, error, words",
    [
        (True, TypeError, "planes: expected ints"),
        (1.5, TypeError, "planes: expected ints"),
        ([0, 1.0], TypeError, "planes: expected ints"),
        (3, ValueError, "planes: 3 is out of range for 3 planes"),
        ([-4], ValueError, "planes: -4 is out of range"),
        ([], ValueError, "planes: selects no plane"),
        (slice(5, 9), ValueError, "planes: selects no plane"),
    ],
)
def test_select_names_bad_planes(planes, error, words):
    layout = Layout.from_pointers([4096, 8192, 12288], slots=4, row_bytes=16)
    with pytest.raises(error, match=words):
        layout.select(planes)


def test_select_picks_planes_as_asked():
    layout = Layout.from_pointers([4096, 8192, 12288], slots=4, row_bytes=16)
    assert layout.select(-1).bases.tolist() == [12288]
    assert layout.select(np.array([2, 0])).bases.tolist() == [12288, 4096]
    assert layout.select(slice(1, None)).bases.tolist() == [8192, 12288]


def _brute_overlap(layout: Layout) -> bool:
    """Whether two pieces of the layout share a byte, byte by byte."""
    seen: set[int] = set()
    slots = np.arange(layout.slots)
    for plane in layout.row_addresses(slots).tolist():
        for row in plane:
            for j in range(layout.pieces):
                start = row + j * layout.piece_stride
                piece = set(range(start, start + layout.piece_bytes))
                if seen & piece:
                    return True
                seen |= piece
    return False


def test_the_overlap_verdict_matches_every_byte_on_random_layouts():
    rng = np.random.default_rng(11)
    verdicts = set()
    for _ in range(400):
        pieces = int(rng.integers(1, 3))
        piece = int(rng.integers(1, 5))
        page_size = int(rng.integers(1, 4))
        layout = Layout.from_pointers(
            (4096 + rng.choice(64, size=int(rng.integers(1, 4)), replace=False)).tolist(),
            slots=int(rng.integers(1, 7)),
            row_bytes=piece * pieces,
            page_size=page_size,
            slot_stride=int(rng.integers(0, 12)),
            page_stride=int(rng.integers(0, 40)),
            pieces=pieces,
            piece_stride=int(rng.integers(0, 12)),
        )
        found = layout.rows_overlap is not None
        assert found == _brute_overlap(layout), layout
        verdicts.add(found)
    assert verdicts == {True, False}


def test_runs_interleaved_at_scattered_pages_are_accepted_and_a_meeting_pair_refused():
    # vLLM's canonical layout: each TP rank's head fragments interleaved into shared pages
    # at scattered page addresses (planes neither apart nor evenly spaced)
    page, fragment, ranks = 4096, 256, 4
    pages = [3, 17, 4, 60, 9]
    bases = [4096 * 1024 + p * page + r * fragment for p in pages for r in range(ranks)]
    layout = Layout.from_pointers(bases, slots=4, row_bytes=fragment, slot_stride=ranks * fragment)
    assert layout.rows_overlap is None
    clashing = Layout.from_pointers(
        bases + [bases[5] + ranks * fragment], slots=4, row_bytes=fragment, slot_stride=ranks * fragment
    )
    assert clashing.rows_overlap == "plane 5 and plane 20 share bytes"
