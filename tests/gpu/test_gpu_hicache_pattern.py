"""SGLang HiCache's host pool and its call pattern, with kvcopy doing the copies (GPU).

SGLang keeps its host KV pool in one anonymous mmap registered with
cudaHostRegister in chunks of whole pages (so that no copy spans two
registrations), in a "page_first" layout: each page holds every layer's K and V
back to back, so one layer's pages are a strided view. It backs up all layers
of some GPU pages at once, and loads a prefix back layer by layer on a load
stream, recording an event per layer that the forward pass waits for before it
reads that layer (sglang/srt/mem_cache/pool_host, managers/cache_controller).
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest

import kvcopy
import kvcopy.testing
from helpers.gpu import ordered_stream


LAYERS, PAGES_HOST, PAGES_GPU = 4, 48, 32
PAGE = (16, 8, 128)  # tokens, heads, head dim: 32 KiB of bf16
SLEEP_CYCLES = 100_000_000  # ~50 ms of torch.cuda._sleep


@pytest.fixture
def host_pool(torch_cuda):
    """(pages, layers, K/V, tokens, heads, dim) bf16 in an mmap, registered 8 pages
    at a time through torch's cudart, as SGLang registers it; unregistered after."""
    torch = torch_cuda
    shape = (PAGES_HOST, LAYERS, 2) + PAGE
    page_bytes = LAYERS * 2 * int(np.prod(PAGE)) * 2
    area = mmap.mmap(-1, PAGES_HOST * page_bytes)
    pool = torch.frombuffer(area, dtype=torch.bfloat16).view(shape)
    cudart, base = torch.cuda.cudart(), pool.data_ptr()
    chunks = [
        (base + offset, min(8 * page_bytes, PAGES_HOST * page_bytes - offset))
        for offset in range(0, PAGES_HOST * page_bytes, 8 * page_bytes)
    ]
    for ptr, size in chunks:
        assert int(cudart.cudaHostRegister(ptr, size, 0)) == 0
    yield pool
    torch.cuda.synchronize()
    for ptr, _ in chunks:
        assert int(cudart.cudaHostUnregister(ptr)) == 0
    # (the mmap is left to the collector: pytest still holds the tensor that exports it)


def layer_views(host, layer):
    """One layer's K and V pages of the page-first pool: strided views."""
    return [host[:, layer, 0], host[:, layer, 1]]


def test_back_up_every_layer_then_load_layer_by_layer_behind_events(torch_cuda, host_pool):
    torch = torch_cuda
    gen = torch.Generator(device="cuda").manual_seed(7)
    gpu_k = [
        torch.randn((PAGES_GPU,) + PAGE, device="cuda", generator=gen).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    gpu_v = [
        torch.randn((PAGES_GPU,) + PAGE, device="cuda", generator=gen).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    original = [t.clone() for t in gpu_k + gpu_v]
    backup = np.stack([np.arange(12), 30 + np.arange(12)], axis=1)  # GPU pages -> host pages
    io = ordered_stream(torch)

    # backup: every layer's K and V of 12 pages in one call
    gpu_all = [t for pair in zip(gpu_k, gpu_v) for t in pair]
    host_all = [v for layer in range(LAYERS) for v in layer_views(host_pool, layer)]
    io.wait_stream(torch.cuda.current_stream())
    # (strided views of registered, hence mapped, memory: the kernel reaches them)
    assert kvcopy.swap_blocks(gpu_all, host_all, backup, stream=io) == "kernel"
    io.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(host_pool[30:42, layer, 0].cuda(), original[layer][:12])
        assert torch.equal(host_pool[30:42, layer, 1].cuda(), original[LAYERS + layer][:12])

    # the GPU pages are reused, then the prefix comes back into other pages, layer by
    # layer; the forward pass reads each layer right after its event
    for t in gpu_k + gpu_v:
        t.zero_()
    load = np.stack([30 + np.arange(12), 16 + np.arange(12)], axis=1)
    events = [torch.cuda.Event() for _ in range(LAYERS)]
    compute = torch.cuda.current_stream()
    io.wait_stream(compute)
    with torch.cuda.stream(io):
        torch.cuda._sleep(SLEEP_CYCLES)  # the loads land well after the reads are queued
    for layer in range(LAYERS):
        assert (
            kvcopy.swap_blocks(layer_views(host_pool, layer), [gpu_k[layer], gpu_v[layer]], load, stream=io)
            == "kernel"
        )
        events[layer].record(io)
    seen = []
    for layer in range(LAYERS):
        compute.wait_event(events[layer])
        seen.append((gpu_k[layer][16:28].clone(), gpu_v[layer][16:28].clone()))
    torch.cuda.synchronize()
    for layer, (k, v) in enumerate(seen):
        assert torch.equal(k, original[layer][:12])
        assert torch.equal(v, original[LAYERS + layer][:12])
        assert not gpu_k[layer][:16].any() and not gpu_k[layer][28:].any()  # nothing else


def test_a_store_and_a_load_of_the_page_first_pool_at_once(torch_cuda, host_pool):
    """One step's write-back and prefetch of one layer together (swap_blocks_both_ways)."""
    torch = torch_cuda
    gpu = [torch.randn((PAGES_GPU,) + PAGE, device="cuda").to(torch.bfloat16) for _ in range(2)]
    host_pool[:, 2].copy_(torch.randn((PAGES_HOST, 2) + PAGE).to(torch.bfloat16))
    before_gpu, before_host = [g.clone() for g in gpu], host_pool[:, 2].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    ran = kvcopy.swap_blocks_both_ways(
        (gpu, layer_views(host_pool, 2), [[0, 40], [1, 41]]),
        (layer_views(host_pool, 2), gpu, [[5, 20], [6, 21]]),
        stream=s,
    )
    assert ran == ("kernel", "kernel")
    s.synchronize()
    for half in range(2):
        assert torch.equal(host_pool[40:42, 2, half].cuda(), before_gpu[half][0:2])
        assert torch.equal(gpu[half][20:22], before_host[5:7, half].cuda())
        assert torch.equal(gpu[half][:20], before_gpu[half][:20])
        assert torch.equal(host_pool[:40, 2, half], before_host[:40, half])


def test_a_pool_registered_in_many_pieces(torch_cuda):
    """A large host pool is registered a GiB at a time (SGLang's
    SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB): more registrations than kvcopy keeps
    ranges per call. Here 512 pieces of 2 MiB; 4096 scattered 16 KiB blocks each way
    go by the kernel, and every block arrives; the describe pass asks the driver
    about each piece about once (asking once per miss instead would ask hundreds of
    times more)."""
    torch = torch_cuda
    piece, pieces, block, count = 2 << 20, 512, 16 << 10, 4096
    area = mmap.mmap(-1, pieces * piece)
    pool = torch.frombuffer(area, dtype=torch.uint8)
    cudart, base = torch.cuda.cudart(), pool.data_ptr()
    for k in range(pieces):
        assert int(cudart.cudaHostRegister(base + k * piece, piece, 0)) == 0
    try:
        pool.copy_(torch.randint(0, 256, (pieces * piece,), dtype=torch.uint8))
        gpu = torch.zeros(2 * count * block, dtype=torch.uint8, device="cuda")
        rng = np.random.default_rng(11)
        host_slots = rng.permutation(pieces * piece // block)[:count]
        gpu_slots = rng.permutation(2 * count)[:count]
        host_ptrs = np.uint64(base) + host_slots.astype(np.uint64) * np.uint64(block)
        gpu_ptrs = np.uint64(gpu.data_ptr()) + gpu_slots.astype(np.uint64) * np.uint64(block)
        sizes = np.full(count, block, dtype=np.uint64)
        s = torch.cuda.Stream()
        assert kvcopy.copy_batch(host_ptrs, gpu_ptrs, sizes, stream=s) == "kernel"
        s.synchronize()
        host_blocks = pool.view(-1, block)[torch.from_numpy(host_slots)]
        gpu_index = torch.from_numpy(gpu_slots).cuda()
        assert torch.equal(gpu.view(-1, block)[gpu_index].cpu(), host_blocks)
        gpu.view(-1, block)[gpu_index] = gpu.view(-1, block)[gpu_index].flip(1)
        assert kvcopy.copy_batch(gpu_ptrs, host_ptrs, sizes, stream=s) == "kernel"
        s.synchronize()
        assert torch.equal(pool.view(-1, block)[torch.from_numpy(host_slots)], host_blocks.flip(1))
        out = np.zeros((count, 4), dtype=np.uint64)
        for src, dst, host_side in ((host_ptrs, gpu_ptrs, 0), (gpu_ptrs, host_ptrs, 1)):
            result, _, questions = kvcopy.testing.describe_copies_answered(
                np.zeros((0, 5), dtype=np.int64), src, dst, sizes, out.ctypes.data
            )
            assert result.count == count
            assert questions[host_side] <= pieces + 16 and questions[1 - host_side] == 1, questions
    finally:
        torch.cuda.synchronize()
        for k in range(pieces):
            assert int(cudart.cudaHostUnregister(base + k * piece)) == 0
