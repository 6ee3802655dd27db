"""copy_batch on a real GPU: destination bytes equal source bytes, for every
direction, method, size, count and kind of stream. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import testing
from helpers.gpu import POOL_DEVICES, address, expected_after, host_bytes, make_pool, scattered
from helpers.spies import LayerSpy

METHODS = ["auto", "batch", "loop", "kernel"]


def run_copy(direction, count, sizes, *, method="auto", stream=None, align=1, seed=0, pool_bytes=None):
    """Copy scattered ranges and check every destination byte; returns the method used."""
    import torch

    rng = np.random.default_rng(seed)
    sizes = np.broadcast_to(np.asarray(sizes, dtype=np.int64), (count,))
    pool_bytes = pool_bytes or max(int((sizes.max() + align) * count * 2), 1 << 16)
    src_kind, dst_kind = POOL_DEVICES[direction]
    src, dst = make_pool(src_kind, pool_bytes, seed), make_pool(dst_kind, pool_bytes, seed + 1)
    src_before, dst_before = host_bytes(src), host_bytes(dst)
    src_off, sizes = scattered(count, sizes, pool_bytes, rng, align)
    dst_off, _ = scattered(count, sizes, pool_bytes, rng, align)
    torch.cuda.synchronize()
    used = kvcopy.copy_batch(
        address(src) + src_off, address(dst) + dst_off, sizes, stream=stream, method=method
    )
    torch.cuda.synchronize()
    np.testing.assert_array_equal(
        host_bytes(dst), expected_after(src_before, dst_before, src_off, dst_off, sizes)
    )
    return used


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("size", [1, 8, 4096, 16384, 1 << 20])
@pytest.mark.parametrize("method", METHODS)
def test_sizes_directions_methods(torch_cuda, direction, size, method):
    side = torch_cuda.cuda.Stream()
    used = run_copy(direction, 16, size, method=method, stream=side)
    assert used == (method if method != "auto" else used)
    assert used in ("batch", "loop", "kernel")


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("method", METHODS)
def test_mixed_sizes_and_odd_addresses(torch_cuda, direction, method):
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 70_000, 300)
    run_copy(direction, 300, sizes, method=method, stream=torch_cuda.cuda.Stream(), align=61)


@pytest.mark.parametrize("count", [1, 16, 20_000])
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_counts(torch_cuda, direction, count):
    run_copy(direction, count, 4096, stream=torch_cuda.cuda.Stream())


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("count, max_size", [(1001, 16384), (5000, 16384), (3000, 40_000)])
def test_large_kernel_batches_of_mixed_sizes_and_odd_addresses(torch_cuda, direction, count, max_size):
    """Past one launch's inline descriptors: one-tile copies across PCIe are read by
    the kernel from pinned memory in place, others are uploaded first."""
    sizes = np.random.default_rng(count).integers(1, max_size + 1, count)
    used = run_copy(
        direction, count, sizes, method="kernel", stream=torch_cuda.cuda.Stream(), align=61, seed=count
    )
    assert used == "kernel"


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("run", [1, 2, 8])
def test_large_batches_of_blocks_in_runs_merge_and_copy_right(torch_cuda, direction, run):
    """A host pool filled in order against GPU blocks an allocator handed out in runs of
    consecutive ids (a fresh request's blocks): copies continue each other on both
    sides, so the describe pass merges them (into multi-tile copies) after its
    vectorised pass; every byte still lands where its own copy says."""
    count, block = 6000, 4096
    rng = np.random.default_rng(run)
    pool_bytes = 2 * count * block
    src_kind, dst_kind = POOL_DEVICES[direction]
    src, dst = make_pool(src_kind, pool_bytes, run), make_pool(dst_kind, pool_bytes, run + 1)
    src_before, dst_before = host_bytes(src), host_bytes(dst)
    starts = rng.permutation(2 * count // run)[: count // run].astype(np.int64) * run
    slots = (starts[:, None] + np.arange(run)).reshape(-1)
    in_order = np.arange(count, dtype=np.int64) * block
    src_off, dst_off = (in_order, slots * block) if direction != "d2h" else (slots * block, in_order)
    sizes = np.full(count, block, dtype=np.int64)
    torch_cuda.cuda.synchronize()
    used = kvcopy.copy_batch(
        address(src) + src_off,
        address(dst) + dst_off,
        sizes,
        stream=torch_cuda.cuda.Stream(),
        method="kernel",
    )
    torch_cuda.cuda.synchronize()
    assert used == "kernel"
    np.testing.assert_array_equal(
        host_bytes(dst), expected_after(src_before, dst_before, src_off, dst_off, sizes)
    )


def _spy_launches(seams):
    """Record the (count, size or tiles) of every pairs and descriptor-table launch."""
    calls = []
    spy = LayerSpy(
        testing.cuda.launch,
        ("launch_compact", "launch_descs"),
        lambda name, args: calls.append((name, args[2], args[3])),
    )
    seams.enter_context(testing.fake_cuda(spy, ("launch",)))
    return calls


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize(
    "count, size, align", [(1001, 2048, 1), (4097, 16384, 16), (3333, 1000, 61), (2000, "mixed", 1)]
)
def test_large_batches_of_one_block_size_go_as_pairs(torch_cuda, seams, direction, count, size, align):
    """Past one launch's inline descriptors, copies of one size (at most a tile) are
    described in 16-byte pairs and copied by the pairs kernel, at odd sizes and
    addresses too; a batch of several sizes keeps its 32-byte descriptors. Past
    16 MiB (config.launch_bytes), host copies go as several launches of 16 MiB."""
    kvcopy.config.launch_bytes = 16 << 20
    calls = _spy_launches(seams)
    sizes = np.random.default_rng(count).integers(1, 16385, count) if size == "mixed" else size
    used = run_copy(
        direction, count, sizes, method="kernel", stream=torch_cuda.cuda.Stream(), align=align, seed=count
    )
    assert used == "kernel"
    sliced = direction != "d2d" and size == 16384 and count == 4097  # 64 MiB + 16 KiB
    slices = [1024, 1024, 1024, 1024, 1] if sliced else [count]
    assert [c for c in calls if c[0] == "launch_compact"] == (
        [] if size == "mixed" else [("launch_compact", n, size) for n in slices]
    )


@pytest.mark.parametrize("bad", ["null", "unmapped"])
def test_a_bad_copy_at_the_end_of_a_large_batch_is_reported_before_any_launch(torch_cuda, seams, bad):
    import torch

    calls = _spy_launches(seams)
    count, size = 32768, 2048
    host = torch.zeros(2 * count * size, dtype=torch.uint8, pin_memory=True)
    gpu = torch.full((2 * count * size,), 7, dtype=torch.uint8, device="cuda")
    src = host.data_ptr() + np.arange(count, dtype=np.uint64)[::-1] * np.uint64(2 * size)
    dst = gpu.data_ptr() + np.arange(count, dtype=np.uint64) * np.uint64(2 * size)
    src[-1] = 0 if bad == "null" else 0x2A000
    with pytest.raises(ValueError, match=rf"src_ptrs\[{count - 1}\]"):
        kvcopy.copy_batch(src, dst, np.full(count, size, np.uint64), method="auto")
    torch.cuda.synchronize()
    assert calls == []
    assert bool((gpu == 7).all())  # nothing was written
    src[-1] = host.data_ptr()  # and the library goes on working
    assert kvcopy.copy_batch(src, dst, np.full(count, size, np.uint64)) == "kernel"
    torch.cuda.synchronize()
    assert bool((gpu.view(-1, 2 * size)[:, :size] == 0).all())


@pytest.mark.parametrize("count", [16, 20_000])
@pytest.mark.parametrize("method", ["batch", "loop", "kernel"])
def test_counts_every_method(torch_cuda, count, method):
    run_copy("h2d", count, 512, method=method, stream=torch_cuda.cuda.Stream())


def test_batch_from_python_ints_and_torch_pointer_tensors(torch_cuda):
    src = make_pool("pinned", 1 << 16, 1)
    dst = make_pool("cuda", 1 << 16, 2)
    ptrs_src = torch_cuda.tensor([src.data_ptr(), src.data_ptr() + 8192], dtype=torch_cuda.int64)
    kvcopy.copy_batch(ptrs_src, [dst.data_ptr() + 100, dst.data_ptr() + 20000], [4096, 4096])
    torch_cuda.cuda.synchronize()
    assert torch_cuda.equal(dst[100:4196].cpu(), src[:4096])
    assert torch_cuda.equal(dst[20000:24096].cpu(), src[8192:12288])


def test_pointers_in_gpu_memory_are_refused(torch_cuda):
    """Reading them would wait for the GPU: pointers and sizes come from the host."""
    on_gpu = torch_cuda.tensor([0x1000, 0x2000], dtype=torch_cuda.int64, device="cuda")
    with pytest.raises(
        TypeError,
        match="^src_ptrs: a torch tensor of pointers or sizes must be on the CPU, got one on cuda:0",
    ):
        kvcopy.copy_batch(on_gpu, [0x3000, 0x4000], [8, 8])


# ------------------------------------------------------------------ streams


@pytest.mark.parametrize("handle", [0, 1, 2])
@pytest.mark.parametrize("method", METHODS)
def test_default_stream_handles(torch_cuda, handle, method):
    used = run_copy("h2d", 64, 16384, method=method, stream=handle)
    if handle in (0, 1):  # never the batch call on the legacy stream
        assert used != "batch"
    if method == "batch":
        assert used == ("batch" if handle == 2 else "loop")


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_torch_current_stream_is_default(torch_cuda, direction):
    used = run_copy(direction, 64, 16384, stream=None)
    assert used in ("kernel", "loop")


def test_torch_side_stream_as_current(torch_cuda):
    side = torch_cuda.cuda.Stream()
    with torch_cuda.cuda.stream(side):
        src = make_pool("cuda", 1 << 20, 3)
        dst = torch_cuda.empty_like(src)
        # tensors passed as pointers come from torch: None means torch's current stream
        kvcopy.copy_batch(
            torch_cuda.tensor([src.data_ptr()]),
            torch_cuda.tensor([dst.data_ptr()]),
            torch_cuda.tensor([1 << 20]),
        )
        side.synchronize()
    assert torch_cuda.equal(src, dst)


def test_external_stream(torch_cuda):
    raw = torch_cuda.cuda.Stream()
    ext = torch_cuda.cuda.ExternalStream(raw.cuda_stream)
    assert kvcopy.resolve_stream(ext) == raw.cuda_stream
    run_copy("d2h", 32, 8192, method="batch", stream=ext)


def test_created_stream_handle_int(torch_cuda):
    s = torch_cuda.cuda.Stream()
    assert kvcopy.resolve_stream(s) == s.cuda_stream
    assert run_copy("h2d", 32, 8192, method="batch", stream=s.cuda_stream) == "batch"


def test_cupy_stream(torch_cuda):
    cupy = pytest.importorskip("cupy")
    s = cupy.cuda.Stream(non_blocking=True)
    assert kvcopy.resolve_stream(s) == s.ptr
    for method in METHODS:
        run_copy("h2d", 32, 8192, method=method, stream=s)
    assert kvcopy.resolve_stream(cupy.cuda.Stream.null) == 1


def test_raw_pointers_under_a_cupy_stream_go_on_the_default_stream(torch_cuda):
    """Pointers name no framework: inside CuPy's stream context a copy of them runs on
    the default stream (resolve_stream(None) is 0), which a non-blocking stream does not
    wait for, nor it for that stream: the arrays are made ready first, and the copy is
    waited for on the default stream."""
    cupy = pytest.importorskip("cupy")
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        a = cupy.arange(1 << 16, dtype=cupy.uint8)
        b = cupy.zeros_like(a)
        s.synchronize()
        assert kvcopy.resolve_stream(None) == 0
        kvcopy.copy_batch(np.array([a.data.ptr]), np.array([b.data.ptr]), np.array([a.nbytes]))
    cupy.cuda.Stream.null.synchronize()
    assert bool((a == b).all())


def test_cuda_core_stream(torch_cuda):
    core = pytest.importorskip("cuda.core")
    dev = core.Device(0)
    dev.set_current()
    s = dev.create_stream()
    handle = kvcopy.resolve_stream(s)
    assert handle == int(s.handle)
    for method in METHODS:
        run_copy("d2h", 32, 8192, method=method, stream=s)


def test_cuda_bindings_custream_object(torch_cuda):
    from cuda.bindings import driver

    s = torch_cuda.cuda.Stream()
    run_copy("h2d", 16, 8192, method="batch", stream=driver.CUstream(s.cuda_stream))


# ------------------------------------------------------------------ pageable memory


@pytest.mark.parametrize("direction", ["pageable_h2d", "pageable_d2h"])
def test_pageable_memory_goes_by_dma(torch_cuda, direction):
    assert run_copy(direction, 32, 16384, stream=torch_cuda.cuda.Stream()) == "batch"
    assert run_copy(direction, 32, 16384, stream=1) == "loop"
    with pytest.raises(ValueError, match="pageable"):
        run_copy(direction, 32, 16384, method="kernel", stream=1)


# ------------------------------------------------------------------ graph capture


@pytest.mark.parametrize("method", ["auto", "loop", "kernel"])
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_graph_capture_replays_the_copy(torch_cuda, method, direction):
    torch = torch_cuda
    src_kind, dst_kind = POOL_DEVICES[direction]
    n, block = 2000, 4096  # > one launch's worth of inline descriptors
    src = make_pool(src_kind, n * block * 2, 11)
    dst = make_pool(dst_kind, n * block * 2, 12)
    rng = np.random.default_rng(3)
    src_off = rng.permutation(2 * n)[:n] * block
    dst_off = rng.permutation(2 * n)[:n] * block
    sizes = np.full(n, block)
    graph = torch.cuda.CUDAGraph()
    capture_stream = torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=capture_stream):
        used = kvcopy.copy_batch(
            src.data_ptr() + src_off, dst.data_ptr() + dst_off, sizes, stream=capture_stream, method=method
        )
    assert used != "batch"
    # Nothing ran during capture; new source bytes must arrive on replay.
    fresh = torch.from_numpy(np.random.default_rng(99).integers(0, 256, src.numel(), dtype=np.uint8))
    src.copy_(fresh)
    torch.cuda.synchronize()
    dst_before = host_bytes(dst)
    graph.replay()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(
        host_bytes(dst), expected_after(fresh.numpy(), dst_before, src_off, dst_off, sizes)
    )


def test_batch_under_capture_raises_and_capture_stays_usable(torch_cuda):
    torch = torch_cuda
    src = make_pool("pinned", 1 << 20, 5)
    dst = make_pool("cuda", 1 << 20, 6)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=s):
        with pytest.raises(kvcopy.CaptureError, match="capturing"):
            kvcopy.copy_batch(
                [src.data_ptr(), src.data_ptr() + 8192],
                [dst.data_ptr(), dst.data_ptr() + 65536],
                [4096, 4096],
                stream=s,
                method="batch",
            )
        kvcopy.copy_batch(
            [src.data_ptr(), src.data_ptr() + 8192],
            [dst.data_ptr(), dst.data_ptr() + 65536],
            [4096, 4096],
            stream=s,
        )
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst[:4096].cpu(), src[:4096])
    assert torch.equal(dst[65536 : 65536 + 4096].cpu(), src[8192 : 8192 + 4096])


# ------------------------------------------------------------------ bookkeeping


def test_last_decision_and_empty_batch(torch_cuda):
    assert kvcopy.copy_batch([], [], []) == "none"
    run_copy("h2d", 8, 4096, stream=1)
    decision = kvcopy.last_decision()
    assert decision.method in ("kernel", "loop") and decision.reason


def test_batch_disabled_driver_falls_back(torch_cuda):
    from kvcopy import testing

    with testing.capabilities(batch_available=False):  # a driver older than 12.8
        s = torch_cuda.cuda.Stream()
        assert run_copy("pageable_h2d", 16, 4096, stream=s) == "loop"
        # 16 scattered blocks of 4 MiB: long host spans, staged (no batch API needed)
        assert run_copy("h2d", 16, 4 << 20, stream=s) == "staged"
        saved = kvcopy.config.staging_bytes
        try:
            kvcopy.config.staging_bytes = 0
            assert run_copy("h2d", 16, 4 << 20, stream=s) == "kernel"
        finally:
            kvcopy.config.staging_bytes = saved
        with pytest.raises(kvcopy.KVCopyError, match="cuMemcpyBatchAsync"):
            run_copy("h2d", 16, 4096, stream=s, method="batch")
    assert run_copy("h2d", 16, 4 << 20, stream=torch_cuda.cuda.Stream()) == "batch"


def test_thread_without_current_context(torch_cuda):
    import threading

    errors = []

    def worker():
        try:
            run_copy("h2d", 16, 4096, stream=2, seed=4)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not errors, errors


def test_describe_copies_plans_exactly_like_the_planner(torch_cuda):
    """The kernel path's fused pass (plan + classify + descriptors) and the
    planner used by the DMA paths agree copy for copy, and reject the same input."""
    from kvcopy.testing import cuda

    kv_classify, kv_describe, kv_launch = cuda.classify, cuda.describe, cuda.launch
    from kvcopy._plans.copies import plan_copies

    torch = torch_cuda
    host = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(11)
    sizes = rng.choice([0, 1, 8, 100, 4096, 40000], 3000).astype(np.uint64)
    src_off = rng.integers(0, (1 << 20) - 80000, 3000).astype(np.uint64)  # merged pairs fit
    dst_off = rng.integers(0, (1 << 20) - 80000, 3000).astype(np.uint64)
    for i in range(0, 2990, 7):  # runs that continue each other on both sides: merged
        src_off[i + 1], dst_off[i + 1] = src_off[i] + sizes[i], dst_off[i] + sizes[i]
    src = np.uint64(host.data_ptr()) + src_off
    dst = np.uint64(dev.data_ptr()) + dst_off
    plan = plan_copies(src, dst, sizes)
    descs = np.zeros((len(sizes), 4), dtype=np.uint64)
    batch = kv_describe.describe_copies(src, dst, sizes, descs.ctypes.data)
    count, total, tiles = batch.count, batch.total_bytes, batch.tiles
    src_kinds, src_dev, dst_kinds, dst_dev = (
        batch.src_kinds,
        batch.src_device,
        batch.dst_kinds,
        batch.dst_device,
    )
    assert batch.table == descs.ctypes.data and batch.src is src
    assert count == plan.count < int(np.count_nonzero(sizes))
    assert total == int(plan.sizes.sum())
    assert (src_kinds, src_dev) == (kv_classify.KIND_HOST_MAPPED, -1)
    assert (dst_kinds, dst_dev) == (kv_classify.KIND_DEVICE, torch.cuda.current_device())
    src_view, dst_view = np.empty_like(plan.src), np.empty_like(plan.dst)
    kv_classify.classify_pointers(plan.src, plan.sizes, src_view)
    kv_classify.classify_pointers(plan.dst, plan.sizes, dst_view)
    np.testing.assert_array_equal(descs[:count, 0], src_view)
    np.testing.assert_array_equal(descs[:count, 1], dst_view)
    np.testing.assert_array_equal(descs[:count, 2], plan.sizes)
    per_copy = (plan.sizes + np.uint64(kv_launch.TILE_BYTES - 1)) // np.uint64(kv_launch.TILE_BYTES)
    np.testing.assert_array_equal(descs[:count, 3], np.concatenate([[0], np.cumsum(per_copy)[:-1]]))
    assert tiles == int(per_copy.sum())
    bad_sizes = sizes.copy()
    bad_sizes[1234] = 2**63
    with pytest.raises(ValueError) as planned:
        plan_copies(src, dst, bad_sizes)
    with pytest.raises(ValueError) as described:
        kv_describe.describe_copies(src, dst, bad_sizes, descs.ctypes.data)
    assert (
        str(planned.value) == str(described.value) == f"sizes[1234] = {2**63} is larger than 2**63 - 1 bytes"
    )


@pytest.mark.parametrize("stream_kind, expected", [("created", "batch"), ("legacy", "kernel")])
def test_stores_by_dma_sends_stores_to_the_copy_engines(torch_cuda, monkeypatch, stream_kind, expected):
    """config.stores_by_dma: 16 KiB stores go by batched DMA where the stream allows it
    and by the kernel on the legacy default stream, the bytes right either way;
    loads keep the kernel."""
    kvcopy.config.stores_by_dma = True
    stream = torch_cuda.cuda.Stream() if stream_kind == "created" else 1
    assert run_copy("d2h", 64, 16384, stream=stream) == expected
    assert "stores_by_dma" in kvcopy.last_decision().reason
    assert run_copy("h2d", 64, 16384, stream=stream) == "kernel"
