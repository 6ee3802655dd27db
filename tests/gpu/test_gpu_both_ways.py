"""copy_both_ways on a real GPU (a store and a load at once, one launch or two DMA
streams), and small batches whose tiles the kernel splits over many warps: every
destination byte checked. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from helpers.gpu import address, expected_after, host_bytes, make_pool, scattered, ordered_stream

MiB = 1 << 20


class Side:
    """A scattered batch between two fresh pools, and the bytes it must leave."""

    def __init__(self, src_kind: str, dst_kind: str, count: int, sizes, seed: int, align: int = 1) -> None:
        rng = np.random.default_rng(seed)
        sizes = np.broadcast_to(np.asarray(sizes, dtype=np.int64), (count,))
        pool = max(int((sizes.max() + align) * count * 2), 1 << 16)
        self.src, self.dst = make_pool(src_kind, pool, seed), make_pool(dst_kind, pool, seed + 1)
        self.src_before, self.dst_before = host_bytes(self.src), host_bytes(self.dst)
        self.src_off, self.sizes = scattered(count, sizes, pool, rng, align)
        self.dst_off, _ = scattered(count, sizes, pool, rng, align)

    def triple(self) -> tuple:
        return (address(self.src) + self.src_off, address(self.dst) + self.dst_off, self.sizes)

    def check(self) -> None:
        np.testing.assert_array_equal(
            host_bytes(self.dst),
            expected_after(self.src_before, self.dst_before, self.src_off, self.dst_off, self.sizes),
        )

    def unchanged(self) -> None:
        np.testing.assert_array_equal(host_bytes(self.dst), self.dst_before)


@pytest.mark.parametrize("size, count", [(2048, 3000), (16384, 512), (16384, 7), (100_000, 40), (5000, 2)])
def test_store_and_load_by_the_kernel(torch_cuda, size, count):
    store = Side("cuda", "pinned", count, size, 1, align=13)
    load = Side("pinned", "cuda", count + 5, size, 2, align=7)
    stream = torch_cuda.cuda.Stream()
    ran = kvcopy.copy_both_ways(store.triple(), load.triple(), stream=stream)
    stream.synchronize()
    assert ran == ("kernel", "kernel")
    store.check()
    load.check()


@pytest.mark.parametrize(
    "size, store_count, load_count, limit",
    [
        (16384, 1000, 1003, 100 * 16384),  # 11 launches: slices of 91 and 92 copies
        (2048, 5000, 300, 1 << 20),  # 10 launches: 500 stores and 30 loads each
        (16384, 3, 2000, 1 << 20),  # 32 launches: only the first 3 with a store
        (4000, 900, 2000, 1 << 20),
    ],
)  # odd sizes
def test_store_and_load_past_launch_bytes_go_as_slices_of_both(
    torch_cuda, size, store_count, load_count, limit
):
    store = Side("cuda", "pinned", store_count, size, 31, align=13)
    load = Side("pinned", "cuda", load_count, size, 32, align=7)
    stream = torch_cuda.cuda.Stream()
    before = kvcopy.config.launch_bytes
    kvcopy.config.launch_bytes = limit
    try:
        ran = kvcopy.copy_both_ways(store.triple(), load.triple(), stream=stream)
    finally:
        kvcopy.config.launch_bytes = before
    stream.synchronize()
    assert ran == ("kernel", "kernel")
    store.check()
    load.check()


@pytest.mark.parametrize("size, count", [(200_000, 40), (131072, 150), (300_001, 70)])
def test_store_and_load_of_128_kib_and_more_by_copy_engines_in_chunks(torch_cuda, size, count):
    store = Side("cuda", "pinned", count, size, 16, align=13)
    load = Side("pinned", "cuda", count + 9, size, 17, align=7)  # sides end in other chunks
    stream = torch_cuda.cuda.Stream()
    ran = kvcopy.copy_both_ways(store.triple(), load.triple(), stream=stream)
    stream.synchronize()
    assert ran == ("batch", "batch")
    assert kvcopy.last_decision().method == "batch"
    store.check()
    load.check()


@pytest.mark.parametrize("size, expected", [(65536, "batch"), (32768, "kernel")])
def test_a_calibrated_crossover_moves_where_both_go_to_the_engines(torch_cuda, size, expected):
    import dataclasses

    from kvcopy.testing import engine

    device = engine.device

    before = device.thresholds(0)
    # what calibrate() stores on a host whose engines keep up from 64 KiB
    device.set_thresholds(0, dataclasses.replace(before, both_ways_batch_min_bytes=64 << 10))
    try:
        store = Side("cuda", "pinned", 100, size, 18, align=13)
        load = Side("pinned", "cuda", 90, size, 19, align=7)
        stream = torch_cuda.cuda.Stream()
        ran = kvcopy.copy_both_ways(store.triple(), load.triple(), stream=stream)
        stream.synchronize()
    finally:
        device.set_thresholds(0, before)
    assert ran == (expected, expected)
    store.check()
    load.check()


def test_a_single_copy_side_is_one_dma_copy(torch_cuda):
    store = Side("cuda", "pinned", 1, 5000, 14, align=13)
    load = Side("pinned", "cuda", 30, 5000, 15, align=7)
    stream = torch_cuda.cuda.Stream()
    assert kvcopy.copy_both_ways(store.triple(), load.triple(), stream=stream) == ("loop", "kernel")
    stream.synchronize()
    store.check()
    load.check()


def test_large_blocks_go_by_dma_on_two_streams_and_join(torch_cuda):
    torch = torch_cuda
    store = Side("cuda", "pinned", 6, 2 * MiB, 3)
    load = Side("pinned", "cuda", 6, 2 * MiB, 4)
    stream = torch.cuda.Stream()
    ran = kvcopy.copy_both_ways(store.triple(), load.triple(), stream=stream)
    with torch.cuda.stream(stream):
        after = load.dst.clone()  # queued after the call: must see the loaded bytes
    stream.synchronize()
    assert ran == ("batch", "batch")
    store.check()
    load.check()
    np.testing.assert_array_equal(after.cpu().numpy(), host_bytes(load.dst))


@pytest.mark.parametrize("size", [16384, 2 * MiB])
def test_both_start_after_work_queued_on_the_stream(torch_cuda, size):
    torch = torch_cuda
    store = Side("cuda", "pinned", 8, size, 5)
    load = Side("pinned", "cuda", 8, size, 6)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # the fill below runs late
        store.src.fill_(0x5A)
    kvcopy.copy_both_ways(store.triple(), load.triple(), stream=stream)
    stream.synchronize()
    store.src_before = np.full_like(store.src_before, 0x5A)
    store.check()
    load.check()


def test_captured_in_a_graph(torch_cuda):
    torch = torch_cuda
    store = Side("cuda", "pinned", 64, 16384, 7)
    load = Side("pinned", "cuda", 64, 16384, 8)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        ran = kvcopy.copy_both_ways(store.triple(), load.triple(), stream=torch.cuda.current_stream())
    store.unchanged()
    graph.replay()
    torch.cuda.synchronize()
    assert ran == ("kernel", "kernel")
    store.check()
    load.check()


def test_a_bad_load_pointer_writes_nothing_on_either_side(torch_cuda):
    store = Side("cuda", "pinned", 16, 4096, 9)
    load = Side("pinned", "cuda", 16, 4096, 10)
    src, dst, sizes = load.triple()
    src = src.copy()
    src[3] = 0x2A
    with pytest.raises(ValueError, match=r"^load: src_ptrs\[3\]"):
        kvcopy.copy_both_ways(store.triple(), (src, dst, sizes))
    torch_cuda.cuda.synchronize()
    store.unchanged()
    load.unchanged()
    assert kvcopy.copy_both_ways(store.triple(), load.triple()) == ("kernel", "kernel")
    store.check()
    load.check()


def test_an_empty_side_runs_the_other_alone(torch_cuda):
    load = Side("pinned", "cuda", 20, 4096, 11)
    empty = (np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.uint64))
    ran = kvcopy.copy_both_ways(empty, load.triple())
    torch_cuda.cuda.synchronize()
    assert ran == ("none", "kernel")
    load.check()


@pytest.mark.parametrize("method", ["kernel", "batch", "loop"])
def test_explicit_methods(torch_cuda, method):
    store = Side("cuda", "pinned", 32, 30000, 12, align=5)
    load = Side("pinned", "cuda", 32, 30000, 13, align=3)
    stream = torch_cuda.cuda.Stream()
    assert kvcopy.copy_both_ways(store.triple(), load.triple(), stream=stream, method=method) == (
        method,
        method,
    )
    stream.synchronize()
    store.check()
    load.check()


# ---------------------------------------------- small batches: tiles split over warps


@pytest.mark.parametrize("direction", [("pinned", "cuda"), ("cuda", "pinned"), ("cuda", "cuda")])
@pytest.mark.parametrize(
    "count, size", [(1, 16384), (3, 16381), (16, 16384), (5, 1000), (2, 40_000), (40, 777)]
)
@pytest.mark.parametrize("max_ctas", [1, 4, 64])
def test_small_batches_split_over_warps(torch_cuda, direction, count, size, max_ctas):
    side = Side(*direction, count, size, count * 31 + size, align=11)
    stream = torch_cuda.cuda.Stream()
    assert kvcopy.copy_batch(*side.triple(), stream=stream, method="kernel", max_ctas=max_ctas) == "kernel"
    stream.synchronize()
    side.check()


@pytest.mark.parametrize("block", [16384, 262144])
def test_threads_on_their_own_streams(torch_cuda, block):
    """An engine's threads, each storing and loading on a stream of its own, every
    round after a slow fill queued on that stream: each thread's loads land after
    its own fill (side stream forked from its stream) and its stores copy the
    round's bytes; 16 KiB blocks run as one kernel launch, 256 KiB by copy engines
    on the caller's stream and its side stream."""
    import threading

    torch = torch_cuda
    blocks, rounds, threads = 8, 4, 3
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            stream = torch.cuda.Stream()
            gpu_src = torch.empty(2 * blocks * block, dtype=torch.uint8, device="cuda")
            gpu_dst = torch.empty(2 * blocks * block, dtype=torch.uint8, device="cuda")
            host_src = torch.empty(2 * blocks * block, dtype=torch.uint8).pin_memory()
            host_dst = torch.zeros(2 * blocks * block, dtype=torch.uint8).pin_memory()
            slots = [rng.permutation(2 * blocks)[:blocks] * block for _ in range(4)]
            sizes = np.full(blocks, block, dtype=np.uint64)
            store = (
                np.uint64(gpu_src.data_ptr()) + slots[0].astype(np.uint64),
                np.uint64(host_dst.data_ptr()) + slots[1].astype(np.uint64),
                sizes,
            )
            load = (
                np.uint64(host_src.data_ptr()) + slots[2].astype(np.uint64),
                np.uint64(gpu_dst.data_ptr()) + slots[3].astype(np.uint64),
                sizes,
            )
            for r in range(rounds):
                host_src.fill_(100 + 10 * seed + r)
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(20_000_000)
                    gpu_src.fill_(10 * seed + r)
                    gpu_dst.zero_()  # a load issued before this would be erased
                kvcopy.copy_both_ways(store, load, stream=stream)
                stream.synchronize()
                host = host_dst.numpy()
                gpu = gpu_dst.cpu().numpy()
                for at in slots[1]:
                    assert (host[at : at + block] == 10 * seed + r).all(), (seed, r, "store")
                for at in slots[3]:
                    assert (gpu[at : at + block] == 100 + 10 * seed + r).all(), (seed, r, "load")
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(seed,)) for seed in range(1, threads + 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors


@pytest.fixture
def traffic_window():
    """config.traffic_window_ms long enough for a slow machine to stay inside it, the
    default thresholds (whatever a calibration saved) and no traffic noted; all three
    restored after."""
    from kvcopy.testing import engine

    traffic_window = engine.traffic_window
    from kvcopy.testing import engine

    device = engine.device
    from kvcopy.policy import Thresholds

    saved, before = kvcopy.config.traffic_window_ms, device.thresholds(0)
    device.set_thresholds(0, Thresholds())
    kvcopy.config.traffic_window_ms = 60_000
    traffic_window.forget()
    yield
    kvcopy.config.traffic_window_ms = saved
    device.set_thresholds(0, before)
    traffic_window.forget()


def _store_load_store(first: Side, load: Side, then: Side, store_stream, load_stream) -> list:
    """copy_batch of a store, a load and a store, in turn on their streams, waited for:
    the methods that ran."""
    ran = [
        kvcopy.copy_batch(*first.triple(), stream=store_stream),
        kvcopy.copy_batch(*load.triple(), stream=load_stream),
        kvcopy.copy_batch(*then.triple(), stream=store_stream),
    ]
    store_stream.synchronize()
    load_stream.synchronize()
    return ran


@pytest.mark.parametrize("one_stream", [False, True], ids=["two streams", "one stream"])
@pytest.mark.parametrize("block", [256 * 1024, 16384])
def test_copy_batch_each_way_with_a_traffic_window(torch_cuda, traffic_window, block, one_stream):
    """A store and a load as two copy_batch calls on two streams, as engines issue them,
    with config.traffic_window_ms set: from the both-ways crossover (128 KiB) the load,
    issued right after the store, and the next store go to the copy engines; smaller
    blocks keep the kernel, and so do copies on one stream, which never run both at
    once. Every byte checked."""
    store = Side("cuda", "pinned", 64, block, 41)
    load = Side("pinned", "cuda", 64, block, 42)
    s1 = torch_cuda.cuda.Stream()
    s2 = s1 if one_stream else torch_cuda.cuda.Stream()
    ran = _store_load_store(store, load, store, s2, s1)
    both_at_once = block >= 128 * 1024 and not one_stream
    assert ran == (["kernel", "batch", "batch"] if both_at_once else ["kernel"] * 3)
    store.check()
    load.check()


def test_a_small_store_beside_a_large_load_leaves_the_load_on_the_kernel(torch_cuda, traffic_window):
    """A store of 4 blocks of 256 KiB, then a load of 64 on another stream: the store is
    under a quarter of the load's bytes (over long before it), so the load keeps the
    kernel; a store of 64 beside that load goes to the copy engines. Every byte checked."""
    block = 256 * 1024
    small_store = Side("cuda", "pinned", 4, block, 43)
    load, store = Side("pinned", "cuda", 64, block, 44), Side("cuda", "pinned", 64, block, 45)
    ran = _store_load_store(small_store, load, store, torch_cuda.cuda.Stream(), torch_cuda.cuda.Stream())
    assert ran == ["kernel", "kernel", "batch"]
    for side in (small_store, load, store):
        side.check()


def test_swap_blocks_each_way_on_two_streams_as_vllm_offloads(torch_cuda, traffic_window):
    """vLLM's offloading connector: one handler per direction, each calling swap_blocks
    over the layers' tensors on a stream of its own. Blocks of 256 KiB: the first store
    keeps the kernel, the load right after it and the next store go to the copy
    engines (config.traffic_window_ms). Every block checked against torch's gather."""
    torch = torch_cuda
    block, layers = 256 * 1024, 4
    gpu = [torch.randint(0, 256, (64, block), dtype=torch.uint8, device="cuda") for _ in range(layers)]
    host = [torch.randint(0, 256, (96, block), dtype=torch.uint8).pin_memory() for _ in range(layers)]
    # the streams run at once, so no block one side writes is read or written by the
    # other: stores read GPU blocks 0-31 and write host blocks 0-23 and 24-47; the load
    # reads host blocks 48-95 and writes GPU blocks 32-63
    rng = np.random.default_rng(7)
    stores = [
        np.stack([rng.choice(32, 24, replace=False), rng.permutation(24) + 24 * k], axis=1) for k in range(2)
    ]
    load = np.stack([48 + rng.choice(48, 24, replace=False), 32 + rng.permutation(32)[:24]], axis=1)
    expected_host = [h.clone() for h in host]
    expected_gpu = [g.clone() for g in gpu]
    for e, g in zip(expected_host, gpu):
        for m in stores:
            e[torch.from_numpy(m[:, 1])] = g[torch.from_numpy(m[:, 0]).cuda()].cpu()
    for e, h in zip(expected_gpu, host):
        e[torch.from_numpy(load[:, 1]).cuda()] = h[torch.from_numpy(load[:, 0])].cuda()
    store_stream, load_stream = ordered_stream(torch), ordered_stream(torch)
    ran = [
        kvcopy.swap_blocks(gpu, host, stores[0], stream=store_stream),
        kvcopy.swap_blocks(host, gpu, load, stream=load_stream),
        kvcopy.swap_blocks(gpu, host, stores[1], stream=store_stream),
    ]
    torch.cuda.synchronize()
    assert ran == ["kernel", "batch", "batch"]
    for got, want in zip(host + gpu, expected_host + expected_gpu):
        assert torch.equal(got.cpu(), want.cpu())
