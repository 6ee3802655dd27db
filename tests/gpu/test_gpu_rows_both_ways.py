"""copy_rows_both_ways on a real GPU: a store of token rows from paged caches into a
pinned chunk and a load of other rows back, at once, with indices on the GPU and on
the host, on a created stream and under capture; every byte against torch oracles."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import Layout, policy
from helpers.layouts import gathered, paged, rand
from helpers.gpu import ordered_stream


def step(torch, row, seed):
    """Paged caches, a chunk to store into, a chunk to load from, disjoint slots."""
    caches = paged(torch, 3, 16, 16, row, seed)
    out = torch.zeros((2, 3, 40, row), dtype=torch.uint8).pin_memory()
    back = rand(torch, (2, 3, 40, row), seed + 100, device="cpu", pinned=True)
    order = np.random.default_rng(seed).permutation(256)
    return caches, out, back, order[:40].copy(), order[40:80].copy()


def expected_cache(torch, before, back, load_slots):
    want = [c.clone().reshape(2, 256, -1) for c in before]
    for layer, cache in enumerate(want):
        cache[:, torch.from_numpy(load_slots)] = back[:, layer].cuda()
    return want


@pytest.mark.parametrize("row", [4096, 16384, 65536])
@pytest.mark.parametrize("indices_on", ["gpu", "host"])
def test_a_store_and_a_load_at_once_move_every_byte(torch_cuda, row, indices_on):
    torch = torch_cuda
    caches, out, back, store_slots, load_slots = step(torch, row, row // 512)
    before = [c.clone() for c in caches]
    paged_layout = Layout.of(caches, planes=(0,), page=1, slot=2)
    as_given = (lambda a: torch.from_numpy(a).cuda()) if indices_on == "gpu" else (lambda a: a)
    stream = ordered_stream(torch)
    ran = kvcopy.copy_rows_both_ways(
        (paged_layout, Layout.of(out, planes=(1, 0), slot=2), as_given(store_slots)),
        (Layout.of(back, planes=(1, 0), slot=2), paged_layout, None, as_given(load_slots)),
        stream=stream,
    )
    stream.synchronize()
    # sides of 8 MiB or more go through the staging buffers, indices wherever they are
    side_bytes = out.numel()
    if side_bytes >= policy.ROWS_STAGING_MIN_BYTES:
        assert ran == ("staged", "staged")
    else:
        assert set(ran) <= {"kernel", "batch"}, ran
    assert torch.equal(out, gathered(torch, before, store_slots))
    for layer, (cache, want) in enumerate(zip(caches, expected_cache(torch, before, back, load_slots))):
        assert torch.equal(cache.reshape(2, 256, -1), want), layer


def test_a_captured_step_replays_with_new_indices(torch_cuda):
    torch = torch_cuda
    caches, out, back, store_slots, load_slots = step(torch, 2048, 3)
    paged_layout = Layout.of(caches, planes=(0,), page=1, slot=2)
    store_index = torch.from_numpy(store_slots).cuda()
    load_index = torch.from_numpy(load_slots).cuda()
    stream = ordered_stream(torch)
    kvcopy.prepare()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kvcopy.copy_rows_both_ways(
            (paged_layout, Layout.of(out, planes=(1, 0), slot=2), store_index),
            (Layout.of(back, planes=(1, 0), slot=2), paged_layout, None, load_index),
        )
    rng = np.random.default_rng(3)
    for _ in range(5):
        order = rng.permutation(256)
        store_index.copy_(torch.from_numpy(order[:40].copy()))
        load_index.copy_(torch.from_numpy(order[40:80].copy()))
        before = [c.clone() for c in caches]
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gathered(torch, before, order[:40]))
        for cache, want in zip(caches, expected_cache(torch, before, back, order[40:80])):
            assert torch.equal(cache.reshape(2, 256, -1), want)
