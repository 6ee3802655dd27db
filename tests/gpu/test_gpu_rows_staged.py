"""copy_rows_both_ways through GPU staging buffers on a real GPU
(kvcopy._engine.rows_staged): a store of token rows from paged caches into a pinned chunk
and a load of other rows back, GPU indices, host rows back to back, in chunks small
enough that every transfer takes several. Every byte against torch oracles; skipped
rows keep their bytes on both sides, out-of-range ones are reported with the caller's
row; the work is ordered on the caller's stream. Skipped without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import Layout, policy
from helpers.layouts import paged, rand

CHUNK = 64 << 10   # a few rows per chunk: every transfer below takes several chunks


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
    return caches, out, back, order[:tokens].copy(), order[tokens:2 * tokens].copy()


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


def _run(torch, caches, out, back, store_slots, load_slots, stream):
    paged_layout = Layout.of(caches, planes=(0,), page=1, slot=2)
    return kvcopy.copy_rows_both_ways(
        (paged_layout, Layout.of(out, planes=(1, 0), slot=2),
         torch.from_numpy(store_slots).cuda()),
        (Layout.of(back, planes=(1, 0), slot=2), paged_layout, None,
         torch.from_numpy(load_slots).cuda()),
        stream=stream)


@pytest.mark.parametrize("layers,row,tokens", [(1, 4096, 40), (2, 16384, 37), (3, 1152, 100)])
def test_staged_store_and_load_move_every_byte(torch_cuda, staged_small, layers, row, tokens):
    torch = torch_cuda
    caches, out, back, store_slots, load_slots = _step(torch, layers, row, tokens, row + layers)
    before, out_before = [c.clone() for c in caches], out.clone()
    stream = torch.cuda.Stream()
    ran = _run(torch, caches, out, back, store_slots, load_slots, stream)
    stream.synchronize()
    assert ran == ("staged", "staged")
    assert kvcopy.last_decision().method == "staged"
    assert torch.equal(out, _expected_chunk(torch, before, out_before, store_slots))
    for layer, (cache, want) in enumerate(zip(caches, _expected_caches(torch, before, back,
                                                                       load_slots))):
        assert torch.equal(cache.reshape(2, 256, -1), want), layer


def test_skipped_and_out_of_range_rows_keep_their_bytes_and_are_reported(torch_cuda,
                                                                        staged_small):
    torch = torch_cuda
    caches, out, back, store_slots, load_slots = _step(torch, 2, 4096, 60, 7)
    store_slots[[3, 31]] = -1
    store_slots[45] = 999          # out of range: reported as row 45
    load_slots[[0, 50]] = -1
    load_slots[20] = 256           # out of range: reported as row 20
    before, out_before = [c.clone() for c in caches], out.clone()
    stream = torch.cuda.Stream()
    assert _run(torch, caches, out, back, store_slots, load_slots, stream) == ("staged",
                                                                             "staged")
    with pytest.raises(kvcopy.IndexOutOfRange) as info:
        kvcopy.check_indices(stream)
    assert info.value.skipped == 2 * 2 * 2      # two rows, each in 2 layers x K and V
    assert info.value.first_row == 20
    assert torch.equal(out, _expected_chunk(torch, before, out_before, store_slots))
    for layer, (cache, want) in enumerate(zip(caches, _expected_caches(torch, before, back,
                                                                       load_slots))):
        assert torch.equal(cache.reshape(2, 256, -1), want), layer


def test_staged_work_is_ordered_on_the_callers_stream(torch_cuda, staged_small):
    torch = torch_cuda
    caches, out, back, store_slots, load_slots = _step(torch, 1, 16384, 48, 11)
    stream = torch.cuda.Stream()
    fresh = rand(torch, tuple(back.shape), 99)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)
        back.copy_(fresh, non_blocking=True)   # the load must read the chunk written first
    before, out_before = [c.clone() for c in caches], out.clone()
    _run(torch, caches, out, back, store_slots, load_slots, stream)
    with torch.cuda.stream(stream):
        after = out.to("cuda", non_blocking=True)   # queued after: sees the stored rows
    stream.synchronize()
    assert torch.equal(back, fresh.cpu())
    want = _expected_chunk(torch, before, out_before, store_slots)
    assert torch.equal(out, want) and torch.equal(after.cpu(), want)
    for cache, expected in zip(caches, _expected_caches(torch, before, back, load_slots)):
        assert torch.equal(cache.reshape(2, 256, -1), expected)


def test_below_the_threshold_the_layout_kernel_runs(torch_cuda):
    torch = torch_cuda
    caches, out, back, store_slots, load_slots = _step(torch, 1, 4096, 40, 3)
    stream = torch.cuda.Stream()
    assert _run(torch, caches, out, back, store_slots, load_slots, stream) == ("kernel",
                                                                             "kernel")
    stream.synchronize()
