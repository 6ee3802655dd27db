"""copy_rows on a real GPU: the layout kernel's bytes against oracles in torch, with
indices on the host and on the GPU, skipped and out-of-range rows, capture and
replay with indices updated in place, and the paths it falls back to."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import Layout
from helpers.layouts import gathered, paged, rand, replay_with_new_indices
from helpers.gpu import ordered_stream


@pytest.mark.parametrize("row", [2048, 1152, 512, 128, 100, 40960])
@pytest.mark.parametrize("indices_on", ["gpu", "host"])
def test_gather_paged_caches_into_a_pinned_chunk(torch_cuda, row, indices_on):
    torch = torch_cuda
    caches = paged(torch, 3, 16, 16, row, 1)
    rng = np.random.default_rng(row)
    slots = rng.choice(16 * 16, 40, replace=False).astype(np.int64)
    slots[[3, 17]] = -1
    chunk = torch.zeros((2, 3, 40, row), dtype=torch.uint8).pin_memory()
    index = torch.from_numpy(slots).cuda() if indices_on == "gpu" else slots
    method = kvcopy.copy_rows(
        Layout.of(caches, planes=(0,), page=1, slot=2), Layout.of(chunk, planes=(1, 0), slot=2), index
    )
    torch.cuda.synchronize()
    assert method in ("kernel", "batch")
    assert torch.equal(chunk, gathered(torch, caches, slots))
    kvcopy.check_indices()


@pytest.mark.parametrize("indices_on", ["gpu", "host"])
def test_scatter_a_chunk_into_paged_caches_leaves_other_slots(torch_cuda, indices_on):
    torch = torch_cuda
    caches = paged(torch, 4, 8, 16, 256, 2)
    before = [c.clone() for c in caches]
    chunk = rand(torch, (2, 4, 30, 256), 3, device="cpu", pinned=True)
    slots = np.random.default_rng(4).choice(128, 30, replace=False).astype(np.int64)
    slots[5] = -1
    index = torch.from_numpy(slots).cuda() if indices_on == "gpu" else slots
    assert (
        kvcopy.copy_rows(
            Layout.of(chunk, planes=(1, 0), slot=2),
            Layout.of(caches, planes=(0,), page=1, slot=2),
            None,
            index,
        )
        == "kernel"
    )
    torch.cuda.synchronize()
    for layer in range(4):
        want = before[layer].reshape(2, -1, 256).clone()
        for t, s in enumerate(slots):
            if s >= 0:
                want[:, s] = chunk[:, layer, t].cuda()
        assert torch.equal(caches[layer].reshape(2, -1, 256), want)


def test_repeated_calls_move_each_calls_indices(torch_cuda):
    """The same call again repeats its launch (kvcopy._engine.rows_memo): refilled in
    place, or a new index tensor, each call moves its own indices' rows, on its stream."""
    torch = torch_cuda
    caches = paged(torch, 2, 16, 16, 512, 5)
    src = Layout.of(caches, planes=(0,), page=1, slot=2)
    chunk = torch.zeros((2, 2, 24, 512), dtype=torch.uint8).pin_memory()
    dst = Layout.of(chunk, planes=(1, 0), slot=2)
    rng = np.random.default_rng(9)
    index = torch.empty(24, dtype=torch.int64, device="cuda")
    streams = [ordered_stream(torch), ordered_stream(torch)]
    for step in range(6):
        slots = rng.choice(16 * 16, 24, replace=False).astype(np.int64)
        if step == 4:
            index = torch.from_numpy(slots).cuda()  # another tensor, another address
        else:
            index.copy_(torch.from_numpy(slots))
        stream = streams[step // 3]
        stream.wait_stream(torch.cuda.current_stream())
        chunk.zero_()
        assert kvcopy.copy_rows(src, dst, index, stream=stream) == "kernel"
        stream.synchronize()
        assert torch.equal(chunk, gathered(torch, caches, slots)), step
    kvcopy.check_indices()


def test_heads_first_caches_gather_into_tokens(torch_cuda):
    torch = torch_cuda
    hnd = rand(torch, (2, 8, 4, 16, 64), 5)  # [2, blocks, heads, block_size, head]
    chunk = torch.zeros((2, 20, 4, 64), dtype=torch.uint8, device="cuda")
    slots = torch.randperm(128, device="cuda")[:20]
    kvcopy.copy_rows(
        Layout.of(hnd, planes=(0,), page=1, slot=3, pieces=2), Layout.of(chunk, planes=(0,), slot=1), slots
    )
    torch.cuda.synchronize()
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(chunk[:, t], hnd[:, s // 16, :, s % 16])


def test_an_out_of_range_gpu_index_writes_nothing_and_is_reported(torch_cuda):
    torch = torch_cuda
    src = rand(torch, (64, 512), 6)
    dst = torch.zeros((64, 512), dtype=torch.uint8, device="cuda")
    index = torch.tensor([1, 2, 64, 4, 1 << 40], device="cuda")
    kvcopy.copy_rows(Layout.of(src, slot=0), Layout.of(dst, slot=0), None, index)
    with pytest.raises(kvcopy.IndexOutOfRange) as info:
        kvcopy.check_indices()
    assert (info.value.skipped, info.value.first_row) == (2, 2)
    assert isinstance(info.value, IndexError)
    torch.cuda.synchronize()
    assert torch.equal(dst[[1, 2, 4]], src[[0, 1, 3]])
    untouched = [r for r in range(64) if r not in (1, 2, 4)]
    assert not dst[untouched].any()
    kvcopy.check_indices()  # the report was cleared


def test_a_captured_copy_replays_with_indices_updated_in_place(torch_cuda):
    torch = torch_cuda
    src = rand(torch, (512, 1024), 7)
    dst = torch.zeros((2, 256, 1024), dtype=torch.uint8).pin_memory()
    src_index = torch.zeros(48, dtype=torch.int64, device="cuda")
    dst_index = torch.zeros(48, dtype=torch.int64, device="cuda")
    a, b = Layout.of(src, slot=0).select([0, 0]), Layout.of(dst, planes=(0,), slot=1)
    stream = torch.cuda.Stream()
    kvcopy.prepare()
    with torch.cuda.stream(stream):
        kvcopy.copy_rows(a, b, src_index, dst_index)  # loads the kernel outside capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kvcopy.copy_rows(a, b, src_index, dst_index)
    replay_with_new_indices(torch, graph, src, dst, src_index, dst_index, 100, 8, out_of_range_at=50)


def test_host_indices_under_capture_go_as_pointer_copies(torch_cuda):
    torch = torch_cuda
    src = rand(torch, (32, 2048), 9)
    dst = torch.zeros((32, 2048), dtype=torch.uint8).pin_memory()
    stream = torch.cuda.Stream()
    kvcopy.prepare()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kvcopy.copy_rows(Layout.of(src, slot=0), Layout.of(dst, slot=0), [3, 1], [0, 30])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst[0], src[3].cpu()) and torch.equal(dst[30], src[1].cpu())


def test_pageable_host_memory_goes_by_the_copy_engines(torch_cuda):
    torch = torch_cuda
    src = rand(torch, (16, 4096), 10)
    dst = np.zeros((16, 4096), np.uint8)
    method = kvcopy.copy_rows(Layout.of(src, slot=0), Layout.of(dst, slot=0), [5, 6], [0, 9])
    torch.cuda.synchronize()
    assert method in ("batch", "loop")
    np.testing.assert_array_equal(dst[[0, 9]], src[[5, 6]].cpu().numpy())
    with pytest.raises(ValueError, match="indices on the GPU need both layouts"):
        kvcopy.copy_rows(Layout.of(src, slot=0), Layout.of(dst, slot=0), torch.tensor([1], device="cuda"))


def test_many_planes_take_several_launches(torch_cuda):
    torch = torch_cuda
    caches = paged(torch, 100, 4, 16, 128, 11)  # 200 planes
    chunk = torch.zeros((2, 100, 10, 128), dtype=torch.uint8, device="cuda")
    slots = torch.arange(5, 15, device="cuda")
    kvcopy.copy_rows(
        Layout.of(caches, planes=(0,), page=1, slot=2), Layout.of(chunk, planes=(1, 0), slot=2), slots
    )
    torch.cuda.synchronize()
    assert torch.equal(chunk.cpu(), gathered(torch, caches, slots.tolist()))
