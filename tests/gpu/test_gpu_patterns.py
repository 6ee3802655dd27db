"""kvcopy under the memory and call patterns of the projects that use it (GPU).

- allocations lying back to back (cuda.core's pinned resource and device pool,
  torch, separate registrations): DMA must not merge copies across them;
- warm-up, then capture (what serving engines do), in torch's global capture
  mode and in a driver capture on a cuda.core stream, replayed with new bytes
  and after the descriptor ring has been reused;
- a raw-pointer batch block by block over 160 layer tensors per side: every block
  right, and the driver asked about each tensor a few times, not once per copy;
- bogus host addresses: a ValueError naming the copy, never a dead process;
- ordering: TransferQueue waits for the caller's work whatever describes the
  memory, ``after=`` events and streams, array-interface and DLPack producers
  with work still pending;
- vLLM's current swap_blocks_batch signature.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import kvcopy
import kvcopy.testing
from helpers.gpu import jax_gpu, make_pool, ordered_stream
from helpers.child import run_child

KiB = 1 << 10
DIRECTIONS = ("h2d", "d2h", "d2d")
METHODS = ("auto", "batch", "loop", "kernel")
SLEEP_CYCLES = 200_000_000  # ~0.1 s of torch.cuda._sleep: far longer than any launch here


# ------------------------------------------------------------------ adjacent allocations


def _core():
    core = pytest.importorskip("cuda.core")
    try:
        from cuda.core import LegacyPinnedMemoryResource
    except ImportError:
        from cuda.core.experimental import LegacyPinnedMemoryResource
    return core, LegacyPinnedMemoryResource


def _back_to_back(allocate, count: int, size: int, tries: int = 64) -> list:
    """``count`` buffers from ``allocate(size)`` that lie back to back (kept alive)."""
    held = []
    for _ in range(tries):
        held.append(allocate(size))
        ptrs = [int(b.handle) for b in held[-count:]]
        if len(ptrs) == count and all(ptrs[i + 1] == ptrs[i] + size for i in range(count - 1)):
            return held[-count:]
    pytest.skip(f"no {count} back-to-back buffers of {size} bytes in {tries} allocations")


def _host_view(ptr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


@pytest.fixture(scope="module")
def adjacent_buffers(torch_cuda_module):
    """Four pinned (cuda.core LegacyPinnedMemoryResource) and four device (cuda.core pool)
    buffers of 4 KiB, each set lying back to back, and a torch device pool for d2d."""
    core, Pinned = _core()
    dev = core.Device(0)
    dev.set_current()
    stream = dev.create_stream()
    pinned = Pinned()
    n, size = 4, 4 * KiB
    host = _back_to_back(lambda s: pinned.allocate(s, stream=stream), n, size)
    device = _back_to_back(lambda s: dev.allocate(s, stream=stream), n, size)
    device2 = _back_to_back(lambda s: dev.allocate(s, stream=stream), n, size)
    stream.sync()
    yield dict(
        stream=stream,
        host=[int(b.handle) for b in host],
        device=[int(b.handle) for b in device],
        device2=[int(b.handle) for b in device2],
        size=size,
        keep=(host, device, device2),
    )


@pytest.fixture(scope="module")
def torch_cuda_module():
    import torch

    torch.cuda.init()
    return torch


def _read_device(ptr: int, nbytes: int) -> np.ndarray:
    from cuda.bindings import driver

    out = np.empty(nbytes, np.uint8)
    (err,) = driver.cuMemcpyDtoH(out.ctypes.data, ptr, nbytes)
    assert int(err) == 0, err
    return out


def _write_device(ptr: int, data: np.ndarray) -> None:
    from cuda.bindings import driver

    (err,) = driver.cuMemcpyHtoD(ptr, data.ctypes.data, data.nbytes)
    assert int(err) == 0, err


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_copies_are_not_merged_across_back_to_back_allocations(adjacent_buffers, direction, method):
    b = adjacent_buffers
    size, n = b["size"], len(b["host"])
    src_ptrs, dst_ptrs = {
        "h2d": (b["host"], b["device"]),
        "d2h": (b["device"], b["host"]),
        "d2d": (b["device"], b["device2"]),
    }[direction]
    data = np.random.default_rng(hash((direction, method)) % 2**32).integers(0, 256, n * size, dtype=np.uint8)
    zeros = np.zeros(n * size, np.uint8)
    for write, ptrs in ((data, src_ptrs), (zeros, dst_ptrs)):
        for i, ptr in enumerate(ptrs):  # one allocation at a time: no copy may span two
            part = write[i * size : (i + 1) * size]
            if ptrs is b["host"]:
                _host_view(ptr, size)[:] = part
            else:
                _write_device(ptr, np.ascontiguousarray(part))
    used = kvcopy.copy_batch(src_ptrs, dst_ptrs, [size] * n, stream=b["stream"], method=method)
    b["stream"].sync()
    got = np.concatenate(
        [_host_view(p, size).copy() if dst_ptrs is b["host"] else _read_device(p, size) for p in dst_ptrs]
    )
    assert used in ("kernel", "batch", "loop")
    np.testing.assert_array_equal(got, data)


@pytest.mark.parametrize("method", METHODS)
def test_separate_registrations_back_to_back(torch_cuda, method):
    """Two halves of one host array registered separately, then copied as adjacent blocks."""
    torch = torch_cuda
    block, n = 64 * KiB, 8
    host = np.zeros(2 * n * block, np.uint8)  # page-aligned halves: 8 blocks of 64 KiB each
    base = host.ctypes.data + (-host.ctypes.data) % 4096
    span = n * block
    region = _host_view(base, span)
    with kvcopy.register(region[: span // 2]), kvcopy.register(region[span // 2 :]):
        gpu = torch.randint(0, 256, (span,), dtype=torch.uint8, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())  # (torch's streams do not wait for the default one)
        kvcopy.copy_batch(
            gpu.data_ptr() + np.arange(n) * block,
            base + np.arange(n) * block,
            np.full(n, block),
            stream=s,
            method=method,
        )
        s.synchronize()
        np.testing.assert_array_equal(region, gpu.cpu().numpy())


def test_separate_torch_pinned_tensors_every_method(torch_cuda):
    torch = torch_cuda
    parts = [torch.randint(0, 256, (16 * KiB,), dtype=torch.uint8).pin_memory() for _ in range(4)]
    gpu = torch.zeros(64 * KiB, dtype=torch.uint8, device="cuda")
    s = ordered_stream(torch)
    for method in METHODS:
        gpu.zero_()
        torch.cuda.synchronize()
        kvcopy.copy_batch(
            [p.data_ptr() for p in parts],
            gpu.data_ptr() + np.arange(4) * 16 * KiB,
            [16 * KiB] * 4,
            stream=s,
            method=method,
        )
        s.synchronize()
        assert torch.equal(gpu.cpu(), torch.cat(parts)), method


def test_raw_pointers_block_by_block_over_160_layer_tensors(torch_cuda):
    """A raw-pointer batch built block by block over every layer's K and V (80 layers:
    160 pinned tensors and 160 GPU tensors, 8 blocks of 16 KiB each): every block
    arrives both ways by the kernel, and the describe pass asks the driver about each
    tensor a few times at most, not once per copy (as with the 64 ranges kept
    before)."""
    torch = torch_cuda
    tensors, blocks, block = 160, 8, 16 * KiB
    host = [
        torch.randint(0, 256, (2 * blocks * block,), dtype=torch.uint8).pin_memory() for _ in range(tensors)
    ]
    gpu = [torch.zeros(2 * blocks * block, dtype=torch.uint8, device="cuda") for _ in range(tensors)]
    rng = np.random.default_rng(5)
    slots = [
        (rng.permutation(2 * blocks)[:blocks], rng.permutation(2 * blocks)[:blocks]) for _ in range(tensors)
    ]
    host_ptrs = np.array(
        [host[t].data_ptr() + int(slots[t][0][b]) * block for b in range(blocks) for t in range(tensors)],
        dtype=np.uint64,
    )
    gpu_ptrs = np.array(
        [gpu[t].data_ptr() + int(slots[t][1][b]) * block for b in range(blocks) for t in range(tensors)],
        dtype=np.uint64,
    )
    sizes = np.full(len(host_ptrs), block, dtype=np.uint64)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # (the zeros are written there)
    assert kvcopy.copy_batch(host_ptrs, gpu_ptrs, sizes, stream=s) == "kernel"
    s.synchronize()
    for t in range(tensors):
        h_idx, g_idx = (torch.from_numpy(x.astype(np.int64)) for x in slots[t])
        assert torch.equal(gpu[t].view(-1, block)[g_idx.cuda()].cpu(), host[t].view(-1, block)[h_idx]), t
    for t in range(tensors):
        gpu[t].view(-1, block)[torch.from_numpy(slots[t][1].astype(np.int64)).cuda()] += 1
    before = [h.clone() for h in host]
    s.wait_stream(torch.cuda.current_stream())  # (the increments are written there)
    assert kvcopy.copy_batch(gpu_ptrs, host_ptrs, sizes, stream=s) == "kernel"
    s.synchronize()
    for t in range(tensors):
        h_idx = torch.from_numpy(slots[t][0].astype(np.int64))
        assert torch.equal(host[t].view(-1, block)[h_idx], (before[t].view(-1, block)[h_idx] + 1)), t
    out = np.zeros((len(sizes), 4), dtype=np.uint64)
    for src, dst in ((host_ptrs, gpu_ptrs), (gpu_ptrs, host_ptrs)):
        result, _, questions = kvcopy.testing.describe_copies_answered(
            np.zeros((0, 5), dtype=np.int64), src, dst, sizes, out.ctypes.data
        )
        assert result.count == len(sizes)
        assert max(questions) <= 3 * tensors, questions


# ------------------------------------------------------------------ capture after warm-up


def _batch(torch, direction: str, count: int, block: int, seed: int):
    src_kind = {"h2d": "pinned", "d2h": "cuda", "d2d": "cuda"}[direction]
    dst_kind = {"h2d": "cuda", "d2h": "pinned", "d2d": "cuda"}[direction]
    src = make_pool(src_kind, 2 * count * block, seed)
    dst = make_pool(dst_kind, 2 * count * block, seed + 1)
    rng = np.random.default_rng(seed)
    s_off = rng.permutation(2 * count)[:count].astype(np.uint64) * np.uint64(block)
    d_off = rng.permutation(2 * count)[:count].astype(np.uint64) * np.uint64(block)
    return (
        src,
        dst,
        np.uint64(src.data_ptr()) + s_off,
        np.uint64(dst.data_ptr()) + d_off,
        np.full(count, block, dtype=np.uint64),
    )


def _check_copied(src, dst, s_ptrs, d_ptrs, block):
    import torch

    torch.cuda.synchronize()
    have, want = dst.cpu().numpy().reshape(-1, block), src.cpu().numpy().reshape(-1, block)
    s_row = ((s_ptrs - np.uint64(src.data_ptr())) // np.uint64(block)).astype(np.int64)
    d_row = ((d_ptrs - np.uint64(dst.data_ptr())) // np.uint64(block)).astype(np.int64)
    np.testing.assert_array_equal(have[d_row], want[s_row])


def _refill(torch, buf, seed):
    fresh = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, buf.numel(), dtype=np.uint8))
    buf.copy_(fresh.to(buf.device) if buf.is_cuda else fresh)
    torch.cuda.synchronize()


def _reuse_the_ring(torch, calls: int = 100):
    """Other calls that take ring slots (large kernel-path batches) between replays."""
    src, dst, s, d, sizes = _batch(torch, "h2d", 4096, 4 * KiB, 77)
    stream = torch.cuda.Stream()
    for _ in range(calls):
        kvcopy.copy_batch(s, d, sizes, stream=stream)
    stream.synchronize()


@pytest.mark.parametrize("count", [600, 1500, 20000])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_warm_up_then_torch_graph_capture(torch_cuda, direction, count):
    torch = torch_cuda
    block = 8 * KiB if count < 20000 else 2 * KiB
    src, dst, s, d, sizes = _batch(torch, direction, count, block, 100 + count)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        warm = kvcopy.copy_batch(s, d, sizes, stream=stream)  # the warm-up call
    _check_copied(src, dst, s, d, block)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # torch's default: global capture mode
        captured = kvcopy.copy_batch(s, d, sizes, stream=stream)
    assert captured in ("kernel", "loop") and warm in ("kernel", "batch", "loop")
    for replay in range(3):
        _refill(torch, src, 1000 + replay)
        graph.replay()
        _check_copied(src, dst, s, d, block)
    _reuse_the_ring(torch)
    _refill(torch, src, 2000)
    graph.replay()
    _check_copied(src, dst, s, d, block)


@pytest.mark.parametrize("count", [600, 1500, 20000])
def test_warm_up_then_driver_capture_on_a_cuda_core_stream(torch_cuda, count):
    core = pytest.importorskip("cuda.core")
    from cuda.bindings import driver

    torch = torch_cuda
    dev = core.Device(0)
    dev.set_current()
    stream = dev.create_stream()
    handle = kvcopy.resolve_stream(stream)
    block = 4 * KiB
    src, dst, s, d, sizes = _batch(torch, "h2d", count, block, 300 + count)
    kvcopy.copy_batch(s, d, sizes, stream=stream)
    stream.sync()
    (err,) = driver.cuStreamBeginCapture(handle, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    assert err == driver.CUresult.CUDA_SUCCESS
    used = kvcopy.copy_batch(s, d, sizes, stream=stream)
    err, graph = driver.cuStreamEndCapture(handle)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    assert used in ("kernel", "loop")
    err, exe = driver.cuGraphInstantiate(graph, 0)
    assert err == driver.CUresult.CUDA_SUCCESS
    try:
        for replay in range(3):
            _refill(torch, src, 3000 + replay)
            (err,) = driver.cuGraphLaunch(exe, handle)
            assert err == driver.CUresult.CUDA_SUCCESS
            stream.sync()
            _check_copied(src, dst, s, d, block)
        _reuse_the_ring(torch)
        _refill(torch, src, 4000)
        driver.cuGraphLaunch(exe, handle)
        stream.sync()
        _check_copied(src, dst, s, d, block)
    finally:
        driver.cuGraphExecDestroy(exe)
        driver.cuGraphDestroy(graph)


# ------------------------------------------------------------------ bogus host addresses

BOGUS_CHILD = r"""
import json, mmap, numpy as np, torch, kvcopy
h = torch.randint(0, 256, (8192,), dtype=torch.uint8).pin_memory()
d = torch.zeros(8192, dtype=torch.uint8, device="cuda")
s = torch.cuda.Stream()
ro = mmap.mmap(-1, 8192, prot=mmap.PROT_READ)
ro_ptr = np.frombuffer(ro, np.uint8).ctypes.data
import ctypes
assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(ro_ptr + 4096), 4096, 0) == 0   # 2nd page: no access
out = {}
cases = {
    "src": ([h.data_ptr(), 42], [d.data_ptr(), d.data_ptr() + 4096], "auto"),
    "src_loop": ([h.data_ptr(), 42], [d.data_ptr(), d.data_ptr() + 4096], "loop"),
    "src_batch": ([h.data_ptr(), 42], [d.data_ptr(), d.data_ptr() + 4096], "batch"),
    "dst": ([d.data_ptr(), d.data_ptr() + 4096], [h.data_ptr(), 0x10], "auto"),
    "readonly_dst": ([d.data_ptr()], [ro_ptr], "auto"),
    "unmapped_tail": ([h.data_ptr(), ro_ptr], [d.data_ptr(), d.data_ptr() + 4096], "auto"),
}
sizes = {"unmapped_tail": [4096, 8192]}
for name, (src, dst, method) in cases.items():
    try:
        kvcopy.copy_batch(src, dst, sizes.get(name, [4096] * len(src)), stream=s, method=method)
        s.synchronize()
        out[name] = "no error"
    except ValueError as e:
        out[name] = str(e)
kvcopy.copy_batch([h.data_ptr()], [d.data_ptr()], [8192], stream=s)
s.synchronize()
out["after"] = bool(torch.equal(d.cpu(), h))
print(json.dumps(out))
"""


def test_bogus_host_addresses_raise_value_error_naming_the_copy(torch_cuda):
    res = run_child(BOGUS_CHILD)
    for case in ("src", "src_loop", "src_batch"):
        assert res[case].startswith("src_ptrs[1] = 0x2a") and "not readable" in res[case], res
    assert res["dst"].startswith("dst_ptrs[1] = 0x10") and "not writable" in res["dst"], res
    assert res["readonly_dst"].startswith("dst_ptrs[0]") and "not writable" in res["readonly_dst"]
    assert res["unmapped_tail"].startswith("src_ptrs[1]"), res  # its second page has no access
    assert res["after"] is True


def test_pageable_memory_still_copies_and_merges(torch_cuda):
    torch = torch_cuda
    host = np.random.default_rng(8).integers(0, 256, 64 * KiB, dtype=np.uint8)
    gpu = torch.zeros(64 * KiB, dtype=torch.uint8, device="cuda")
    s = ordered_stream(torch)
    for method in ("auto", "batch", "loop"):
        gpu.zero_()
        torch.cuda.synchronize()
        used = kvcopy.copy_batch(
            host.ctypes.data + np.arange(16) * 4 * KiB,
            gpu.data_ptr() + np.arange(16) * 4 * KiB,
            [4 * KiB] * 16,
            stream=s,
            method=method,
        )
        s.synchronize()
        assert used in ("batch", "loop")
        np.testing.assert_array_equal(gpu.cpu().numpy(), host)


# ------------------------------------------------------------------ TransferQueue ordering


def _device_cache(torch, blocks: int, block: int, how: str):
    """A device cache the queue sees as ``how``: a torch tensor, a BlockView of raw
    device memory, or a cuda.core Buffer; and a torch view of the same bytes."""
    backing = torch.zeros(blocks * block, dtype=torch.uint8, device="cuda")
    if how == "torch":
        return backing.view(blocks, block), backing
    if how == "block_view":
        return kvcopy.block_view(backing.data_ptr(), block, num_blocks=blocks), backing
    core, _ = _core()
    buf = core.Buffer.from_handle(backing.data_ptr(), backing.numel())
    return buf, backing


@pytest.mark.parametrize("how", ["torch", "block_view", "cuda_core"])
def test_store_waits_for_the_callers_writes(torch_cuda, how):
    torch = torch_cuda
    blocks, block = 16, 16 * KiB
    cache, backing = _device_cache(torch, blocks, block, how)
    host = kvcopy.pinned_empty((blocks, block), np.uint8)  # no framework on either side
    host[:] = 0
    with kvcopy.TransferQueue(cache, host) as store:
        torch.cuda._sleep(SLEEP_CYCLES)  # the caller's compute, still running ...
        backing.fill_(7)  # ... then writes the blocks
        store.submit("store", [[b, b] for b in range(blocks)])
        store.wait()
    assert (host == 7).all()


@pytest.mark.parametrize("how", ["torch", "block_view", "cuda_core"])
def test_load_waits_for_queued_readers_of_the_blocks(torch_cuda, how):
    torch = torch_cuda
    blocks, block = 16, 16 * KiB
    cache, backing = _device_cache(torch, blocks, block, how)
    backing.fill_(3)
    host = kvcopy.pinned_empty((blocks, block), np.uint8)
    host[:] = 9
    with kvcopy.TransferQueue(host, cache) as load:
        torch.cuda._sleep(SLEEP_CYCLES)  # queued work that still reads the blocks
        seen = backing.clone()
        load.submit("load", [[b, b] for b in range(blocks)])
        load.wait()
    torch.cuda.synchronize()
    assert bool((seen == 3).all()), "the load overwrote blocks queued work still read"
    assert bool((backing == 9).all())


@pytest.mark.parametrize("kind", ["torch_event", "torch_stream", "cupy_event", "core_event", "list"])
def test_submit_after_events_and_streams(torch_cuda, kind):
    torch = torch_cuda
    blocks, block = 8, 16 * KiB
    cache = torch.zeros((blocks, block), dtype=torch.uint8, device="cuda")
    host = torch.zeros((blocks, block), dtype=torch.uint8).pin_memory()
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(SLEEP_CYCLES)
        cache.fill_(5)
    if kind == "torch_event":
        after = torch.cuda.Event()
        after.record(producer)
    elif kind == "torch_stream":
        after = producer
    elif kind == "cupy_event":
        cupy = pytest.importorskip("cupy")
        after = cupy.cuda.Event()
        after.record(cupy.cuda.ExternalStream(producer.cuda_stream))
    elif kind == "core_event":
        core, _ = _core()
        dev = core.Device(0)
        dev.set_current()
        after = dev.create_stream(producer).record()
    else:
        after = [torch.cuda.current_stream(), producer]
    with kvcopy.TransferQueue(cache, host) as store:
        store.submit("s", [[b, b] for b in range(blocks)], after=after)
        store.wait()
    assert bool((host == 5).all())


def test_submit_after_rejects_what_is_neither_stream_nor_event(torch_cuda):
    cache = torch_cuda.zeros((4, 1024), dtype=torch_cuda.uint8, device="cuda")
    host = torch_cuda.zeros((4, 1024), dtype=torch_cuda.uint8).pin_memory()
    with kvcopy.TransferQueue(cache, host) as q:
        with pytest.raises(TypeError, match=r"after\[1\]"):
            q.submit("x", [[0, 0]], after=[1, "soon"])
        assert q.poll() == []


# ------------------------------------------------------------------ producers with pending work


def test_cuda_array_interface_producer_stream_is_waited_for(torch_cuda):
    cupy = pytest.importorskip("cupy")
    torch = torch_cuda
    producer = cupy.cuda.Stream(non_blocking=True)
    gpu = cupy.zeros((16, 16 * KiB), dtype=cupy.uint8)
    with producer:  # pending work on CuPy's current stream, exported in __cuda_array_interface__
        with torch.cuda.stream(torch.cuda.ExternalStream(producer.ptr)):
            torch.cuda._sleep(SLEEP_CYCLES)
        gpu.fill(11)
        host = kvcopy.pinned_empty((16, 16 * KiB), np.uint8)
        host[:] = 0
        consumer = torch.cuda.Stream()
        kvcopy.swap_blocks(gpu, host, [[b, b] for b in range(16)], stream=consumer)
    consumer.synchronize()
    assert (host == 11).all()


def test_queue_waits_for_an_array_interface_producer_even_after_nothing(torch_cuda):
    """after=[] drops the caller's stream, never what the protocol requires: the
    stream CuPy declares in __cuda_array_interface__ still holds the store back."""
    cupy = pytest.importorskip("cupy")
    torch = torch_cuda
    producer = cupy.cuda.Stream(non_blocking=True)
    gpu = cupy.zeros((16, 16 * KiB), dtype=cupy.uint8)
    host = kvcopy.pinned_empty((16, 16 * KiB), np.uint8)
    host[:] = 0
    with producer:
        with kvcopy.TransferQueue(gpu, host) as store:
            with torch.cuda.stream(torch.cuda.ExternalStream(producer.ptr)):
                torch.cuda._sleep(SLEEP_CYCLES)
            gpu.fill(13)
            store.submit("s", [[b, 15 - b] for b in range(16)], after=[])
            (result,) = store.wait()
    assert result.ok, result.error
    assert (host == 13).all()


def test_dlpack_producer_with_pending_work_jax(torch_cuda):
    jax, gpu = jax_gpu()
    jnp = jax.numpy
    a = jax.device_put(jnp.ones((4096, 4096), jnp.float32), gpu)
    for _ in range(30):  # slow work, not waited for (no block_until_ready)
        a = (a @ a) / 4096.0
    src = (a * 0 + 6.0).reshape(64, -1)
    dst = torch_cuda.zeros((64, src.shape[1]), dtype=torch_cuda.float32, device="cuda")
    consumer = torch_cuda.cuda.Stream()
    kvcopy.swap_blocks(src, dst, [[b, b] for b in range(64)], stream=consumer)
    consumer.synchronize()
    assert bool((dst == 6.0).all())


def test_dlpack_producer_under_capture_jax(torch_cuda):
    """A JAX source in a captured swap_blocks: JAX is handed a stream that does not
    capture (its wait for its own work on the capturing one ends the capture; it
    refuses DLPack's -1), and the replay copies the array's bytes."""
    torch = torch_cuda
    jax, gpu = jax_gpu()
    jnp = jax.numpy
    src = jax.device_put(jnp.arange(64 * 1024, dtype=jnp.float32).reshape(64, 1024), gpu)
    src.block_until_ready()
    dst = torch.zeros((64, 1024), dtype=torch.float32, device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        kvcopy.swap_blocks(src, dst, [[b, 63 - b] for b in range(64)], stream=stream)
    assert not dst.any()  # (nothing ran during capture)
    graph.replay()
    torch.cuda.synchronize()
    want = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024).flip(0)
    assert torch.equal(dst.cpu(), want)


# ------------------------------------------------------------------ vLLM's signature


def test_vllm_shim_use_batch_api(torch_cuda):
    torch = torch_cuda
    from kvcopy.compat.vllm import swap_blocks_batch

    block, n = 1 << 20, 8  # large blocks: auto would take batched DMA
    src = torch.randint(0, 256, (n * block,), dtype=torch.uint8).pin_memory()
    dst = torch.zeros(n * block, dtype=torch.uint8, device="cuda")
    ptrs_s = torch.tensor([src.data_ptr() + i * block for i in range(n)][::-1], dtype=torch.int64)
    ptrs_d = torch.tensor([dst.data_ptr() + i * block for i in range(n)], dtype=torch.int64)
    sizes = torch.full((n,), block, dtype=torch.int64)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        swap_blocks_batch(ptrs_s, ptrs_d, sizes, False, True)
        assert kvcopy.last_decision().method == "batch"
        dst.zero_()
        swap_blocks_batch(ptrs_s, ptrs_d, sizes, is_src_access_order_any=True, use_batch_api=False)
        assert kvcopy.last_decision().method != "batch"
    s.synchronize()
    want = src.view(n, block).flip(0)
    assert torch.equal(dst.view(n, block).cpu(), want)
