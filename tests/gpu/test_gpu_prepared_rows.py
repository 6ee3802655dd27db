"""kvcopy.prepare_rows on a real GPU: a transfer built once and called step after
step with its index tensor refilled in place moves each step's rows, in both
directions, across many planes, on the stream it was prepared for, and captured."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import Layout
from helpers.layouts import gathered, paged, rand, replay_with_new_indices
from helpers.gpu import ordered_stream


def test_each_call_gathers_the_rows_its_indices_hold_then(torch_cuda):
    torch = torch_cuda
    caches = paged(torch, 3, 16, 16, 2048, 21)
    chunk = torch.zeros((2, 3, 40, 2048), dtype=torch.uint8).pin_memory()
    slots = torch.zeros(40, dtype=torch.int64, device="cuda")
    stream = ordered_stream(torch)
    prepared = kvcopy.prepare_rows(
        Layout.of(caches, planes=(0,), page=1, slot=2),
        Layout.of(chunk, planes=(1, 0), slot=2),
        slots,
        stream=stream,
    )
    assert prepared.stream == stream.cuda_stream and prepared.rows == 40
    rng = np.random.default_rng(21)
    for step in range(5):
        want = rng.choice(256, 40, replace=False)
        want[step] = -1  # a skipped row keeps its zeros
        with torch.cuda.stream(stream):
            chunk.zero_()
            slots.copy_(torch.from_numpy(want), non_blocking=True)
        assert prepared() == "kernel"
        stream.synchronize()
        assert torch.equal(chunk, gathered(torch, caches, want)), step
    assert kvcopy.last_decision().method == "kernel"
    kvcopy.check_indices(stream)


def test_a_prepared_scatter_leaves_every_other_slot(torch_cuda):
    torch = torch_cuda
    caches = paged(torch, 2, 8, 16, 512, 22)
    before = [c.clone() for c in caches]
    chunk = rand(torch, (2, 2, 30, 512), 23, device="cpu", pinned=True)
    slots = torch.from_numpy(np.random.default_rng(22).choice(128, 30, replace=False)).cuda()
    prepared = kvcopy.prepare_rows(
        Layout.of(chunk, planes=(1, 0), slot=2), Layout.of(caches, planes=(0,), page=1, slot=2), None, slots
    )
    prepared()
    torch.cuda.synchronize()
    for layer, (cache, old) in enumerate(zip(caches, before)):
        want = old.reshape(2, 128, 512).clone()
        want[:, slots.cpu()] = chunk[:, layer].cuda()
        assert torch.equal(cache.reshape(2, 128, 512), want), layer


def test_prepared_runs_without_indices_over_many_planes(torch_cuda):
    torch = torch_cuda
    caches = paged(torch, 100, 4, 16, 128, 24)  # 200 planes: two launches
    chunk = torch.zeros((2, 100, 64, 128), dtype=torch.uint8, device="cuda")
    prepared = kvcopy.prepare_rows(
        Layout.of(caches, planes=(0,), page=1, slot=2), Layout.of(chunk, planes=(1, 0), slot=2), rows=64
    )
    prepared()
    torch.cuda.synchronize()
    assert torch.equal(chunk.cpu(), gathered(torch, caches, list(range(64))))


def test_a_captured_prepared_call_replays_with_new_indices(torch_cuda):
    torch = torch_cuda
    src = rand(torch, (512, 1152), 25)
    dst = torch.zeros((2, 256, 1152), dtype=torch.uint8).pin_memory()
    src_index = torch.zeros(32, dtype=torch.int64, device="cuda")
    dst_index = torch.zeros(32, dtype=torch.int64, device="cuda")
    stream = ordered_stream(torch)
    prepared = kvcopy.prepare_rows(
        Layout.of(src, slot=0).select([0, 0]),
        Layout.of(dst, planes=(0,), slot=1),
        src_index,
        dst_index,
        stream=stream,
    )
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        prepared()
    replay_with_new_indices(torch, graph, src, dst, src_index, dst_index, 30, 25, out_of_range_at=11)


def test_preparing_refuses_host_indices_and_pageable_memory(torch_cuda):
    torch = torch_cuda
    src = rand(torch, (16, 256), 26)
    pinned = torch.zeros((16, 256), dtype=torch.uint8).pin_memory()
    with pytest.raises(ValueError, match="prepare_rows: indices on the host"):
        kvcopy.prepare_rows(Layout.of(src, slot=0), Layout.of(pinned, slot=0), [1, 2])
    with pytest.raises(ValueError, match="prepare_rows: the layout kernel needs"):
        kvcopy.prepare_rows(Layout.of(src, slot=0), Layout.of(np.zeros((16, 256), np.uint8), slot=0), rows=4)
