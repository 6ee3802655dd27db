"""copy_rows_both_ways through GPU staging buffers on a real GPU
(kvcopy._engine.rows_staged): a store of token rows from paged caches into a pinned chunk
and a load of other rows back, indices on the GPU or the host, host rows back to back,
in chunks small enough that every transfer takes several. Every byte against torch oracles; skipped
rows keep their bytes on both sides, out-of-range ones are reported with the caller's
row; the work is ordered on the caller's stream. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import Layout, policy
from kvcopy.testing import engine
from helpers.layouts import paged, rand
from helpers.gpu import ordered_stream

CHUNK = 64 << 10  # a few rows per chunk: every transfer below takes several chunks


@pytest.fixture
def staged_small(monkeypatch):
    """Staging from any size, in CHUNK-byte chunks."""
    monkeypatch.setattr(policy, "ROWS_STAGING_MIN_BYTES", 1)
    saved = kvcopy.config.staging_bytes
    kvcopy.config.staging_bytes = CHUNK
    yield
    kvcopy.config.staging_bytes = saved


def _step(torch, layers, row, tokens, seed):
    caches = paged(torch, layers, 16, 16, row, seed)
    out = rand(torch, (2, layers, tokens, row), seed + 50, device="cpu", pinned=True)
    back = rand(torch, (2, layers, tokens, row), seed + 100, device="cpu", pinned=True)
    order = np.random.default_rng(seed).permutation(256)
    return caches, out, back, order[:tokens].copy(), order[tokens : 2 * tokens].copy()


def _expected_chunk(torch, caches, out_before, slots):
    """The chunk after a store by ``slots``: rows with a slot in range gathered, the
    others as they were."""
    want = out_before.clone()
    flat = [c.reshape(2, -1, c.shape[-1]).cpu() for c in caches]
    for t, s in enumerate(slots):
        if 0 <= s < flat[0].shape[1]:
            for layer, f in enumerate(flat):
                want[:, layer, t] = f[:, s]
    return want


def _expected_caches(torch, caches, back, slots):
    want = [c.clone().reshape(2, 256, -1) for c in caches]
    for t, s in enumerate(slots):
        if 0 <= s < 256:
            for layer, cache in enumerate(want):
                cache[:, s] = back[:, layer, t].cuda()
    return want


def _run(torch, caches, out, back, store_slots, load_slots, stream, indices_on="gpu"):
    """The pair, its slots as GPU tensors (read in place) or host arrays (uploaded)."""
    paged_layout = Layout.of(caches, planes=(0,), page=1, slot=2)
    given = (lambda a: torch.from_numpy(a).cuda()) if indices_on == "gpu" else np.array
    return kvcopy.copy_rows_both_ways(
        (paged_layout, Layout.of(out, planes=(1, 0), slot=2), given(store_slots)),
        (Layout.of(back, planes=(1, 0), slot=2), paged_layout, None, given(load_slots)),
        stream=stream,
    )


@pytest.mark.parametrize("indices_on", ["gpu", "host"])
@pytest.mark.parametrize("layers,row,tokens", [(1, 4096, 40), (2, 16384, 37), (3, 1152, 100)])
def test_staged_store_and_load_move_every_byte(torch_cuda, staged_small, layers, row, tokens, indices_on):
    torch = torch_cuda
    caches, out, back, store_slots, load_slots = _step(torch, layers, row, tokens, row + layers)
    store_slots[tokens // 2] = -1  # skipped: its host row keeps its bytes
    before, out_before = [c.clone() for c in caches], out.clone()
    stream = torch.cuda.Stream()
    ran = _run(torch, caches, out, back, store_slots, load_slots, stream, indices_on)
    stream.synchronize()
    assert ran == ("staged", "staged")
    assert kvcopy.last_decision().method == "staged"
    assert torch.equal(out, _expected_chunk(torch, before, out_before, store_slots))
    for layer, (cache, want) in enumerate(zip(caches, _expected_caches(torch, before, back, load_slots))):
        assert torch.equal(cache.reshape(2, 256, -1), want), layer


def test_skipped_and_out_of_range_rows_keep_their_bytes_and_are_reported(torch_cuda, staged_small):
    torch = torch_cuda
    caches, out, back, store_slots, load_slots = _step(torch, 2, 4096, 60, 7)
    store_slots[[3, 31]] = -1
    store_slots[45] = 999  # out of range: reported as row 45
    load_slots[[0, 50]] = -1
    load_slots[20] = 256  # out of range: reported as row 20
    before, out_before = [c.clone() for c in caches], out.clone()
    stream = torch.cuda.Stream()
    assert _run(torch, caches, out, back, store_slots, load_slots, stream) == ("staged", "staged")
    with pytest.raises(kvcopy.IndexOutOfRange) as info:
        kvcopy.check_indices(stream)
    assert info.value.skipped == 2 * 2 * 2  # two rows, each in 2 layers x K and V
    assert info.value.first_row == 20
    assert torch.equal(out, _expected_chunk(torch, before, out_before, store_slots))
    for layer, (cache, want) in enumerate(zip(caches, _expected_caches(torch, before, back, load_slots))):
        assert torch.equal(cache.reshape(2, 256, -1), want), layer


@pytest.mark.parametrize("indices_on", ["gpu", "host"])
def test_staged_work_is_ordered_on_the_callers_stream(torch_cuda, staged_small, indices_on):
    torch = torch_cuda
    caches, out, back, store_slots, load_slots = _step(torch, 1, 16384, 48, 11)
    stream = torch.cuda.Stream()
    fresh = rand(torch, tuple(back.shape), 99)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)
        back.copy_(fresh, non_blocking=True)  # the load must read the chunk written first
    before, out_before = [c.clone() for c in caches], out.clone()
    _run(torch, caches, out, back, store_slots, load_slots, stream, indices_on)
    with torch.cuda.stream(stream):
        after = out.to("cuda", non_blocking=True)  # queued after: sees the stored rows
    stream.synchronize()
    assert torch.equal(back, fresh.cpu())
    want = _expected_chunk(torch, before, out_before, store_slots)
    assert torch.equal(out, want) and torch.equal(after.cpu(), want)
    for cache, expected in zip(caches, _expected_caches(torch, before, back, load_slots)):
        assert torch.equal(cache.reshape(2, 256, -1), expected)


def test_host_indices_of_many_calls_in_flight_each_move_their_own_rows(torch_cuda, staged_small):
    """More staged calls queued behind a busy stream than the descriptor ring has slots,
    each with host indices of its own: no call's uploaded indices are overwritten by a
    later call's before its chunks have read them."""
    torch = torch_cuda
    calls = policy.RING_SLOTS + 3
    caches = paged(torch, 1, 16, 16, 4096, 21)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
    outs, backs, plans = [], [], []
    rng = np.random.default_rng(21)
    for j in range(calls):
        out = torch.zeros((2, 1, 24, 4096), dtype=torch.uint8).pin_memory()
        back = rand(torch, (2, 1, 24, 4096), 200 + j, device="cpu", pinned=True)
        order = rng.permutation(256)
        store_slots, load_slots = order[:24].copy(), order[24:48].copy()
        before = [c.clone() for c in caches]  # (queued on torch's stream: waits below)
        outs.append(out)
        backs.append(back)
        plans.append((before, store_slots, load_slots))
        stream.wait_stream(torch.cuda.current_stream())
        assert _run(torch, caches, out, back, store_slots, load_slots, stream, "host") == ("staged", "staged")
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for out, back, (before, store_slots, load_slots) in zip(outs, backs, plans):
        assert torch.equal(out, _expected_chunk(torch, before, torch.zeros_like(out), store_slots))
    final = _expected_caches(torch, plans[-1][0], backs[-1], plans[-1][2])
    for cache, want in zip(caches, final):
        assert torch.equal(cache.reshape(2, 256, -1), want)


def test_the_same_call_again_moves_the_refilled_indices_rows(torch_cuda, staged_small):
    """A serving step's pattern: the same layouts and index tensors, refilled in place;
    from the second call the staged pair is issued again without planning."""
    torch = torch_cuda
    caches, out, back, store_slots, load_slots = _step(torch, 2, 4096, 40, 31)
    paged_layout = Layout.of(caches, planes=(0,), page=1, slot=2)
    store_index = torch.from_numpy(store_slots).cuda()
    load_index = torch.from_numpy(load_slots).cuda()
    store = (paged_layout, Layout.of(out, planes=(1, 0), slot=2), store_index)
    load = (Layout.of(back, planes=(1, 0), slot=2), paged_layout, None, load_index)
    stream = ordered_stream(torch)
    rng = np.random.default_rng(31)
    for _ in range(5):
        order = rng.permutation(256)
        store_slots, load_slots = order[:40].copy(), order[40:80].copy()
        with torch.cuda.stream(stream):
            store_index.copy_(torch.from_numpy(store_slots), non_blocking=True)
            load_index.copy_(torch.from_numpy(load_slots), non_blocking=True)
            back.copy_(rand(torch, tuple(back.shape), int(order[0])), non_blocking=True)
        stream.synchronize()
        before, out_before = [c.clone() for c in caches], out.clone()
        assert kvcopy.copy_rows_both_ways(store, load, stream=stream) == ("staged", "staged")
        stream.synchronize()
        assert torch.equal(out, _expected_chunk(torch, before, out_before, store_slots))
        for cache, want in zip(caches, _expected_caches(torch, before, back, load_slots)):
            assert torch.equal(cache.reshape(2, 256, -1), want)


def test_the_same_call_with_host_indices_again_moves_each_calls_rows(torch_cuda, staged_small):
    """The same layouts called again and again with host indices of new values, more
    calls queued behind a busy stream than the descriptor ring has slots: the pair is
    built once, each call's indices are checked and uploaded to a slot of its own, and
    every call moves its own rows (the final caches hold every load, the chunk the last
    store)."""
    torch = torch_cuda
    caches, out, back, _, _ = _step(torch, 2, 4096, 24, 41)
    paged_layout = Layout.of(caches, planes=(0,), page=1, slot=2)
    out_layout, back_layout = (Layout.of(out, planes=(1, 0), slot=2), Layout.of(back, planes=(1, 0), slot=2))
    layouts = (paged_layout, out_layout, back_layout, paged_layout)
    built = []  # the pair remembered for these layouts after each call: one, the first's
    calls = policy.RING_SLOTS + 3
    rng = np.random.default_rng(41)
    orders = [rng.permutation(256) for _ in range(calls)]
    want = [c.clone() for c in caches]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
    for order in orders:
        store_slots, load_slots = order[:24].copy(), order[24:48].copy()
        want_out = _expected_chunk(torch, want, torch.zeros_like(out), store_slots)
        want = [w.reshape(c.shape) for w, c in zip(_expected_caches(torch, want, back, load_slots), caches)]
        assert kvcopy.copy_rows_both_ways(
            (paged_layout, out_layout, store_slots),
            (back_layout, paged_layout, None, load_slots),
            stream=stream,
        ) == ("staged", "staged")
        built.append(engine.rows_memo.entry(*layouts).repeat)
    stream.synchronize()
    assert all(pair is built[0] for pair in built)
    assert torch.equal(out, want_out)
    for cache, expected in zip(caches, want):
        assert torch.equal(cache, expected)
    # a bad index of a repeated call is refused, nothing issued; the next call repeats
    bad = orders[0][:24].copy()
    bad[3] = 256
    with pytest.raises(ValueError, match=r"store: src_indices\[3\] = 256 is out of range"):
        kvcopy.copy_rows_both_ways(
            (paged_layout, out_layout, bad),
            (back_layout, paged_layout, None, orders[0][24:48].copy()),
            stream=stream,
        )
    before = [c.clone() for c in caches]
    store_slots, load_slots = orders[1][:24].copy(), orders[1][24:48].copy()
    want_out = _expected_chunk(torch, before, out, store_slots)
    kvcopy.copy_rows_both_ways(
        (paged_layout, out_layout, store_slots), (back_layout, paged_layout, None, load_slots), stream=stream
    )
    built.append(engine.rows_memo.entry(*layouts).repeat)
    stream.synchronize()
    assert all(pair is built[0] for pair in built)
    assert torch.equal(out, want_out)
    for cache, expected in zip(caches, _expected_caches(torch, before, back, load_slots)):
        assert torch.equal(cache.reshape(2, 256, -1), expected)


def test_below_the_threshold_the_layout_kernel_runs(torch_cuda):
    torch = torch_cuda
    caches, out, back, store_slots, load_slots = _step(torch, 1, 4096, 40, 3)
    stream = torch.cuda.Stream()
    assert _run(torch, caches, out, back, store_slots, load_slots, stream) == ("kernel", "kernel")
    stream.synchronize()
