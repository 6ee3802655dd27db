"""swap_blocks, host memory, TransferQueue and the vLLM shim on a real GPU.
Every check compares with a reference gather done by torch or NumPy."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

import kvcopy
from helpers.gpu import jax_gpu


def mapping_for(n_src, n_dst, count, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack(
        [rng.choice(n_src, count, replace=False), rng.choice(n_dst, count, replace=False)], axis=1
    )


def rand_cuda(torch, shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(-100, 100, shape, generator=g, device="cuda").to(dtype)


@pytest.mark.parametrize("layout", ["2_by_blocks", "blocks_by_2", "mla"])
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
def test_layouts_and_directions(torch_cuda, layout, direction):
    torch = torch_cuda
    layers, blocks, host_blocks = 4, 64, 96
    tail = (16, 2, 64)
    kw = dict(dtype=torch.bfloat16)

    def cache(n, on_gpu, seed):
        if layout == "2_by_blocks":
            shape = (2, n) + tail
        elif layout == "blocks_by_2":
            shape = (n, 2) + tail
        else:
            shape = (n,) + tail
        t = rand_cuda(torch, shape, torch.bfloat16, seed)
        return t if on_gpu else t.cpu().pin_memory()

    def views(t):
        if layout == "2_by_blocks":
            return [t[0], t[1]]
        if layout == "blocks_by_2":
            return [t[:, 0], t[:, 1]]
        return [t]

    src_gpu, dst_gpu = direction in ("d2h", "d2d"), direction in ("h2d", "d2d")
    src = [cache(blocks if src_gpu else host_blocks, src_gpu, i) for i in range(layers)]
    dst = [cache(host_blocks if not dst_gpu else blocks, dst_gpu, 100 + i) for i in range(layers)]
    src_views = [v for t in src for v in views(t)]
    dst_views = [v for t in dst for v in views(t)]
    mapping = mapping_for(src_views[0].shape[0], dst_views[0].shape[0], 40)
    expected = [d.clone() for d in dst_views]
    for e, s in zip(expected, src_views):
        to = torch.from_numpy(mapping[:, 1]).to(e.device)
        e[to] = s[torch.from_numpy(mapping[:, 0]).to(s.device)].to(e.device)
    used = kvcopy.swap_blocks(src_views, dst_views, mapping, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert used in ("kernel", "batch", "loop")
    for got, want in zip(dst_views, expected):
        assert torch.equal(got.cpu(), want.cpu())
    del kw


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("case", ["strides_differ", "split"])
def test_tensor_table_and_split_blocks(torch_cuda, direction, case):
    """Tensors of one side with different strides go by the block kernel's tensor table;
    split blocks (ids counting sub-blocks) by the layout kernel's pages."""
    torch = torch_cuda
    on_host = lambda t: t.cpu().pin_memory()  # noqa: E731
    if case == "strides_differ":
        wide = on_host(rand_cuda(torch, (32, 2, 512), torch.int16, 1))
        host = [on_host(rand_cuda(torch, (32, 512), torch.int16, 2)), wide[:, 0]]
        gpu = [rand_cuda(torch, (40, 512), torch.int16, 3 + i) for i in range(2)]
        split = False
    else:
        host = [on_host(rand_cuda(torch, (10, 4 * 256), torch.int16, 4 + i)) for i in range(2)]
        gpu = [rand_cuda(torch, (40, 256), torch.int16, 6 + i) for i in range(2)]
        split = True
    src, dst = (host, gpu) if direction == "h2d" else (gpu, host)
    src_blocks = [t.reshape(-1, 256) if split and t.shape[-1] == 1024 else t for t in src]
    dst_blocks = [t.reshape(-1, 256) if split and t.shape[-1] == 1024 else t for t in dst]
    mapping = mapping_for(src_blocks[0].shape[0], dst_blocks[0].shape[0], 12, seed=3)
    expected = [d.cpu().clone() for d in dst_blocks]
    for e, s in zip(expected, src_blocks):
        e[torch.from_numpy(mapping[:, 1])] = s.cpu()[torch.from_numpy(mapping[:, 0])]
    assert kvcopy.swap_blocks(src, dst, mapping, split_blocks=split, method="kernel") == "kernel"
    torch.cuda.synchronize()
    for got, want in zip(dst_blocks, expected):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("method", ["auto", "batch", "loop", "kernel"])
def test_frameworks_cupy_numpy_pinned_jax(torch_cuda, method):
    cupy = pytest.importorskip("cupy")
    gpu = cupy.asarray(np.random.default_rng(0).integers(0, 255, (32, 1024), dtype=np.uint8))
    host = kvcopy.pinned_empty((48, 1024), dtype=np.uint8)
    host[:] = 0
    mapping = mapping_for(32, 48, 20, 1)
    s = cupy.cuda.Stream(non_blocking=True)
    kvcopy.swap_blocks(gpu, host, mapping, stream=s, method=method)
    s.synchronize()
    np.testing.assert_array_equal(host[mapping[:, 1]], cupy.asnumpy(gpu)[mapping[:, 0]])
    back = cupy.zeros_like(gpu)
    kvcopy.swap_blocks(host, back, mapping[:, ::-1], stream=s, method=method)
    s.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(back)[mapping[:, 0]], cupy.asnumpy(gpu)[mapping[:, 0]])


def test_jax_array_as_source(torch_cuda):
    jax, gpu = jax_gpu()
    jnp = jax.numpy
    src = jax.device_put(jnp.arange(16 * 256, dtype=jnp.float32).reshape(16, 256), gpu)
    src.block_until_ready()
    dst = torch_cuda.zeros((16, 256), dtype=torch_cuda.float32, device="cuda")
    kvcopy.swap_blocks(src, dst, [[3, 0], [15, 1]], stream=1)
    torch_cuda.cuda.synchronize()
    ref = np.asarray(src)
    np.testing.assert_array_equal(dst[0].cpu().numpy(), ref[3])
    np.testing.assert_array_equal(dst[1].cpu().numpy(), ref[15])
    with pytest.raises(ValueError, match=r"^dst is read-only"):  # JAX arrays are immutable
        kvcopy.swap_blocks(dst, src, [[0, 3]], stream=1)


def _device_bytes(ptr: int, nbytes: int) -> np.ndarray:
    """Read device memory with the driver itself (independent of kvcopy and torch)."""
    from cuda.bindings import driver

    out = np.empty(nbytes, np.uint8)
    (err,) = driver.cuMemcpyDtoH(out.ctypes.data, ptr, nbytes)
    assert int(err) == 0, err
    return out


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_cuda_core_buffer_takes_the_block_size_of_the_other_side(torch_cuda, direction):
    core = pytest.importorskip("cuda.core")
    torch = torch_cuda
    dev = core.Device(0)
    dev.set_current()
    block, n = 4096, 24
    buf = dev.allocate(n * block, stream=dev.default_stream)
    dev.sync()  # stream-ordered allocation: ready before kvcopy's own stream uses it
    host = torch.randint(0, 255, (n, block), dtype=torch.uint8).pin_memory()
    mapping = mapping_for(n, n, 10, 7)
    # fill the buffer through kvcopy first (whole-buffer copy), checked by the driver itself
    kvcopy.copy_batch([host.data_ptr()], [int(buf.handle)], [n * block], stream=1)
    torch.cuda.synchronize()
    assert np.array_equal(_device_bytes(int(buf.handle), n * block), host.numpy().ravel())
    if direction == "h2d":
        fresh = torch.randint(0, 255, (n, block), dtype=torch.uint8).pin_memory()
        used = kvcopy.swap_blocks(fresh, buf, mapping, stream=1)
        torch.cuda.synchronize()
        expected = host.numpy().copy()
        expected[mapping[:, 1]] = fresh.numpy()[mapping[:, 0]]
        got = _device_bytes(int(buf.handle), n * block).reshape(n, block)
    else:
        out = torch.zeros((n, block), dtype=torch.uint8).pin_memory()
        used = kvcopy.swap_blocks(buf, out, mapping, stream=1)
        torch.cuda.synchronize()
        expected = np.zeros((n, block), np.uint8)
        expected[mapping[:, 1]] = host.numpy()[mapping[:, 0]]
        got = out.numpy()
    assert used == "kernel"
    np.testing.assert_array_equal(got, expected)
    view = kvcopy.block_view(buf, 2 * block)
    out = torch.zeros((n // 2, 2 * block), dtype=torch.uint8, device="cuda")
    kvcopy.swap_blocks(view, out, [[0, 1], [5, 0]], stream=1)
    torch.cuda.synchronize()
    whole = _device_bytes(int(buf.handle), n * block)
    np.testing.assert_array_equal(out[1].cpu().numpy(), whole[: 2 * block])
    np.testing.assert_array_equal(out[0].cpu().numpy(), whole[10 * block : 12 * block])
    buf.close()


def test_block_view_of_raw_device_pointers(torch_cuda):
    torch = torch_cuda
    gpu = torch.randint(0, 255, (32, 3000), dtype=torch.uint8, device="cuda")  # 3000: not a multiple of 16
    host = kvcopy.pinned_empty((40, 3000), dtype=np.uint8)
    host[:] = 0
    src = kvcopy.block_view(gpu.data_ptr(), 3000, num_blocks=32)
    dst = kvcopy.block_view(host.ctypes.data, 3000, num_blocks=40)
    mapping = mapping_for(32, 40, 17, 8)
    for method in ("auto", "kernel", "batch", "loop"):
        host[:] = 0
        kvcopy.swap_blocks(src, dst, mapping, stream=1, method=method)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(host[mapping[:, 1]], gpu.cpu().numpy()[mapping[:, 0]])
        assert host[np.setdiff1d(np.arange(40), mapping[:, 1])].sum() == 0


def test_pageable_numpy_goes_by_dma(torch_cuda):
    gpu = torch_cuda.arange(64 * 256, dtype=torch_cuda.int32, device="cuda").reshape(64, 256)
    host = np.zeros((64, 256), dtype=np.int32)
    used = kvcopy.swap_blocks(gpu, host, [[1, 2], [10, 11]], stream=torch_cuda.cuda.Stream())
    torch_cuda.cuda.synchronize()
    assert used == "batch"
    np.testing.assert_array_equal(host[2], gpu[1].cpu().numpy())
    np.testing.assert_array_equal(host[11], gpu[10].cpu().numpy())


def test_registered_numpy_and_mmap_take_the_kernel(torch_cuda):
    gpu = torch_cuda.arange(64 * 1024, dtype=torch_cuda.int32, device="cuda").reshape(64, 1024)
    host = np.zeros((64, 1024), dtype=np.int32)
    with kvcopy.register(host, chunk_bytes=host[0].nbytes * 16) as reg:
        assert reg.device_ptr != 0
        used = kvcopy.swap_blocks(gpu, host, mapping_for(64, 64, 30), stream=1)
        torch_cuda.cuda.synchronize()
        assert used == "kernel"
    m = mapping_for(64, 64, 30)
    np.testing.assert_array_equal(host[m[:, 1]], gpu.cpu().numpy()[m[:, 0]])
    region = mmap.mmap(-1, 64 * 4096)
    with kvcopy.register(region):
        view = np.frombuffer(region, dtype=np.int32).reshape(64, 1024)
        assert kvcopy.swap_blocks(gpu, view, [[5, 6], [9, 1]], stream=1) == "kernel"
        torch_cuda.cuda.synchronize()
        np.testing.assert_array_equal(view[6], gpu[5].cpu().numpy())
        np.testing.assert_array_equal(view[1], gpu[9].cpu().numpy())
        del view
    region.close()


def test_pinned_empty_frees_and_reports_device_pointer(torch_cuda):
    arr = kvcopy.pinned_empty((4, 8), dtype=np.float32)
    assert arr.shape == (4, 8) and arr.dtype == np.float32
    assert kvcopy.device_pointer(arr) != 0
    with pytest.raises(ValueError, match="negative"):
        kvcopy.pinned_empty((-1,))


def test_errors_before_any_copy(torch_cuda):
    torch = torch_cuda
    gpu = torch.zeros((8, 64), device="cuda")
    host = torch.zeros((8, 64)).pin_memory()
    with pytest.raises(ValueError, match="out of range"):
        kvcopy.swap_blocks(gpu, host, [[0, 8]])
    with pytest.raises(TypeError, match="^block_mapping: expected integers, got dtype torch.float32"):
        kvcopy.swap_blocks(gpu, host, torch.tensor([[0.0, 1.0]]))
    with pytest.raises(ValueError, match="contiguous"):
        kvcopy.swap_blocks(gpu[:, ::2], host[:, :32], [[0, 0]])
    with pytest.raises(ValueError, match="different numbers"):
        kvcopy.swap_blocks([gpu, gpu], [host], [[0, 0]])
    torch.cuda.synchronize()
    assert host.abs().sum() == 0


def test_64_tensors_1024_pairs(torch_cuda):
    torch = torch_cuda
    gpu = [rand_cuda(torch, (2048, 16, 8, 128), torch.bfloat16, i) for i in range(8)]
    host = [torch.zeros((2048, 16, 8, 128), dtype=torch.bfloat16).pin_memory() for _ in range(8)]
    src, dst = gpu * 8, host * 8  # 64 tensors (8 distinct, each listed 8 times)
    mapping = mapping_for(2048, 2048, 1024, 5)
    used = kvcopy.swap_blocks(src, dst, mapping, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert used == "kernel"
    idx_s, idx_d = torch.from_numpy(mapping[:, 0]), torch.from_numpy(mapping[:, 1])
    for g, h in zip(gpu, host):
        assert torch.equal(h[idx_d], g[idx_s.cuda()].cpu())


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_many_pairs_go_up_in_chunks_and_every_block_lands(torch_cuda, direction):
    """More pairs than policy.ID_FIRST_CHUNK: the ids go up and launch in chunks."""
    torch = torch_cuda
    gpu = [rand_cuda(torch, (12000, 256), torch.int16, 20 + i) for i in range(2)]
    host = [rand_cuda(torch, (12000, 256), torch.int16, 30 + i).cpu().pin_memory() for i in range(2)]
    src, dst = (host, gpu) if direction == "h2d" else (gpu, host)
    mapping = mapping_for(12000, 12000, 10_000, 7)
    expected = [d.cpu().clone() for d in dst]
    for e, t in zip(expected, src):
        e[torch.from_numpy(mapping[:, 1])] = t.cpu()[torch.from_numpy(mapping[:, 0])]
    assert kvcopy.swap_blocks(src, dst, mapping) == "kernel"
    torch.cuda.synchronize()
    for got, want in zip(dst, expected):
        assert torch.equal(got.cpu(), want)


# ------------------------------------------------------------------ TransferQueue


def test_transfer_queue_offload_and_reload(torch_cuda):
    torch = torch_cuda
    gpu = [rand_cuda(torch, (128, 16, 4, 64), torch.float16, i) for i in range(4)]
    original = [g.clone() for g in gpu]
    host = [torch.zeros((256, 16, 4, 64), dtype=torch.float16).pin_memory() for _ in range(4)]
    store = kvcopy.TransferQueue(gpu, host)
    load = kvcopy.TransferQueue(host, gpu)
    for job in range(4):
        # compute writes the blocks right before the store: the queue must wait for it
        gpu[0][job * 8 : (job + 1) * 8].add_(1)
        original[0][job * 8 : (job + 1) * 8].add_(1)
        store.submit(job, [[job * 8 + k, 100 + job * 8 + k] for k in range(8)])
    results = store.wait()
    assert [r.job_id for r in results] == [0, 1, 2, 3]
    assert all(r.ok and r.bytes == 4 * 8 * 16 * 4 * 64 * 2 and r.seconds >= 0 for r in results)
    for g in gpu:
        g.zero_()
    load.submit("reload", [[100 + k, k] for k in range(32)])
    assert load.wait(["reload"])[0].ok
    torch.cuda.synchronize()
    for g, o in zip(gpu, original):
        assert torch.equal(g[:32], o[:32])
    store.close()
    load.close()
    store.close()  # twice is fine
    with pytest.raises(kvcopy.KVCopyError, match="closed"):
        store.submit(9, [[0, 0]])


@pytest.mark.parametrize("tokens, expected", [(16, ("kernel", "kernel")), (512, ("batch", "batch"))])
def test_transfer_queue_job_stores_and_loads_at_once(torch_cuda, tokens, expected):
    """A step's stores and loads as one job (submit(..., back=)): 8 KiB blocks go out
    as one block-kernel launch, 256 KiB blocks to the copy engines both at once."""
    torch = torch_cuda
    shape = (48, tokens, 4, 64)  # 8 KiB or 256 KiB blocks of float16
    gpu = [rand_cuda(torch, shape, torch.float16, 20 + i) for i in range(3)]
    original = [g.clone() for g in gpu]
    host = [torch.zeros((64,) + shape[1:], dtype=torch.float16).pin_memory() for _ in range(3)]
    block_bytes = tokens * 4 * 64 * 2
    with kvcopy.TransferQueue(gpu, host) as queue:
        queue.submit("evict", [[k, 40 + k] for k in range(8)])
        # the next step evicts 8 more and brings the first 8 back into other GPU blocks;
        # its load reads host blocks the job before wrote (jobs run in order)
        queue.submit("step", [[8 + k, 48 + k] for k in range(8)], back=[[40 + k, 16 + k] for k in range(8)])
        with pytest.raises(ValueError, match=r"back\[0\] writes"):
            queue.submit("racy", [[24, 60]], back=[[41, 24]])  # GPU block 24 both ways
        results = queue.wait()
        assert [r.job_id for r in results] == ["evict", "step"]  # nothing of "racy" ran
        assert all(r.ok for r in results)
        assert results[0].bytes == 3 * 8 * block_bytes and results[0].back_method == ""
        assert results[1].bytes == 2 * 3 * 8 * block_bytes
        assert (results[1].method, results[1].back_method) == expected
        queue.submit("after", [[30, 63]])  # the queue still works
        assert queue.wait(["after"])[0].ok
    for g, h, o in zip(gpu, host, original):
        assert torch.equal(h[40:56].cuda(), o[0:16])  # both stores
        assert torch.equal(g[16:24], o[0:8])  # the load
        assert torch.equal(h[63].cuda(), o[30])
        assert torch.equal(g[24:], o[24:]) and torch.equal(g[:16], o[:16])  # nothing else


def test_a_load_queue_job_stores_back_at_once(torch_cuda):
    """The queue the other way round: loads forward, stores back, in one job."""
    torch = torch_cuda
    gpu = [rand_cuda(torch, (32, 16, 4, 64), torch.float16, 30 + i) for i in range(2)]
    host = [torch.randn((64, 16, 4, 64)).to(torch.float16).pin_memory() for _ in range(2)]
    gpu_before, host_before = [g.clone() for g in gpu], [h.clone() for h in host]
    with kvcopy.TransferQueue(host, gpu) as queue:
        queue.submit(
            "step",
            [[50 + k, 20 + k] for k in range(4)],  # load host 50-53
            back=[[k, 10 + k] for k in range(4)],
        )  # store GPU 0-3
        (result,) = queue.wait()
        assert result.ok and (result.method, result.back_method) == ("kernel", "kernel")
    for g, h, gb, hb in zip(gpu, host, gpu_before, host_before):
        assert torch.equal(g[20:24].cpu(), hb[50:54])
        assert torch.equal(h[10:14].cuda(), gb[0:4])
        assert torch.equal(g[:20], gb[:20]) and torch.equal(h[:10], hb[:10])


def test_transfer_queue_poll_and_context_manager(torch_cuda):
    torch = torch_cuda
    src = torch.arange(64 * 256, dtype=torch.int32).reshape(64, 256).pin_memory()
    dst = torch.zeros((64, 256), dtype=torch.int32, device="cuda")
    with kvcopy.TransferQueue(src, dst) as q:
        for j in range(10):
            q.submit(j, [[j, 63 - j]])
        seen = []
        while len(seen) < 10:
            seen += q.poll()
        assert [r.job_id for r in seen] == list(range(10))
        with pytest.raises(KeyError):
            q.wait([123])
    assert q.closed
    assert torch.equal(dst[63 - 9 :].flip(0).cpu(), src[:10])


# ------------------------------------------------------------------ vLLM shim


def _shim_case(torch, sizes, count):
    from kvcopy.compat.vllm import swap_blocks_batch

    total = int(sum(sizes) * (count // len(sizes) + 1)) * 2
    src = torch.randint(0, 255, (total,), dtype=torch.uint8).pin_memory()
    dst = torch.zeros(total, dtype=torch.uint8, device="cuda")
    sz = np.resize(np.asarray(sizes, np.int64), count)
    off = np.concatenate([[0], np.cumsum(sz)[:-1]]) * 2
    swap_blocks_batch(
        torch.from_numpy(src.data_ptr() + off), torch.from_numpy(dst.data_ptr() + off), torch.from_numpy(sz)
    )
    torch.cuda.synchronize()
    got, want = dst.cpu().numpy(), src.numpy()
    for o, n in zip(off.tolist(), sz.tolist()):
        assert np.array_equal(got[o : o + n], want[o : o + n])


def test_vllm_shim_legacy_stream(torch_cuda):
    assert torch_cuda.cuda.current_stream().cuda_stream == 0
    _shim_case(torch_cuda, [8, 4096, 8192], 30)


def test_vllm_shim_dedicated_stream(torch_cuda):
    s = torch_cuda.cuda.Stream()
    with torch_cuda.cuda.stream(s):
        _shim_case(torch_cuda, [8, 4096, 8192], 30)


def test_vllm_shim_20000_descriptors(torch_cuda):
    s = torch_cuda.cuda.Stream()
    with torch_cuda.cuda.stream(s):
        _shim_case(torch_cuda, [64], 20_000)


def test_vllm_shim_rejects_wrong_tensors(torch_cuda):
    from kvcopy.compat.vllm import swap_blocks_batch

    t = torch_cuda.zeros(2, dtype=torch_cuda.int64)
    with pytest.raises(TypeError, match="CPU int64"):
        swap_blocks_batch(t.int(), t, t)
    with pytest.raises(TypeError, match="torch.Tensor"):
        swap_blocks_batch([1, 2], t, t)
