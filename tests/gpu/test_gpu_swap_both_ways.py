"""swap_blocks_both_ways on a real GPU: a store from a GPU cache to a host cache and a
load back at once, as a serving engine's step issues them (vLLM's layers of K and V
views, LMCache's host pool of pinned blocks). Every check compares with a reference
gather by torch."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy import testing
from helpers.spies import LayerSpy


def layered(torch, layers: int, blocks: int, block_shape: tuple, on_gpu: bool, seed: int):
    """``layers`` caches of (2, blocks, *block_shape) bf16 (K and V), random bytes,
    on the GPU or in pinned host memory; returned as their 2 * layers K/V views."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    caches = [
        torch.randint(-100, 100, (2, blocks) + block_shape, generator=g, device="cuda").to(torch.bfloat16)
        for _ in range(layers)
    ]
    if not on_gpu:
        caches = [c.cpu().pin_memory() for c in caches]
    return [view for c in caches for view in (c[0], c[1])]


def expected_after(torch, src_views, dst_views, mapping):
    out = [d.clone() for d in dst_views]
    for e, s in zip(out, src_views):
        e[torch.from_numpy(mapping[:, 1]).to(e.device)] = s[torch.from_numpy(mapping[:, 0]).to(s.device)].to(
            e.device
        )
    return out


def assert_equal(torch, got_views, want_views):
    for k, (got, want) in enumerate(zip(got_views, want_views)):
        assert torch.equal(got.cpu(), want.cpu()), f"view {k}"


@pytest.mark.parametrize(
    "block_shape, methods",
    [
        ((16, 128), ("kernel", "kernel")),  # 4 KiB blocks: one launch, descriptors in place
        ((16, 8, 128), ("kernel", "kernel")),  # 32 KiB (vLLM's 16 tokens x 8 heads x 128)
        ((256, 2, 256), ("batch", "batch")),
    ],
)  # 256 KiB: both sides on the copy engines
def test_store_and_load_of_layered_caches_land_every_block(torch_cuda, block_shape, methods):
    torch = torch_cuda
    rng = np.random.default_rng(1)
    gpu_blocks, host_blocks, n = 48, 64, 20
    gpu = layered(torch, 4, gpu_blocks, block_shape, True, 1)
    host = layered(torch, 4, host_blocks, block_shape, False, 2)
    # evict 20 GPU blocks to free host blocks; load 20 other host blocks into other GPU blocks
    gpu_ids = rng.permutation(gpu_blocks)
    host_ids = rng.permutation(host_blocks)
    store_map = np.stack([gpu_ids[:n], host_ids[:n]], axis=1)
    load_map = np.stack([host_ids[n : 2 * n], gpu_ids[n : 2 * n]], axis=1)
    host_want = expected_after(torch, gpu, host, store_map)
    gpu_want = expected_after(torch, host, gpu, load_map)
    stream = torch.cuda.Stream()
    ran = kvcopy.swap_blocks_both_ways((gpu, host, store_map), (host, gpu, load_map), stream=stream)
    stream.synchronize()
    assert ran == methods
    assert_equal(torch, host, host_want)
    assert_equal(torch, gpu, gpu_want)


def test_work_queued_before_on_the_stream_is_stored_and_work_after_sees_the_load(torch_cuda):
    """The store copies what a kernel queued just before wrote; a kernel queued just
    after reads what the load wrote (no synchronisation in between)."""
    torch = torch_cuda
    gpu = layered(torch, 2, 32, (16, 128), True, 3)
    host = layered(torch, 2, 32, (16, 128), False, 4)
    store_map = np.array([[0, 5], [1, 6], [2, 7]])
    load_map = np.array([[10, 20], [11, 21]])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # the GPU is busy while all of it is queued
        for view in gpu:
            view[:3].fill_(7)
        ran = kvcopy.swap_blocks_both_ways((gpu, host, store_map), (host, gpu, load_map))
        after = [view[20:22].clone() for view in gpu]
    stream.synchronize()
    assert ran in (("kernel", "kernel"), ("batch", "batch"))
    for view in host:
        assert bool((view[5:8] == 7).all())
    for got, view in zip(after, host):
        assert torch.equal(got.cpu(), view[10:12])


def test_split_blocks_and_an_empty_side(torch_cuda):
    """GPU blocks twice the host's (vLLM's block_size_factor): ids count sub-blocks on
    the GPU side. An empty load leaves the store alone, reported as 'none'."""
    torch = torch_cuda
    gpu = layered(torch, 2, 16, (32, 128), True, 5)  # 8 KiB blocks
    host = layered(torch, 2, 40, (16, 128), False, 6)  # 4 KiB blocks
    store_map = np.array([[0, 3], [5, 0], [31, 39]])  # GPU sub-blocks 0, 5 and 31
    stream = torch.cuda.Stream()
    ran = kvcopy.swap_blocks_both_ways(
        (gpu, host, store_map), (host, gpu, np.empty((0, 2), np.int64)), stream=stream, split_blocks=True
    )
    stream.synchronize()
    assert ran[1] == "none" and ran[0] in ("kernel", "batch", "loop")
    for g, h in zip(gpu, host):
        halves = g.reshape(32, 16, 128).cpu()
        for sub, dst in store_map:
            assert torch.equal(h[dst], halves[sub])


def test_bad_ids_on_either_side_raise_before_anything_is_copied(torch_cuda):
    torch = torch_cuda
    gpu = layered(torch, 1, 8, (16, 128), True, 7)
    host = layered(torch, 1, 8, (16, 128), False, 8)
    host_before = [h.clone() for h in host]
    gpu_before = [g.clone() for g in gpu]
    with pytest.raises(
        ValueError,
        match=r"^load: block_mapping\[1\]: source block 8 is out "
        r"of range for src\[0\], which has 8 blocks",
    ):
        kvcopy.swap_blocks_both_ways((gpu, host, [[0, 1]]), (host, gpu, [[2, 3], [8, 4]]))
    torch.cuda.synchronize()
    assert_equal(torch, host, host_before)
    assert_equal(torch, gpu, gpu_before)
    # and the library goes on working
    ran = kvcopy.swap_blocks_both_ways((gpu, host, [[0, 1]]), (host, gpu, [[2, 3]]))
    torch.cuda.synchronize()
    assert ran in (("kernel", "kernel"), ("batch", "batch"))
    for g, h in zip(gpu, host):
        assert torch.equal(h[1], g[0].cpu()) and torch.equal(g[3].cpu(), h[2])


@pytest.fixture
def block_launches(monkeypatch, seams):
    """The arguments of every fused block-kernel launch; the per-copy path (every
    block copy described on the CPU) fails the test if it runs."""
    launches: list[tuple] = []
    spy = LayerSpy(
        testing.cuda.launch, ("launch_blocks_both_uploaded",), lambda name, args: launches.append(args)
    )
    seams.enter_context(testing.fake_cuda(spy, ("launch",)))

    def per_copy(*args, **kwargs):
        raise AssertionError("swap_blocks_both_ways described every block copy")

    monkeypatch.setattr(testing.engine.both_ways, "execute_both", per_copy)
    return launches


@pytest.mark.parametrize(
    "store_shape, load_shape, split_blocks",
    [
        ((16, 128), (16, 128), False),  # 4 KiB both ways
        ((16, 8, 128), (16, 8, 128), False),  # 32 KiB, vLLM's 16 tokens x 8 heads x 128
        ((16, 128), (16, 8, 128), False),  # the sides' caches differ: 4 KiB out, 32 KiB in
        ((32, 128), (32, 128), True),
    ],
)  # GPU blocks of two host blocks (sub-block ids)
def test_kernel_sides_go_out_as_one_block_kernel_launch(
    torch_cuda, block_launches, store_shape, load_shape, split_blocks
):
    """Where both sides go to the kernel, they are one launch of the block kernel: the
    GPU computes every block's addresses from the tensor tables and ids."""
    torch = torch_cuda
    rng = np.random.default_rng(2)
    factor = 2 if split_blocks else 1

    def host_shape(shape):  # a host block is one GPU sub-block
        return (shape[0] // factor,) + shape[1:]

    gpu_out = layered(torch, 3, 24, store_shape, True, 11)
    host_in = layered(torch, 3, 40, host_shape(store_shape), False, 12)
    host_out = layered(torch, 2, 40, host_shape(load_shape), False, 13)
    gpu_in = layered(torch, 2, 24, load_shape, True, 14)
    n = 17
    store_map = np.stack([rng.permutation(24 * factor)[:n], rng.permutation(40)[:n]], axis=1)
    load_map = np.stack([rng.permutation(40)[:n], rng.permutation(24 * factor)[:n]], axis=1)

    def sub_blocks(views):  # GPU views as the ids address them
        if not split_blocks:
            return views
        return [v.reshape((v.shape[0] * factor, v.shape[1] // factor) + tuple(v.shape[2:])) for v in views]

    host_want = expected_after(torch, sub_blocks(gpu_out), host_in, store_map)
    gpu_want = expected_after(torch, host_out, sub_blocks(gpu_in), load_map)
    stream = torch.cuda.Stream()
    ran = kvcopy.swap_blocks_both_ways(
        (gpu_out, host_in, store_map), (host_out, gpu_in, load_map), stream=stream, split_blocks=split_blocks
    )
    stream.synchronize()
    assert ran == ("kernel", "kernel")
    assert len(block_launches) == 1
    assert_equal(torch, host_in, host_want)
    assert_equal(torch, sub_blocks(gpu_in), gpu_want)


def test_captured_in_a_graph_after_a_warm_up_call(torch_cuda):
    """Captured after an eager call of the same shapes (what engines do before they
    capture): the capture records the copies and a replay moves the bytes current at
    replay time."""
    torch = torch_cuda
    gpu = layered(torch, 2, 16, (16, 128), True, 15)
    host = layered(torch, 2, 16, (16, 128), False, 16)
    store_map, load_map = np.array([[0, 1], [2, 3]]), np.array([[8, 9], [10, 11]])
    stream = torch.cuda.Stream()
    assert kvcopy.swap_blocks_both_ways((gpu, host, store_map), (host, gpu, load_map), stream=stream) == (
        "kernel",
        "kernel",
    )
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        ran = kvcopy.swap_blocks_both_ways((gpu, host, store_map), (host, gpu, load_map))
    for view in gpu:
        view[[0, 2]] = 5
    for view in host:
        view[[8, 10]] = -3
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    assert ran in (("kernel", "kernel"), ("batch", "batch"))
    for g, h in zip(gpu, host):
        assert bool((h[[1, 3]] == 5).all()) and bool((g[[9, 11]] == -3).all())
