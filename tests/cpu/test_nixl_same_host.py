"""kvcopy.nixl.same_host on a CPU: what a shared layout carries and refuses, what opening
it maps and closing it gives back, and one transfer's protocol at both ends, with CUDA
IPC stood in for by host memory (helpers.host_ipc) and the rows copied on the host."""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading

import numpy as np
import pytest

from helpers.host_ipc import HostIpc
from helpers.nixl_peer import run_peers
from kvcopy import Layout, nixl, testing
from kvcopy.nixl import doorbell
from kvcopy.testing import engine

PLANES, SLOTS, ROW = 4, 32, 256
STREAM = 0x7F00_1234  # (a created stream's handle, as the driver would give)


@pytest.fixture
def fake():
    ipc = HostIpc()
    with testing.fake_cuda(ipc, ("driver", "ipc")):
        yield ipc
    ipc.release()


def _cache(fake: HostIpc, planes: int = PLANES) -> np.ndarray:
    return fake.allocate(planes * SLOTS * ROW).reshape(planes, SLOTS, ROW)


def _layout(cache: np.ndarray, **shape) -> Layout:
    shape = {"slots": cache.shape[1], "row_bytes": cache.shape[2], **shape}
    return Layout.from_pointers([cache[p].ctypes.data for p in range(cache.shape[0])], **shape)


def _from_another_process(shared: nixl.SharedLayout, **changes) -> nixl.SharedLayout:
    """``shared`` as the peer receives it: made by another process (and ``changes``)."""
    return dataclasses.replace(shared, pid=1, **changes)


def _lend(rows: nixl.SharedRows, *tags: str, **options) -> tuple[threading.Thread, list]:
    """lend_rows of each tag in turn on a thread of its own, as the lending process
    would: (the thread, what each lend gave: None or the exception it raised)."""
    outcomes: list = []

    def lend() -> None:
        for tag in tags:
            try:
                nixl.lend_rows(
                    rows, tag=tag, timeout=options.get("timeout", 30), stream=options.get("stream")
                )
                outcomes.append(None)
            except Exception as exc:  # noqa: BLE001 - the test reads it
                outcomes.append(exc)

    thread = threading.Thread(target=lend)
    thread.start()
    return thread, outcomes


def test_a_shared_layout_names_each_allocation_once_and_survives_pickling(fake):
    first, second = _cache(fake, 2), _cache(fake, 2)
    layout = Layout.from_pointers(
        [first[0].ctypes.data, first[1].ctypes.data + 64, second[1].ctypes.data],
        slots=SLOTS - 1,
        row_bytes=128,
        slot_stride=ROW,
    )
    with nixl.share_layout(layout) as shared:
        event, found = shared.event, shared.shared
        assert len(found.handles) == 2  # (two allocations under three planes)
        assert found.planes == ((0, 0), (0, SLOTS * ROW + 64), (1, SLOTS * ROW))
        assert found.geometry == (SLOTS - 1, 128, 1, ROW, ROW, 1, 128)
        assert found.pid == os.getpid() and found.bus_id == "0000:00:00.0"
        assert pickle.loads(pickle.dumps(found)) == found
    assert ("event_destroy", event) in fake.calls and shared.event == 0


@pytest.mark.parametrize("problem", ["host plane", "past its allocation", "not shareable", "not a layout"])
def test_share_layout_refuses_what_cuda_ipc_cannot_share_naming_the_plane(fake, problem):
    cache = _cache(fake)
    bases = [cache[p].ctypes.data for p in range(PLANES)]
    host = np.zeros(SLOTS * ROW, np.uint8)
    kind, planes, shape = ValueError, bases, {"slots": SLOTS, "row_bytes": ROW}
    if problem == "host plane":
        planes, message = bases[:1] + [host.ctypes.data], "plane 1 is not GPU memory"
    elif problem == "past its allocation":
        planes, message = [bases[-1] + 1], "plane 0's rows run past the end of its allocation (1 bytes)"
    elif problem == "not shareable":
        fake.refuse_handles = True
        message = "the driver will not share plane 0's allocation"
    with pytest.raises(kind if problem != "not a layout" else TypeError) as raised:
        nixl.share_layout(Layout.from_pointers(planes, **shape) if problem != "not a layout" else bases)
    assert (message if problem != "not a layout" else "layout must be a kvcopy.Layout") in str(raised.value)
    assert not any(call[0] == "event_record" for call in fake.calls)


def test_opening_maps_every_allocation_and_closing_gives_each_back(fake):
    first, second = _cache(fake, 1), _cache(fake, 1)
    layout = Layout.from_pointers([first[0].ctypes.data + 512, second[0].ctypes.data], slots=8, row_bytes=ROW)
    rows = nixl.share_layout(layout)  # (held: a dropped SharedRows takes its doorbell along)
    shared = rows.shared
    opened = nixl.open_layout(_from_another_process(shared))
    mapped = [call[1] for call in fake.calls if call[0] == "open_mem_handle"]
    assert len(mapped) == 2 and opened.event == 200 + int(shared.event.rstrip(b"\0").split()[1])
    assert opened.layout.bases.tolist() == [mapped[0] + 512, mapped[1]]
    assert (opened.layout.slots, opened.layout.row_bytes) == (8, ROW)
    # (the mapping is the other allocation: what was written there is read here)
    first[0, 2] = 7
    assert fake.segments[mapped[0]][1][2 * ROW] == 7
    event = opened.event
    opened.close()
    closed = [call[1] for call in fake.calls if call[0] == "close_mem_handle"]
    assert sorted(closed) == sorted(mapped) and ("event_destroy", event) in fake.calls
    assert opened.mapped == [] and opened.event == 0
    asked = len(fake.calls)
    opened.close()  # (a second close asks nothing)
    assert len(fake.calls) == asked


def test_an_opened_layouts_memory_is_held_until_it_is_closed_and_not_after(fake):
    # (held: what the driver says of the mapping is kept, so that each pull or push
    # does not ask about every plane again; closed: a later use is classified anew)
    _, _, opened = _opened_pair(fake)
    other = Layout.from_pointers([_cache(fake, 1)[0].ctypes.data], slots=SLOTS, row_bytes=ROW)
    engine.kept_memory.hold_layout(other)
    assert engine.kept_memory.held(opened.layout)
    assert engine.kept_memory.layout_store(other, opened.layout, "auto") is not None
    opened.close()
    assert not engine.kept_memory.held(opened.layout)
    assert engine.kept_memory.layout_store(other, opened.layout, "auto") is None


def test_open_layout_refuses_its_own_and_gives_back_what_it_mapped_when_one_fails(fake):
    cache = _cache(fake)
    shared = nixl.share_layout(_layout(cache)).shared
    with pytest.raises(ValueError, match="this process shared the layout"):
        nixl.open_layout(shared)
    with pytest.raises(TypeError, match="shared must be a kvcopy.nixl.SharedLayout"):
        nixl.open_layout(pickle.dumps(shared))
    planes = [cache[0].ctypes.data, _cache(fake, 1)[0].ctypes.data]
    theirs = _from_another_process(
        nixl.share_layout(Layout.from_pointers(planes, slots=SLOTS, row_bytes=ROW)).shared
    )
    fake.fail_open_after = 1
    with pytest.raises(RuntimeError, match="CUDA_ERROR_MAP_FAILED"):
        nixl.open_layout(theirs)
    opened = [call[1] for call in fake.calls if call[0] == "open_mem_handle"]
    assert [call[1] for call in fake.calls if call[0] == "close_mem_handle"] == opened
    with pytest.raises(ValueError, match="no device at PCI bus id 'elsewhere'"):
        nixl.open_layout(dataclasses.replace(theirs, bus_id="elsewhere"))


def _opened_pair(fake: HostIpc):
    """(the lender's cache, its SharedRows, the opening end's OpenedLayout over it)."""
    cache = _cache(fake)
    cache[:] = np.random.default_rng(3).integers(0, 256, cache.shape, dtype=np.uint8)
    rows = nixl.share_layout(_layout(cache))
    opened = nixl.open_layout(_from_another_process(rows.shared))
    return cache, rows, opened


def test_a_pull_waits_for_the_lend_orders_after_the_peers_event_and_returns_the_rows(fake):
    cache, rows, opened = _opened_pair(fake)
    here = np.zeros((PLANES, 8, ROW), np.uint8)
    src, dst = np.array([5, 0, 31, -1]), np.array([1, 2, 7, 3])
    thread, outcomes = _lend(rows, "t1", stream=STREAM)
    with testing.rows_on_host():
        nixl.pull_rows(opened, _layout(here), src, dst, tag="t1", stream=STREAM)
    thread.join()
    assert outcomes == [None]  # (the lender had its rows back)
    expected = np.zeros_like(here)
    expected[:, dst[:3]] = cache[:, src[:3]]
    assert np.array_equal(here, expected)
    order = [
        call[0]
        for call in fake.calls
        if call[0] in ("event_record", "stream_wait_event", "stream_synchronize")
    ]
    assert order == ["event_record", "stream_wait_event", "stream_synchronize"]
    assert ("event_record", rows.event, STREAM) in fake.calls
    assert ("stream_wait_event", STREAM, opened.event) in fake.calls


def test_a_push_writes_the_peers_rows_and_a_refused_copy_tells_the_lender_why(fake):
    cache, rows, opened = _opened_pair(fake)
    before = cache.copy()
    here = np.random.default_rng(4).integers(0, 256, (PLANES, 8, ROW), dtype=np.uint8)
    thread, outcomes = _lend(rows, "in", "bad", "after")
    with testing.rows_on_host():
        nixl.push_rows(_layout(here), opened, [0, 7], [30, 2], tag="in")
        with pytest.raises(ValueError, match=r"dst_indices\[1\] = 32 is out of range"):
            nixl.push_rows(_layout(here), opened, [1, 2], [4, SLOTS], tag="bad")
        nixl.push_rows(_layout(here), opened, [3], [9], tag="after")  # (both ends usable)
    thread.join()
    before[:, [30, 2, 9]] = here[:, [0, 7, 3]]
    assert np.array_equal(cache, before)  # (the refused push wrote nothing)
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], nixl.TransferFailed)
    assert "refused transfer 'bad': ValueError: dst_indices[1] = 32 is out of range" in str(outcomes[1])


def test_ends_that_disagree_on_the_tag_both_refuse_and_move_nothing(fake):
    _, rows, opened = _opened_pair(fake)
    here = np.zeros((PLANES, 8, ROW), np.uint8)
    thread, outcomes = _lend(rows, "mine", "next")
    with testing.rows_on_host():
        with pytest.raises(nixl.TransferFailed, match="the peer lent transfer 'mine', not 'theirs'"):
            nixl.pull_rows(opened, _layout(here), [0], [0], tag="theirs")
        assert not here.any() and not any(call[0] == "stream_wait_event" for call in fake.calls)
        nixl.pull_rows(opened, _layout(here), [0], [0], tag="next")
    thread.join()
    assert isinstance(outcomes[0], nixl.TransferFailed) and outcomes[1] is None
    assert "refused transfer 'mine': the peer asked for 'theirs'" in str(outcomes[0])


def test_a_lend_that_times_out_is_withdrawn_and_not_taken_after(fake):
    _, rows, opened = _opened_pair(fake)
    with pytest.raises(TimeoutError, match="transfer 'c' not returned after 0.01 s; the lend is withdrawn"):
        nixl.lend_rows(rows, tag="c", timeout=0.01)
    with pytest.raises(TimeoutError, match="pull_rows: transfer 'c' not lent within 0.05 s"):
        nixl.pull_rows(opened, opened.layout, [0], [1], tag="c", timeout=0.05)
    assert not any(call[0] == "stream_wait_event" for call in fake.calls)
    with pytest.raises(TypeError, match="tag must be a non-empty str"):
        nixl.lend_rows(rows, tag="")
    with pytest.raises(TypeError, match="pull_rows: opened must be an open"):
        nixl.pull_rows(rows, opened.layout, tag="c")
    rows.close()
    with pytest.raises(TypeError, match="rows must be an open kvcopy.nixl.SharedRows"):
        nixl.lend_rows(rows, tag="d")


def test_a_shared_layout_opens_once_and_its_doorbell_goes_with_it(fake):
    cache = _cache(fake)
    rows = nixl.share_layout(_layout(cache))
    bell = rows.shared.doorbell
    assert os.path.exists(bell) and os.stat(bell).st_mode & 0o777 == 0o600
    opened = nixl.open_layout(_from_another_process(rows.shared))
    assert not os.path.exists(bell)  # (unlinked by the peer that mapped it)
    with pytest.raises(ValueError, match="doorbell .* is gone: a shared layout is opened once"):
        nixl.open_layout(_from_another_process(rows.shared))
    event = 200 + int(rows.shared.event.rstrip(b"\0").split()[1])  # (as HostIpc opens it)
    assert ("event_destroy", event) in fake.calls  # (what the refused open took, given back)
    opened.close()
    rows.close()
    unopened = nixl.share_layout(_layout(cache))
    assert os.path.exists(unopened.shared.doorbell)
    unopened.close()
    assert not os.path.exists(unopened.shared.doorbell)  # (the sharer unlinks what no peer took)


def test_a_signal_is_one_word_of_sequence_state_and_tag(tmp_path):
    value = doorbell.word(2**32 + 5, doorbell.LENT, "layer7")
    assert doorbell.fields(value) == (5, doorbell.LENT, doorbell.digest("layer7"))
    bell = doorbell.Doorbell.create()
    try:
        bell.ring("lent", value, "layer7")
        assert bell.read("lent") == value and bell.lent_tag() == "layer7"
        assert bell.read("answer") == 0
        assert bell.wait("answer", lambda word: word != 0, 0.01) is None
    finally:
        bell.close()
    dropped = doorbell.Doorbell.create()
    path = dropped.path
    del dropped  # (dropped without close: its name goes with it)
    assert not os.path.exists(path)
    (tmp_path / "short").write_bytes(b"x" * 10)
    with pytest.raises(ValueError, match="is not a kvcopy doorbell"):
        doorbell.Doorbell.open(str(tmp_path / "short"))


def test_two_processes_pull_and_push_rows_by_the_same_host_leg(tmp_path):
    run_peers(tmp_path, "helpers.nixl_ipc_peer", "host_end", "lender")
    from helpers.nixl_ipc_peer import expected

    pulled, pushed = expected()
    assert np.array_equal(np.load(tmp_path / "pulled.npy"), pulled)
    assert np.array_equal(np.load(tmp_path / "pushed.npy"), pushed)
    assert (
        "refused transfer 'refused': ValueError: src_indices[1]" in (tmp_path / "lender-refused").read_text()
    )
