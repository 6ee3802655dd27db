"""kvcopy.nixl: descriptors from layouts checked against a NumPy oracle (each
descriptor run on the host as NIXL would run it), the memory to register, and a real
transfer between two processes over NIXL's UCX backend on the loopback device."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.nixl_peer import nixl_installed, run_peers
from kvcopy import Layout, nixl, testing


def _layout(cache: np.ndarray, **shape) -> Layout:
    return Layout.from_pointers([cache[p].ctypes.data for p in range(cache.shape[0])], **shape)


def _run(descs: nixl.Descriptors) -> None:
    """Each local descriptor into the remote one at its place (a WRITE), on the host."""
    assert descs.local.shape == descs.remote.shape
    columns = 5 if descs.strided else 3
    assert descs.local.shape[1] == columns and descs.local.dtype == np.uint64
    for ours, theirs in zip(descs.local.tolist(), descs.remote.tolist()):
        assert ours[1] == theirs[1]  # the same bytes at both ends
        count = ours[4] if descs.strided else 1
        assert count == (theirs[4] if descs.strided else 1)
        for k in range(count):
            step_ours = ours[3] if descs.strided else 0
            step_theirs = theirs[3] if descs.strided else 0
            ctypes.memmove(theirs[0] + k * step_theirs, ours[0] + k * step_ours, ours[1])


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_descriptors_move_exactly_the_rows_copy_rows_would(strided, seed):
    rng = np.random.default_rng(seed)
    planes, slots, row = int(rng.integers(1, 6)), 40, int(rng.choice([64, 96, 512]))
    src = rng.integers(0, 256, (planes, slots, row), dtype=np.uint8)
    dst = np.zeros((planes, slots, row), np.uint8)
    count = int(rng.integers(1, 30))
    ours = (
        rng.choice(slots, count, replace=False)
        if seed % 2
        else np.sort(rng.choice(slots, count, replace=False))
    )
    theirs = np.sort(rng.choice(slots, count, replace=False))
    ours[rng.random(count) < 0.1] = -1  # a negative index skips its row
    descs = nixl.descriptors(
        "WRITE",
        _layout(src, slots=slots, row_bytes=row),
        _layout(dst, slots=slots, row_bytes=row),
        ours,
        theirs,
        strided=strided,
    )
    _run(descs)
    expected = np.zeros_like(dst)
    live = ours >= 0
    expected[:, theirs[live]] = src[:, ours[live]]
    assert np.array_equal(dst, expected)
    assert descs.nbytes == int(live.sum()) * planes * row and descs.copies == int(live.sum()) * planes
    assert descs.expanded <= descs.copies


def test_a_read_pairs_the_remote_rows_into_the_local_ones():
    remote = np.random.default_rng(1).integers(0, 256, (3, 16, 128), dtype=np.uint8)
    local = np.zeros((3, 4, 128), np.uint8)
    descs = nixl.descriptors(
        "READ",
        _layout(local, slots=4, row_bytes=128),
        _layout(remote, slots=16, row_bytes=128),
        [0, 1, 2, 3],
        [9, 10, 11, 2],
    )
    # a READ's local column is where bytes land: run it from the remote side
    _run(nixl.Descriptors(descs.remote, descs.local, descs.copies, descs.nbytes, descs.strided))
    assert np.array_equal(local, remote[:, [9, 10, 11, 2]])
    assert descs.posted == 2 * 3  # rows 9-11 into 0-2 merge in each plane


def test_a_request_of_an_engines_size_posts_a_hundredth_of_its_blocks():
    # 80 layers x K/V of one cache tensor, 118 blocks of 2 KiB back to back at both ends
    planes, blocks, block = 160, 512, 2048
    src = np.zeros((planes, blocks, block), np.uint8)
    dst = np.zeros((planes, blocks, block), np.uint8)
    ours, theirs = np.arange(100, 218), np.arange(300, 418)
    a, b = _layout(src, slots=blocks, row_bytes=block), _layout(dst, slots=blocks, row_bytes=block)
    merged = nixl.descriptors("WRITE", a, b, ours, theirs)
    assert merged.copies == 18_880 and merged.posted == planes  # one run a plane
    strided = nixl.descriptors("WRITE", a, b, ours, theirs, strided=True)
    assert strided.posted == 1 and strided.expanded == planes  # one run, every plane
    # blocks scattered at random: one entry per block, across the planes
    rng = np.random.default_rng(0)
    scattered = nixl.descriptors(
        "WRITE", a, b, rng.permutation(blocks)[:118], rng.permutation(blocks)[:118], strided=True
    )
    assert scattered.copies == 18_880 and scattered.posted == 118 and scattered.expanded == 18_880


def test_regions_cover_every_plane_and_join_those_that_touch():
    cache = np.zeros((4, 8, 64), np.uint8)
    joined = nixl.regions(_layout(cache, slots=8, row_bytes=64), device=3)
    assert joined.tolist() == [[cache.ctypes.data, cache.nbytes, 3]]
    apart = [cache[0].ctypes.data, cache[2].ctypes.data]
    found = nixl.regions(Layout.from_pointers(apart, slots=4, row_bytes=64))
    assert found.tolist() == [[apart[0], 256, 0], [apart[1], 256, 0]]
    with pytest.raises(TypeError, match="regions: layout must be a kvcopy.Layout"):
        nixl.regions(cache)
    with pytest.raises(ValueError, match="regions: device must be at least 0"):
        nixl.regions(_layout(cache, slots=8, row_bytes=64), device=-1)


def test_bad_arguments_are_refused_as_copy_rows_refuses_them():
    cache = np.zeros((2, 8, 64), np.uint8)
    a = _layout(cache, slots=8, row_bytes=64)
    with pytest.raises(ValueError, match="operation must be 'WRITE' or 'READ', got 'PUT'"):
        nixl.descriptors("PUT", a, a, [0], [1])
    with pytest.raises(ValueError, match=r"dst_indices\[0\] = 8 is out of range"):
        nixl.descriptors("WRITE", a, a, [0], [8])
    with pytest.raises(ValueError, match="local_device must be at least 0"):
        nixl.descriptors("WRITE", a, a, [0], [1], local_device=-2)
    with pytest.raises(ValueError, match="src_indices has 2 rows and dst_indices 1"):
        nixl.descriptors("WRITE", a, a, [0, 1], [1])
    with pytest.raises(TypeError, match="descs must be kvcopy.nixl.Descriptors"):
        nixl.transfer(object(), "WRITE", [], "peer")


def test_importing_kvcopy_nixl_imports_neither_nixl_nor_torch():
    code = (
        "import sys, kvcopy, kvcopy.nixl; "
        "names = ('nixl', 'nixl_cu13', 'nixl_cu12', 'torch'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in names))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (pip install nixl-cu13)")
def test_two_processes_move_rows_over_nixl_with_kvcopys_descriptors(tmp_path):
    run_peers(tmp_path, "helpers.nixl_peer", "target", "initiator")
    from helpers.nixl_peer import expected_read, expected_written

    assert np.array_equal(np.load(tmp_path / "written.npy"), expected_written())
    assert np.array_equal(np.load(tmp_path / "read.npy"), expected_read())
    counts = json.loads((tmp_path / "counts.json").read_text())
    assert counts["merged"]["posted"] < counts["merged"]["copies"]
    assert counts["strided"]["posted"] < counts["strided"]["expanded"] <= counts["strided"]["copies"]


@pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (pip install nixl-cu13)")
def test_a_peer_that_went_away_fails_clearly_and_the_agent_works_after(tmp_path):
    run_peers(tmp_path, "helpers.nixl_peer", "leaving", "after_leaving")
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    assert outcome["transfer"].startswith(
        "TransferFailed: transfer: NIXL refused WRITE of 8192 bytes (8 descriptors) with 'target': "
    )
    assert "DISCONNECT" in outcome["transfer"]
    assert outcome["notification"] == "TimeoutError: wait_notification: no b'never' from 'target' after 0.3 s"
    assert outcome["loopback equal"] is True


@pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (pip install nixl-cu13)")
def test_packed_rows_cross_in_whole_chunks_sliced_between_tensor_parallel_degrees(tmp_path):
    run_peers(tmp_path, "helpers.nixl_peer", "packed_receiver", "packed_sender")
    from helpers.nixl_peer import CHUNK, PACKED, expected_packed

    assert np.array_equal(np.load(tmp_path / "packed.npy"), expected_packed())
    chunks = json.loads((tmp_path / "packed.json").read_text())["chunks"]
    assert chunks == -(-len(PACKED[0]) // CHUNK) > 2  # more chunks than slots: slots were freed and reused


def test_staging_and_packed_sends_refuse_careless_arguments():
    cache = np.zeros((2, 8, 64), np.uint8)
    layout = Layout.from_pointers([cache[p].ctypes.data for p in range(2)], slots=8, row_bytes=64)
    buffer = np.zeros(4096, np.uint8)
    with pytest.raises(ValueError, match="staging: memory must be 'DRAM' or 'VRAM', got 'GPU'"):
        nixl.Staging(buffer.ctypes.data, 2048, memory="GPU")
    with pytest.raises(ValueError, match="staging: slots must be at least 1"):
        nixl.Staging(buffer.ctypes.data, 2048, slots=0)
    with pytest.raises(ValueError, match="staging: address must be at least 1"):
        nixl.Staging(0, 2048)
    small = nixl.Staging(buffer.ctypes.data, 256, slots=2)
    # (no agent is asked anything: each refusal comes before the first call on it)
    with pytest.raises(ValueError, match=r"this end's staging: slots of 256 bytes hold no chunk of 4 rows"):
        nixl.send_packed(object(), layout, [0, 1, 2, 3], "peer", small, small, tag="t", chunk_rows=4)
    with pytest.raises(ValueError, match="src_indices: a packed send moves every row it names"):
        nixl.send_packed(object(), layout, [0, -1], "peer", small, small, tag="t", chunk_rows=1)
    with pytest.raises(TypeError, match="dst_indices must be a 1-D sequence of integer row indices"):
        nixl.receive_packed(object(), layout, [[0, 1]], "peer", small, tag="t", chunk_rows=1)
    with pytest.raises(ValueError, match="chunk_rows must be at least 1"):
        nixl.receive_packed(object(), layout, [0], "peer", small, tag="t", chunk_rows=0)
    assert small.slot(3) == buffer.ctypes.data + 256 and small.regions().tolist() == [
        [buffer.ctypes.data, 512, 0]
    ]


def test_transfer_refuses_a_bad_timeout_before_asking_nixl():
    cache = np.zeros((1, 4, 64), np.uint8)
    layout = Layout.from_pointers([cache.ctypes.data], slots=4, row_bytes=64)
    descs = nixl.descriptors("WRITE", layout, layout, [0], [1])
    for timeout in (0, -1.0, True, "5"):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            nixl.transfer(object(), "WRITE", descs, "peer", timeout=timeout)
    with pytest.raises(ValueError, match="operation must be 'WRITE' or 'READ'"):
        nixl.post(object(), "write", descs, "peer")


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_descriptors_of_paged_layouts_in_pieces_move_what_copy_rows_moves(strided, seed):
    """Pages of slots, rows in pieces, another order of planes at the destination: the
    descriptors run on the host must leave what copy_rows leaves (run on the host too)."""
    import kvcopy
    from kvcopy import testing

    rng = np.random.default_rng(seed)
    planes, pages, page, pieces, piece = 3, 6, 4, 2, 32
    src = rng.integers(0, 256, (planes, pages, pieces, page, piece), dtype=np.uint8)  # (HND-like)
    a = Layout.from_pointers(
        [src[p].ctypes.data for p in range(planes)],
        slots=pages * page,
        row_bytes=pieces * piece,
        page_size=page,
        page_stride=pieces * page * piece,
        slot_stride=piece,
        pieces=pieces,
        piece_stride=page * piece,
    )
    ours = rng.choice(pages * page, 10, replace=False)
    theirs = rng.choice(pages * page, 10, replace=False)
    dst, oracle = (np.zeros((planes, pages * page, pieces * piece), np.uint8) for _ in range(2))
    order = rng.permutation(planes)  # (the destination's planes in another order)
    b, oracle_layout = (
        Layout.from_pointers([d[p].ctypes.data for p in order], slots=pages * page, row_bytes=pieces * piece)
        for d in (dst, oracle)
    )
    _run(nixl.descriptors("WRITE", a, b, ours, theirs, strided=strided))
    with testing.rows_on_host():
        kvcopy.copy_rows(a, oracle_layout, ours, theirs)
    assert np.array_equal(dst, oracle) and oracle.any()


@settings(max_examples=120, deadline=None)
@given(
    planes=st.integers(1, 4),
    rows=st.lists(
        st.tuples(st.integers(-1, 23), st.integers(0, 23)), min_size=1, max_size=24, unique_by=lambda r: r[1]
    ),
    strided=st.booleans(),
    spaced=st.booleans(),
)
def test_any_rows_any_form_move_exactly_the_paired_bytes(planes, rows, strided, spaced):
    row, slots = 32, 24
    gap = 64 if spaced else row  # (rows spaced apart, or back to back)
    src = np.random.default_rng(len(rows)).integers(0, 256, (planes, slots, gap), dtype=np.uint8)
    dst = np.zeros((planes, slots, gap), np.uint8)
    a = Layout.from_pointers(
        [src[p].ctypes.data for p in range(planes)], slots=slots, row_bytes=row, slot_stride=gap
    )
    b = Layout.from_pointers(
        [dst[p].ctypes.data for p in range(planes)], slots=slots, row_bytes=row, slot_stride=gap
    )
    ours, theirs = (np.array(side) for side in zip(*rows))
    _run(nixl.descriptors("WRITE", a, b, ours, theirs, strided=strided))
    expected = np.zeros_like(dst)
    live = ours >= 0
    expected[:, theirs[live], :row] = src[:, ours[live], :row]
    assert np.array_equal(dst, expected)


def test_a_transfer_whose_rows_are_all_skipped_sends_only_its_notification():
    class Agent:
        def __init__(self) -> None:
            self.sent: list = []

        def send_notif(self, peer: str, message: bytes) -> None:
            self.sent.append((peer, message))

    cache = np.zeros((2, 4, 64), np.uint8)
    layout = Layout.from_pointers([cache[p].ctypes.data for p in range(2)], slots=4, row_bytes=64)
    agent = Agent()
    for strided in (False, True):
        descs = nixl.descriptors("WRITE", layout, layout, [-1, -1], [0, 1], strided=strided)
        assert descs.posted == 0 and descs.nbytes == 0
        nixl.transfer(agent, "WRITE", descs, b"peer", notification=b"done")
    assert agent.sent == [("peer", b"done"), ("peer", b"done")]


@pytest.mark.parametrize("slots, chunks", [(2, 5), (4, 3), (1, 1)])
def test_the_receiver_frees_only_the_slots_the_sender_writes_again(slots, chunks):
    """Free k is sent once chunk k's scatter has ended, and only for chunks the sender
    waits on (k < chunks - slots): a free it never takes would wait, unread, for the
    next transfer under the same tag."""
    planes, row, per_chunk = 2, 16, 3
    count = chunks * per_chunk - 1  # (the last chunk one row short)
    staging_memory = np.random.default_rng(0).integers(
        0, 256, slots * per_chunk * planes * row, dtype=np.uint8
    )
    cache = np.zeros((planes, 32, row), np.uint8)
    dst = Layout.from_pointers([cache[p].ctypes.data for p in range(planes)], slots=32, row_bytes=row)
    staging = nixl.Staging(staging_memory.ctypes.data, per_chunk * planes * row, slots)
    indices = np.arange(count)[::-1].copy()

    class Agent:
        """Every chunk has landed; the slot's bytes stay what the test put there."""

        def __init__(self) -> None:
            self.asked: list[bytes] = []
            self.sent: list[bytes] = []

        def check_remote_xfer_done(self, peer: str, message: bytes) -> bool:
            self.asked.append(message)
            return True

        def send_notif(self, peer: str, message: bytes) -> None:
            self.sent.append(message)

    agent = Agent()
    with testing.rows_on_host():
        got = nixl.receive_packed(agent, dst, indices, b"peer", staging, tag="t", chunk_rows=per_chunk)
    assert got == chunks
    assert agent.asked == [f"kvcopy/t/chunk/{k};".encode() for k in range(chunks)]
    assert agent.sent == [f"kvcopy/t/free/{k};".encode() for k in range(max(chunks - slots, 0))]
    # every row came from its chunk's slot, plane after plane
    for r, slot_row in enumerate(indices):
        k, i = divmod(r, per_chunk)
        rows_in_chunk = min(per_chunk, count - k * per_chunk)
        chunk = staging_memory[(k % slots) * per_chunk * planes * row :][: rows_in_chunk * planes * row]
        assert np.array_equal(cache[:, slot_row], chunk.reshape(planes, rows_in_chunk, row)[:, i])


def test_a_slot_is_one_layout_per_shape_made_once():
    staging = nixl.Staging(1 << 20, 4 * 3 * 64, slots=2)
    first = staging.rows(0, 4, 3, 64)
    assert staging.rows(2, 4, 3, 64) is first  # (chunk 2 goes through slot 0 again)
    assert staging.rows(1, 4, 3, 64).bases.tolist() == [staging.slot(1) + p * 4 * 64 for p in range(3)]
    assert staging.rows(0, 3, 3, 64) is not first and staging.rows(0, 3, 3, 64).slots == 3


def test_a_wait_looks_again_at_once_for_its_first_spin_then_sleeps_between_looks(monkeypatch):
    from kvcopy.nixl import transfers

    clock = [100.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock[0] += max(seconds, transfers.SPIN_S / 4)  # each look takes a quarter of the spin

    monkeypatch.setattr(transfers.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(transfers.time, "sleep", sleep)
    looks = iter([False] * 7 + [True])

    class Agent:
        def check_remote_xfer_done(self, name: str, message: bytes) -> bool:
            assert (name, message) == ("peer", b"chunk")
            return next(looks)

    transfers.wait_notification(Agent(), b"peer", b"chunk", timeout=1.0)
    # looks at 0, 1/4, 1/2 and 3/4 of the spin go again at once; later ones sleep
    assert slept == [0] * 4 + [transfers.POLL_S] * 3
