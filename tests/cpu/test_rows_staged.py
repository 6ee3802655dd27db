"""copy_rows_both_ways through GPU staging buffers (kvcopy._engine.rows_staged) on the
CPU: the layout kernel and the copy engines emulated on ordinary memory
(helpers.rows_fakes.RowsOnHostMemory), so that every byte of a staged store and load
is checked against a NumPy oracle, skipped and out-of-range rows included; the order
in which chunks are issued on which streams; when the policy stages and when it does
not; and the planner's rules."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvcopy
from kvcopy import Layout, policy, testing
from kvcopy.testing import cuda, engine
from kvcopy._plans.rows_staging import StagedChunks, chunk_rows, rows_back_to_back, why_not_staged
from helpers.rows_fakes import GpuIndices, RowsOnHostMemory, emulate_on_host_memory, unheld

STREAM, SIDE = 0x1234, 0x5100
LAYERS, PAGES, PAGE, ROW = 2, 32, 4, 64  # 128 slots of 64 B rows in 4 planes
CHUNK = 4096  # 16 rows of 4 planes a chunk


class Staging:
    """kvcopy._engine.staged's buffers as rows_staged uses them, in ordinary memory."""

    def __init__(self, capacity: int = CHUNK) -> None:
        self.buffers = [np.zeros(capacity, np.uint8) for _ in range(4)]
        self.base, self.capacity = self.buffers[0].ctypes.data, capacity
        self.free, self.filled = [101, 102, 103, 104], [201, 202, 203, 204]
        self.lock = threading.Lock()

    def ensure(self, chunk_bytes: int) -> bool:
        return chunk_bytes <= self.buffers[0].nbytes

    def address(self, index: int) -> int:
        return self.buffers[index].ctypes.data


class Step:
    """Paged caches standing in for GPU memory, a chunk to store into and one to load
    from (pinned host memory), and each side's slots as GPU indices."""

    def __init__(self, tokens: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        # (over memory the arrays do not hold: each plan classifies it, so the fake's
        # classification count counts plans)
        self.caches = [
            unheld(rng.integers(0, 256, (2, PAGES, PAGE, ROW), dtype=np.uint8)) for _ in range(LAYERS)
        ]
        self.out = unheld(rng.integers(0, 256, (2, LAYERS, tokens, ROW), dtype=np.uint8))
        self.back = unheld(rng.integers(0, 256, (2, LAYERS, tokens, ROW), dtype=np.uint8))
        order = rng.permutation(PAGES * PAGE)
        self.store_slots = order[:tokens].astype(np.int64)
        self.load_slots = order[tokens : 2 * tokens].astype(np.int64)

    def run(self, method: str = "auto", on_host: bool = False) -> tuple[str, str]:
        """The pair, its slots as GPU indices (read where they lie) or ``on_host``."""
        paged = Layout.of(self.caches, planes=(0,), page=1, slot=2)
        self.before = [c.copy() for c in self.caches]
        self.out_before = self.out.copy()
        store, load = (
            (self.store_slots, self.load_slots)
            if on_host
            else (
                GpuIndices(len(self.store_slots), self.store_slots.ctypes.data),
                GpuIndices(len(self.load_slots), self.load_slots.ctypes.data),
            )
        )
        return kvcopy.copy_rows_both_ways(
            (paged, Layout.of(self.out, planes=(1, 0), slot=2), store),
            (Layout.of(self.back, planes=(1, 0), slot=2), paged, None, load),
            stream=STREAM,
            method=method,
        )

    def expected_out(self) -> np.ndarray:
        want = self.out_before.copy()
        for t, s in enumerate(self.store_slots):
            if 0 <= s < PAGES * PAGE:
                for layer, cache in enumerate(self.before):
                    want[:, layer, t] = cache[:, s // PAGE, s % PAGE]
        return want

    def expected_caches(self) -> list[np.ndarray]:
        want = [c.copy() for c in self.before]
        for t, s in enumerate(self.load_slots):
            if 0 <= s < PAGES * PAGE:
                for layer, cache in enumerate(want):
                    cache[:, s // PAGE, s % PAGE] = self.back[:, layer, t]
        return want


@pytest.fixture
def staged_rows(seams, monkeypatch):
    """The driver, the kernel and the copy engines emulated; staging from any size in
    CHUNK-byte chunks. Yields (fake driver, step factory)."""
    monkeypatch.setattr(policy, "ROWS_STAGING_MIN_BYTES", 1)
    seams.enter_context(testing.settings(staging_bytes=CHUNK))
    staging = Staging()
    steps: list[Step] = []

    def make(tokens: int, seed: int = 0) -> Step:
        step = Step(tokens, seed)
        steps.append(step)
        fake.gpu = [(c.ctypes.data, c.ctypes.data + c.nbytes) for c in step.caches]
        return step

    fake = RowsOnHostMemory([])
    fake.staging = staging
    emulate_on_host_memory(seams, fake, staging=staging, side_stream=lambda handle, index=0: SIDE + index)
    yield fake, make


@pytest.mark.parametrize("tokens", [1, 16, 40])
def test_a_staged_store_and_load_move_every_byte(staged_rows, tokens):
    fake, make = staged_rows
    step = make(tokens, seed=tokens)
    assert step.run() == ("staged", "staged")
    assert kvcopy.last_decision().method == "staged"
    np.testing.assert_array_equal(step.out, step.expected_out())
    for cache, want in zip(step.caches, step.expected_caches()):
        np.testing.assert_array_equal(cache, want)
    assert fake.reported == []


def test_a_load_given_first_is_staged_as_well(staged_rows):
    fake, make = staged_rows
    step = make(40, seed=5)
    paged = Layout.of(step.caches, planes=(0,), page=1, slot=2)
    step.before, step.out_before = [c.copy() for c in step.caches], step.out.copy()
    ran = kvcopy.copy_rows_both_ways(
        (
            Layout.of(step.back, planes=(1, 0), slot=2),
            paged,
            None,
            GpuIndices(40, step.load_slots.ctypes.data),
        ),
        (paged, Layout.of(step.out, planes=(1, 0), slot=2), GpuIndices(40, step.store_slots.ctypes.data)),
        stream=STREAM,
    )
    assert ran == ("staged", "staged")
    np.testing.assert_array_equal(step.out, step.expected_out())
    for cache, want in zip(step.caches, step.expected_caches()):
        np.testing.assert_array_equal(cache, want)


def test_rows_cut_in_strided_pieces_on_the_gpu_side_arrive_whole(staged_rows):
    """An HND cache: a token's row is its heads, page_size tokens apart; the chunk keeps
    each row whole."""
    fake, make = staged_rows
    make(1)
    heads, page, head_bytes, pages, tokens = 4, 8, 64, 8, 24  # two chunks of 16 rows
    rng = np.random.default_rng(9)
    cache = rng.integers(0, 256, (pages, heads, page, head_bytes), dtype=np.uint8)
    fake.gpu = [(cache.ctypes.data, cache.ctypes.data + cache.nbytes)]
    out = np.zeros((tokens, heads * head_bytes), np.uint8)
    back = rng.integers(0, 256, (tokens, heads * head_bytes), dtype=np.uint8)
    order = rng.permutation(pages * page)
    store, load = order[:tokens].astype(np.int64), order[tokens : 2 * tokens].astype(np.int64)
    before = cache.copy()
    hnd = Layout.of(cache, page=0, pieces=1, slot=2)
    assert hnd.pieces == heads and hnd.piece_stride == page * head_bytes
    ran = kvcopy.copy_rows_both_ways(
        (hnd, Layout.of(out, slot=0), GpuIndices(tokens, store.ctypes.data)),
        (Layout.of(back, slot=0), hnd, None, GpuIndices(tokens, load.ctypes.data)),
        stream=STREAM,
    )
    assert ran == ("staged", "staged")
    assert sum(c[0] == "memcpy" for c in fake.calls) == 4  # two chunks a side
    for t, s in enumerate(store):
        np.testing.assert_array_equal(out[t], before[s // page, :, s % page].ravel())
    want = before.copy()
    for t, s in enumerate(load):
        want[s // page, :, s % page] = back[t].reshape(heads, head_bytes)
    np.testing.assert_array_equal(cache, want)


def test_skipped_rows_keep_their_bytes_and_out_of_range_rows_are_reported(staged_rows):
    fake, make = staged_rows
    step = make(40, seed=3)
    step.store_slots[[0, 17, 39]] = -1
    step.store_slots[20] = PAGES * PAGE  # out of range, in the second chunk
    step.load_slots[[5, 33]] = -1
    step.load_slots[34] = 1 << 40
    assert step.run() == ("staged", "staged")
    np.testing.assert_array_equal(step.out, step.expected_out())
    for row in (0, 17, 20, 39):  # the host rows the store skipped are as they were
        np.testing.assert_array_equal(step.out[:, :, row], step.out_before[:, :, row])
    for cache, want in zip(step.caches, step.expected_caches()):
        np.testing.assert_array_equal(cache, want)
    assert sorted(fake.reported) == [20] * 4 + [34] * 4  # once per plane, the caller's row


@pytest.mark.parametrize("tokens", [1, 40])
def test_host_indices_are_staged_as_well_and_move_every_byte(staged_rows, tokens):
    fake, make = staged_rows
    step = make(tokens, seed=11 + tokens)
    step.store_slots[0] = -1  # skipped: its host row keeps its bytes
    assert step.run(on_host=True) == ("staged", "staged")
    assert kvcopy.last_decision().method == "staged"
    np.testing.assert_array_equal(step.out, step.expected_out())
    np.testing.assert_array_equal(step.out[:, :, 0], step.out_before[:, :, 0])
    for cache, want in zip(step.caches, step.expected_caches()):
        np.testing.assert_array_equal(cache, want)


def test_host_indices_are_uploaded_once_before_the_chunks_and_fenced_after_them(staged_rows):
    fake, make = staged_rows
    step = make(20)  # two chunks a side
    step.run(on_host=True)
    slot = fake.slot_memory.ctypes.data
    uploads = [c for c in fake.calls if c[0] == "upload"]
    assert uploads == [("upload", slot, 2 * 8 * 20, STREAM)]  # both sides' slots at once
    np.testing.assert_array_equal(
        fake.slot_memory[:320].view(np.int64), np.concatenate([step.store_slots, step.load_slots])
    )
    first_wait = next(i for i, c in enumerate(fake.calls) if c[0] == "wait")
    assert fake.calls.index(uploads[0]) < first_wait  # before any side stream forks
    assert fake.calls[-1] == ("record", 0x77, STREAM)  # the slot fenced after the joins
    assert all(c[0] == "wait" and c[1] == STREAM for c in fake.calls[-4:-1])


def test_host_indices_out_of_range_are_refused_before_anything_is_issued(staged_rows):
    fake, make = staged_rows
    step = make(20)
    step.load_slots[7] = PAGES * PAGE
    with pytest.raises(ValueError, match="load"):
        step.run(on_host=True)
    assert fake.calls == []
    step.load_slots[7] = 0
    assert step.run(on_host=True) == ("staged", "staged")  # and the library stays usable


def test_host_indices_that_cross_are_refused_before_anything_is_issued(staged_rows):
    fake, make = staged_rows
    step = make(20)
    step.load_slots[3] = step.store_slots[5]  # the load writes a slot the store reads
    with pytest.raises(ValueError, match="store.*load|load.*store"):
        step.run(on_host=True)
    assert fake.calls == []


def test_chunks_alternate_buffers_and_streams_in_the_order_each_direction_needs(staged_rows):
    fake, make = staged_rows
    step = make(20)  # two chunks a side: 16 rows, then 4
    step.run()
    calls = [c for c in fake.calls if c[0] != "launch" or c[1] in (STREAM, SIDE + 1)]
    store_copy, load_copy, load_kernel = SIDE, SIDE + 2, SIDE + 1
    waits = {("wait", s, STREAM) for s in (store_copy, load_copy, load_kernel)}
    assert set(calls[:3]) == waits  # every side stream starts after the caller
    issued = [c[:3] if c[0] != "memcpy" else c[:2] for c in calls[3:-3]]
    assert issued == [
        # store chunk 0: buffer 0; the rows the gather skips first, then the gather
        ("wait event", STREAM, 101),
        ("launch", STREAM, 0),
        ("launch", STREAM, 0),
        ("record", 201, STREAM),
        ("wait event", store_copy, 201),
        ("memcpy", store_copy),
        ("record", 101, store_copy),
        # load chunk 0: buffer 2; copied in, then scattered
        ("wait event", load_copy, 103),
        ("memcpy", load_copy),
        ("record", 203, load_copy),
        ("wait event", load_kernel, 203),
        ("launch", load_kernel, 0),
        ("record", 103, load_kernel),
        # chunk 1 of each: the other buffer, rows from 16
        ("wait event", STREAM, 102),
        ("launch", STREAM, 16),
        ("launch", STREAM, 16),
        ("record", 202, STREAM),
        ("wait event", store_copy, 202),
        ("memcpy", store_copy),
        ("record", 102, store_copy),
        ("wait event", load_copy, 104),
        ("memcpy", load_copy),
        ("record", 204, load_copy),
        ("wait event", load_kernel, 204),
        ("launch", load_kernel, 16),
        ("record", 104, load_kernel),
    ]
    assert set(calls[-3:]) == {("wait", STREAM, s) for s in (store_copy, load_copy, load_kernel)}
    fills = [c for c in fake.calls if c[0] == "launch" and c[1] == STREAM]
    assert [c[4] for c in fills] == [True, False, True, False]  # fill, gather per chunk
    spans = [c for c in fake.calls if c[0] == "memcpy" and c[1] == store_copy]
    assert spans[1][4] == (4 * ROW,) * 4  # 4 rows in each of 4 planes


class SameLayouts:
    """A step's pair called again and again with the same layouts and index arrays, the
    slots refilled in place between calls (a serving step's pattern)."""

    def __init__(self, step: Step, on_host: bool = False) -> None:
        self.step = step
        paged = Layout.of(step.caches, planes=(0,), page=1, slot=2)
        given = (lambda a: a) if on_host else (lambda a: GpuIndices(len(a), a.ctypes.data))
        self.store = (paged, Layout.of(step.out, planes=(1, 0), slot=2), given(step.store_slots))
        self.load = (Layout.of(step.back, planes=(1, 0), slot=2), paged, None, given(step.load_slots))

    def __call__(self, seed: int) -> tuple[str, str]:
        step = self.step
        order = np.random.default_rng(seed).permutation(PAGES * PAGE)
        step.store_slots[:] = order[: len(step.store_slots)]
        step.load_slots[:] = order[len(step.store_slots) : 2 * len(step.store_slots)]
        step.before, step.out_before = [c.copy() for c in step.caches], step.out.copy()
        return kvcopy.copy_rows_both_ways(self.store, self.load, stream=STREAM)

    def check(self) -> None:
        np.testing.assert_array_equal(self.step.out, self.step.expected_out())
        for cache, want in zip(self.step.caches, self.step.expected_caches()):
            np.testing.assert_array_equal(cache, want)


def test_the_same_staged_call_again_repeats_its_chunks_without_planning(staged_rows):
    fake, make = staged_rows
    again = SameLayouts(make(20))
    assert again(1) == ("staged", "staged")
    first, classified = list(fake.calls), fake.classified
    for seed in (2, 3):
        fake.calls.clear()
        assert again(seed) == ("staged", "staged")
        assert fake.classified == classified  # not classified (nor planned) again
        assert fake.calls == first  # the same work, in the same order
        assert kvcopy.last_decision().method == "staged"
        again.check()  # the refilled slots' rows moved


def test_a_repeated_staged_call_notes_both_sides_traffic_as_the_first_did(staged_rows):
    """The pair's store (GPU to host) and load (host to GPU) are noted again at each
    repeat: a batch the other way on another stream sees them."""
    fake, make = staged_rows
    again = SameLayouts(make(20))
    now = [100.0]
    other = STREAM + 1
    with testing.fake_clock(lambda: now[0]):
        assert again(1) == ("staged", "staged")
        now[0] = 200.0
        assert not engine.traffic_window.other_way_recent(0, "h2d", 1.0, other, 1)
        classified = fake.classified
        assert again(2) == ("staged", "staged")
        assert fake.classified == classified  # a repeat, not a call planned afresh
        assert engine.traffic_window.other_way_recent(0, "h2d", 1.0, other, 1)
        assert engine.traffic_window.other_way_recent(0, "d2h", 1.0, other, 1)


@pytest.mark.parametrize("change", ["setting", "buffers", "context", "capture", "indices"])
def test_a_staged_call_that_cannot_repeat_is_planned_afresh(staged_rows, monkeypatch, change):
    fake, make = staged_rows
    again = SameLayouts(make(20))
    assert again(1) == ("staged", "staged")
    classified = fake.classified
    if change == "setting":
        monkeypatch.setattr(policy, "STAGING_CTAS", policy.STAGING_CTAS * 2)
    elif change == "buffers":  # the staging buffers made again
        fake.staging.base += 1
    elif change == "context":  # a reset made another context
        fake.context_key += 1
    elif change == "capture":
        fake.capturing = 1
    else:  # an index tensor elsewhere
        moved = again.step.load_slots.copy()
        again.step.load_slots = moved
        again.load = again.load[:3] + (GpuIndices(len(moved), moved.ctypes.data),)
    ran = again(2)
    assert fake.classified > classified  # planned (and checked) again
    assert ran == (("kernel", "kernel") if change == "capture" else ("staged", "staged"))
    again.check()


def test_the_same_staged_call_with_host_indices_again_uploads_them_and_repeats_its_chunks(staged_rows):
    fake, make = staged_rows
    again = SameLayouts(make(20), on_host=True)
    assert again(1) == ("staged", "staged")
    first, classified = list(fake.calls), fake.classified
    slots = [slot.host for slot in fake.slots]
    for k, seed in enumerate((2, 3, 4)):
        fake.calls.clear()
        assert again(seed) == ("staged", "staged")
        assert fake.classified == classified  # not classified (nor built) again
        slot = slots[(k + 1) % 2]  # each call its own slot, in turn
        event = 0x77 if slot == slots[0] else 0x78
        assert fake.calls[:3] == [
            ("upload", slot, 2 * 8 * 20, STREAM),
            ("set indices", slot),
            ("set indices", slot + 8 * 20),
        ]
        # then the first call's work, in its order, fenced by this call's slot
        assert fake.calls[3:-1] == first[1:-1]
        assert fake.calls[-1] == ("record", event, STREAM)
        np.testing.assert_array_equal(
            fake.slot_memory[slot - slots[0] :][:320].view(np.int64),
            np.concatenate([again.step.store_slots, again.step.load_slots]),
        )
        again.check()  # the new slots' rows moved


def test_host_indices_of_a_repeated_staged_call_are_checked_as_at_first(staged_rows):
    fake, make = staged_rows
    again = SameLayouts(make(20), on_host=True)
    assert again(1) == ("staged", "staged")
    step, classified = again.step, fake.classified
    kept_out, kept_caches = step.out.copy(), [c.copy() for c in step.caches]
    cases = [
        ("load", 7, PAGES * PAGE, r"load: dst_indices\[7\] = 128 is out of range"),
        ("load", 9, None, r"load: dst_indices: rows 2 and 9 both write slot"),
        ("store", 4, PAGES * PAGE + 5, r"store: src_indices\[4\] = 133 is out of range"),
        ("cross", 5, None, r"load: row 5 writes slot \d+ of its dst, which store: row 0 reads"),
    ]
    for side, row, value, message in cases:
        order = np.random.default_rng(row).permutation(PAGES * PAGE)
        step.store_slots[:], step.load_slots[:] = order[:20], order[20:40]
        if side == "load" and value is None:
            step.load_slots[row] = step.load_slots[2]
        elif side == "cross":
            step.load_slots[row] = step.store_slots[0]
        else:
            (step.load_slots if side == "load" else step.store_slots)[row] = value
        fake.calls.clear()
        with pytest.raises(ValueError, match=message):
            kvcopy.copy_rows_both_ways(again.store, again.load, stream=STREAM)
        assert fake.calls == []  # refused before anything is issued
        np.testing.assert_array_equal(step.out, kept_out)
        for cache, kept in zip(step.caches, kept_caches):
            np.testing.assert_array_equal(cache, kept)
    assert again(5) == ("staged", "staged")  # and the same call repeats after
    assert fake.classified == classified
    again.check()


def test_a_host_index_repeat_whose_buffers_were_remade_fences_its_upload_and_plans_afresh(staged_rows):
    fake, make = staged_rows
    again = SameLayouts(make(20), on_host=True)
    assert again(1) == ("staged", "staged")
    classified = fake.classified
    fake.staging.base += 1  # the staging buffers made again
    fake.calls.clear()
    assert again(2) == ("staged", "staged")
    assert fake.classified > classified  # planned afresh
    slots = [slot.host for slot in fake.slots]
    # the repeat's upload (slot 1) fenced before the fresh plan's own (slot 0)
    assert fake.calls[:2] == [("upload", slots[1], 2 * 8 * 20, STREAM), ("record", 0x78, STREAM)]
    assert fake.calls[2] == ("upload", slots[0], 2 * 8 * 20, STREAM)
    assert not any(c[0] == "set indices" for c in fake.calls)
    again.check()


@pytest.mark.parametrize("repeated", [False, True])
def test_host_indices_uploaded_for_a_pair_that_fails_midway_are_fenced_still(staged_rows, repeated):
    """The upload is queued before the chunks: where issuing a chunk fails, the slot is
    still fenced behind it, so that no later reservation rewrites the indices it reads."""
    fake, make = staged_rows
    again = SameLayouts(make(20), on_host=True)
    if repeated:
        assert again(1) == ("staged", "staged")
    fake.calls.clear()

    def fail(*args):
        raise kvcopy.CudaError(700, "CUDA_ERROR_ILLEGAL_ADDRESS", "illegal address")

    fake.memcpy_loop = fail
    with pytest.raises(kvcopy.CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        again(2)
    upload = fake.calls[0]
    slot = next(slot for slot in fake.slots if slot.host == upload[1])
    assert upload == ("upload", slot.host, 2 * 8 * 20, STREAM)
    assert fake.calls[-1] == ("record", slot.event, STREAM)


def test_a_staged_call_with_host_indices_of_another_length_is_planned_afresh(staged_rows):
    fake, make = staged_rows
    step = make(20)
    again = SameLayouts(step, on_host=True)
    assert again(1) == ("staged", "staged")
    classified = fake.classified
    step.store_slots, step.load_slots = step.store_slots[:12].copy(), step.load_slots[:12].copy()
    again.store = again.store[:2] + (step.store_slots,)
    again.load = again.load[:3] + (step.load_slots,)
    step.out_before, step.before = step.out.copy(), [c.copy() for c in step.caches]
    assert kvcopy.copy_rows_both_ways(again.store, again.load, stream=STREAM) == ("staged", "staged")
    assert fake.classified > classified  # planned afresh
    again.check()


@pytest.mark.parametrize("method", ["kernel", "batch"])
def test_an_explicit_method_is_not_staged(staged_rows, method):
    fake, make = staged_rows
    step = make(16)
    assert step.run(method) == ("kernel", "kernel")
    assert not any(c[0] == "memcpy" for c in fake.calls)


def test_below_the_threshold_each_side_is_a_layout_kernel_launch(staged_rows, monkeypatch):
    fake, make = staged_rows
    step = make(16)
    monkeypatch.setattr(policy, "ROWS_STAGING_MIN_BYTES", 16 * 4 * ROW + 1)
    assert step.run() == ("kernel", "kernel")
    assert not any(c[0] == "memcpy" for c in fake.calls)


def test_under_capture_each_side_is_a_layout_kernel_launch(staged_rows):
    fake, make = staged_rows
    fake.capturing = 1
    step = make(16)
    assert step.run() == ("kernel", "kernel")
    assert not any(c[0] in ("memcpy", "wait event") for c in fake.calls)


def test_without_room_for_the_buffers_each_side_is_a_layout_kernel_launch(staged_rows):
    fake, make = staged_rows
    fake.staging.ensure = lambda chunk_bytes: False
    step = make(16)
    assert step.run() == ("kernel", "kernel")


# ---- the planner (kvcopy._plans.rows_staging: pure)

BASE = 1 << 30


@pytest.mark.parametrize(
    "kw, back_to_back",
    [
        (dict(slots=8, row_bytes=64), True),
        (dict(slots=8, row_bytes=64, slot_stride=128), False),
        (dict(slots=8, row_bytes=64, page_size=4), True),
        (dict(slots=8, row_bytes=64, page_size=4, page_stride=512), False),
        (dict(slots=8, row_bytes=64, pieces=2), True),
        (dict(slots=8, row_bytes=64, pieces=2, piece_stride=64, slot_stride=128), False),
        (dict(slots=1, row_bytes=64, page_stride=4096), True),
    ],
)
def test_rows_back_to_back_is_where_every_row_follows_the_last(kw, back_to_back):
    layout = Layout.from_pointers([BASE, BASE + 8192], **kw)
    assert rows_back_to_back(layout) == back_to_back
    if back_to_back:  # then row r of each plane lies at base + r * row_bytes
        rows = np.arange(layout.slots)
        np.testing.assert_array_equal(
            layout.row_addresses(rows)[1], BASE + 8192 + rows.astype(np.uint64) * 64
        )


def _plan(host_planes: int = 2, host_kw: dict | None = None, gpu_indices="gpu", host_indices=None):
    host = Layout.from_pointers(
        [BASE + p * (1 << 20) for p in range(host_planes)], slots=100, row_bytes=256, **(host_kw or {})
    )
    gpu = Layout.from_pointers(
        [BASE * 4 + p * (1 << 20) for p in range(host_planes)], slots=400, row_bytes=256, page_size=16
    )
    indices = {"gpu": GpuIndices(100), "host": np.arange(100), None: None}[gpu_indices]
    return kvcopy.testing.plans.plan_rows(host, gpu, host_indices, indices, 100)


@pytest.mark.parametrize(
    "plan_kw, why",
    [
        (dict(), None),
        (dict(host_indices=np.arange(100)), "the host side has indices"),
        (dict(gpu_indices="host"), None),
        (dict(gpu_indices=None), "the GPU side has no indices"),
        (dict(host_kw=dict(slot_stride=512)), "the host side's rows are not back to back"),
        (dict(host_planes=9), "the host side has 9 planes (at most 8 are staged)"),
    ],
)
def test_why_not_staged_names_what_keeps_a_side_off_the_staging_buffers(plan_kw, why):
    if plan_kw.get("host_indices") is not None:
        plan_kw["gpu_indices"] = "host"  # (both sides' indices on one side of the bus)
    assert why_not_staged(_plan(**plan_kw), True, policy.ROWS_STAGING_MAX_PLANES) == why


def test_chunks_cover_every_row_once_each_plane_one_span():
    plan = _plan(host_planes=3)
    per = chunk_rows(plan, 8192)  # 8192 // (3 planes x 256 B) = 10 rows
    chunks = StagedChunks(plan, True, 8192, (0xA000, 0xB000))
    assert per == 10 and chunks.first_rows.tolist() == list(range(0, 100, 10))
    last = len(chunks) - 1
    assert chunks.row_counts[last] == 10 and chunks.nbytes[last].tolist() == [10 * 256] * 3
    assert chunks.host[last].tolist() == [BASE + p * (1 << 20) + 90 * 256 for p in range(3)]
    assert chunks.staged[last].tolist() == [0xB000 + p * 10 * 256 for p in range(3)]
    # row r of plane p sits at staging_bases[k, p] + r * row_bytes (modulo 2**64)
    for k in range(len(chunks)):
        for p in range(3):
            assert (int(chunks.staging_bases[k, p]) + int(chunks.first_rows[k]) * 256) % (1 << 64) == int(
                chunks.staged[k, p]
            )
    for name in ("host", "staged", "nbytes", "staging_bases"):  # (as the C side reads them)
        array = getattr(chunks, name)
        assert array.dtype == np.uint64 and array.shape == (10, 3) and array.flags.c_contiguous


def test_the_last_chunk_takes_the_rest():
    plan = _plan(host_planes=1)
    chunks = StagedChunks(plan, False, 256 * 30, (0xA000, 0xB000))  # 30, 30, 30, 10 rows
    assert len(chunks) == 4
    assert list(zip(chunks.first_rows.tolist(), chunks.row_counts.tolist())) == [
        (0, 30),
        (30, 30),
        (60, 30),
        (90, 10),
    ]
    assert chunks.staged[:, 0].tolist() == [0xA000, 0xB000, 0xA000, 0xB000]
    assert int(chunks.nbytes[3, 0]) == 10 * 256


def test_a_chunk_too_small_for_one_row_is_refused():
    with pytest.raises(ValueError, match="holds no row of 2 planes x 256 bytes"):
        chunk_rows(_plan(), 511)


# ---- the policy (pure)

WHY_NOT = (None, None)


@pytest.mark.parametrize(
    "args, staged",
    [
        ((("d2h", "h2d"), (8 << 20, 8 << 20), WHY_NOT, 4 << 20, False, "auto"), True),
        ((("h2d", "d2h"), (8 << 20, 64 << 20), WHY_NOT, 4 << 20, False, "auto"), True),
        ((("d2h", "h2d"), (8 << 20, (8 << 20) - 1), WHY_NOT, 4 << 20, False, "auto"), False),
        ((("d2h", "d2h"), (8 << 20, 8 << 20), WHY_NOT, 4 << 20, False, "auto"), False),
        (
            (("d2h", "h2d"), (8 << 20, 8 << 20), ("the host side has indices", None), 4 << 20, False, "auto"),
            False,
        ),
        ((("d2h", "h2d"), (8 << 20, 8 << 20), WHY_NOT, 0, False, "auto"), False),
        ((("d2h", "h2d"), (8 << 20, 8 << 20), WHY_NOT, 4 << 20, True, "auto"), False),
        ((("d2h", "h2d"), (8 << 20, 8 << 20), WHY_NOT, 4 << 20, False, "kernel"), False),
    ],
)
def test_rows_staging_is_chosen_only_for_a_large_stageable_pair_outside_capture(args, staged):
    decision = policy.choose_rows_staging(*args, min_bytes=8 << 20)
    assert (decision is not None) == staged
    if staged:
        assert decision.method == "staged" and "8 MiB" in decision.reason


def test_the_default_threshold_is_the_policys():
    pair = (("d2h", "h2d"), (policy.ROWS_STAGING_MIN_BYTES,) * 2, WHY_NOT, 4 << 20, False)
    assert policy.choose_rows_staging(*pair) is not None
    smaller = (pair[0], (policy.ROWS_STAGING_MIN_BYTES - 1,) * 2) + pair[2:]
    assert policy.choose_rows_staging(*smaller) is None


def _staged_rows_side(planes: int = 2, count: int = 3, threads: int = 512, **changed):
    """A real StagedRowsSide, the C side of a staged layout side (nothing is issued, so no
    driver is needed)."""
    side = (0, 1 << 20, 1, 64, 64, 64)
    chunk = np.zeros((count, planes), np.uint64)
    args = dict(
        function=0,
        load=True,
        staging_side=side,
        gpu_side=side,
        host_side=side,
        gpu_bases=np.zeros(planes, np.uint64),
        host_bases=np.zeros(planes, np.uint64),
        only_skipped_by=(0, 0),
        pieces=1,
        piece_bytes=64,
        max_ctas=4,
        threads=threads,
        copy_stream=0,
        kernel_stream=0,
        first_rows=np.zeros(count, np.uint64),
        row_counts=np.ones(count, np.uint64),
        host=chunk,
        staged=chunk.copy(),
        nbytes=chunk.copy(),
        staging_bases=chunk.copy(),
    )
    args.update(changed)
    return cuda.rows.StagedRowsSide(*args.values())


def test_the_c_side_counts_its_chunks_and_refuses_a_chunk_it_does_not_have():
    side = _staged_rows_side(count=3)
    assert len(side) == 3
    for k in (-1, 3):
        with pytest.raises(IndexError):
            side.issue(k, 0, 0)


@pytest.mark.parametrize("planes", [0, 129])
def test_the_c_side_takes_one_launch_of_planes(planes):
    with pytest.raises(ValueError, match="planes"):
        _staged_rows_side(planes=planes)


def test_the_c_side_refuses_chunk_arrays_of_other_shapes():
    with pytest.raises(ValueError, match="differ in shape"):
        _staged_rows_side(nbytes=np.zeros((3, 1), np.uint64))
    with pytest.raises(ValueError, match="differ in shape"):
        _staged_rows_side(row_counts=np.ones(2, np.uint64))
    with pytest.raises(ValueError, match="as many on each side"):
        _staged_rows_side(host_bases=np.zeros(1, np.uint64))


@pytest.mark.parametrize("threads", [0, 48])
def test_the_c_side_refuses_a_cta_that_is_not_whole_warps(threads):
    with pytest.raises(ValueError, match="multiple of 32"):
        _staged_rows_side(threads=threads)
