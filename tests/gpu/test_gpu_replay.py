"""Small batches replayed from a record (kvcopy._engine.replay), on the GPU.

A decode step's batches repeat in shape with new block ids each step: every
replay must copy its own blocks, check every copy first, and run only where the
full path would have launched the same thing: not on a capturing stream, not
after a setting changed, not where the memory's kinds differ, not where the other
direction's traffic would change the decision.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvcopy
from kvcopy.testing import engine

replay, traffic_window = engine.replay, engine.traffic_window

KiB = 1 << 10
BLOCK = 16 * KiB
POOL_BLOCKS = 256


_baseline = [0]


@pytest.fixture(autouse=True)
def fresh_records():
    replay.forget()
    traffic_window.forget()
    _baseline[0] = replay.replays()
    yield
    replay.forget()
    traffic_window.forget()


def replays() -> int:
    """Batches replayed since the test began (replay.replays() counts for the
    process)."""
    return replay.replays() - _baseline[0]


class Pools:
    """A source and a destination pool of POOL_BLOCKS blocks for one direction."""

    def __init__(self, torch, direction: str, seed: int, block: int = BLOCK) -> None:
        self.torch, self.block = torch, block
        nbytes = POOL_BLOCKS * block
        data = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))
        host = data.pin_memory()
        gpu = data.cuda()
        gpu2 = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        spare = torch.zeros(nbytes, dtype=torch.uint8).pin_memory()
        self.src, self.dst = {"h2d": (host, gpu2), "d2h": (gpu, spare), "d2d": (gpu, gpu2)}[direction]

    def batch(self, rng, count: int):
        """``count`` random distinct blocks to random distinct blocks, no copy
        continuing the one before on both sides (which would be merged, and make
        the batch another shape)."""
        while True:
            s_ids = rng.choice(POOL_BLOCKS, count, replace=False).astype(np.uint64)
            d_ids = rng.choice(POOL_BLOCKS, count, replace=False).astype(np.uint64)
            if not np.any((np.diff(s_ids.astype(np.int64)) == 1) & (np.diff(d_ids.astype(np.int64)) == 1)):
                break
        block = np.uint64(self.block)
        return (
            np.uint64(self.src.data_ptr()) + s_ids * block,
            np.uint64(self.dst.data_ptr()) + d_ids * block,
            np.full(count, self.block, np.uint64),
            s_ids,
            d_ids,
        )

    def check(self, s_ids, d_ids) -> None:
        self.torch.cuda.synchronize()
        src = self.src.cpu().numpy().reshape(POOL_BLOCKS, self.block)
        dst = self.dst.cpu().numpy().reshape(POOL_BLOCKS, self.block)
        np.testing.assert_array_equal(dst[d_ids.astype(np.int64)], src[s_ids.astype(np.int64)])


def recorded(torch, direction: str, seed: int, count: int = 16):
    """Pools, a stream and a generator, after one batch of ``count`` went the full
    path (and was recorded) and copied right."""
    pools = Pools(torch, direction, seed)
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(seed)
    s, d, sizes, s_ids, d_ids = pools.batch(rng, count)
    kvcopy.copy_batch(s, d, sizes, stream=stream)
    pools.check(s_ids, d_ids)
    return pools, stream, rng


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("count", [2, 16, 31, 32, 64, 127])
@pytest.mark.parametrize("method", ["auto", "kernel"])
def test_repeated_small_batches_replay_and_copy_their_own_blocks(torch_cuda, direction, count, method):
    torch = torch_cuda
    pools = Pools(torch, direction, seed=count)
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(count)
    s, d, sizes, s_ids, d_ids = pools.batch(rng, count)
    first = kvcopy.copy_batch(s, d, sizes, stream=stream, method=method)
    decided = kvcopy.last_decision()
    pools.check(s_ids, d_ids)
    assert first == "kernel" and replays() == 0
    for step in range(1, 6):  # new blocks every step, the same shape
        s, d, sizes, s_ids, d_ids = pools.batch(rng, count)
        assert kvcopy.copy_batch(s, d, sizes, stream=stream, method=method) == "kernel"
        assert kvcopy.last_decision() == decided
        assert replays() == step
        pools.check(s_ids, d_ids)


def test_a_replay_checks_every_copy_first(torch_cuda):
    torch = torch_cuda
    pools, stream, rng = recorded(torch, "h2d", seed=5)
    pools.dst.fill_(7)
    for bad, value in ((3, 0), (15, 0x2A000)):
        s, d, sizes, *_ = pools.batch(rng, 16)
        s[bad] = value
        with pytest.raises(ValueError, match=rf"src_ptrs\[{bad}\]"):
            kvcopy.copy_batch(s, d, sizes, stream=stream)
    torch.cuda.synchronize()
    assert bool((pools.dst == 7).all())  # nothing was written
    assert replays() == 0
    s, d, sizes, s_ids, d_ids = pools.batch(rng, 16)
    kvcopy.copy_batch(s, d, sizes, stream=stream)  # and the record still serves
    assert replays() == 1
    pools.check(s_ids, d_ids)


def test_memory_of_another_kind_is_not_replayed(torch_cuda):
    """The same shape with a pageable host side: the full path decides it (by DMA)."""
    pools, stream, rng = recorded(torch_cuda, "h2d", seed=6)
    s, d, sizes, s_ids, d_ids = pools.batch(rng, 16)
    pageable = pools.src.numpy().copy()
    s = np.uint64(pageable.ctypes.data) + s_ids * np.uint64(BLOCK)
    used = kvcopy.copy_batch(s, d, sizes, stream=stream)
    assert used in ("batch", "loop") and replays() == 0
    pools.check(s_ids, d_ids)


def test_a_capturing_stream_is_not_replayed(torch_cuda):
    torch = torch_cuda
    pools, stream, rng = recorded(torch, "h2d", seed=7)
    s, d, sizes, *_ = pools.batch(rng, 16)
    with torch.cuda.stream(stream):
        kvcopy.copy_batch(s, d, sizes, stream=stream)  # a warm-up replayed
    assert replays() == 1
    s, d, sizes, s_ids, d_ids = pools.batch(rng, 16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        assert kvcopy.copy_batch(s, d, sizes, stream=stream) == "kernel"
    assert replays() == 1
    pools.dst.zero_()
    graph.replay()
    pools.check(s_ids, d_ids)


def test_a_setting_changed_is_not_replayed(torch_cuda, monkeypatch):
    pools, stream, rng = recorded(torch_cuda, "h2d", seed=8)
    s, d, sizes, *_ = pools.batch(rng, 16)
    kvcopy.copy_batch(s, d, sizes, stream=stream)
    assert replays() == 1
    kvcopy.config.host_ctas = 1
    s, d, sizes, s_ids, d_ids = pools.batch(rng, 16)
    kvcopy.copy_batch(s, d, sizes, stream=stream)
    assert replays() == 1  # decided again under the new setting
    pools.check(s_ids, d_ids)
    s, d, sizes, *_ = pools.batch(rng, 16)
    kvcopy.copy_batch(s, d, sizes, stream=stream)
    assert replays() == 2


def test_a_batch_the_other_way_would_move_is_never_replayed(torch_cuda):
    """16 x 256 KiB host to GPU: 'auto' gives it to the kernel alone and to the copy
    engines while the other direction copies too (config.traffic_window_ms), so it
    is not recorded, and a store on another stream moves it to the engines."""
    torch = torch_cuda
    block = 256 * KiB
    load = Pools(torch, "h2d", seed=9, block=block)
    store = Pools(torch, "d2h", seed=10, block=block)
    rng = np.random.default_rng(9)
    load_stream, store_stream = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(3):
        s, d, sizes, s_ids, d_ids = load.batch(rng, 16)
        assert kvcopy.copy_batch(s, d, sizes, stream=load_stream) == "kernel"
        torch.cuda.synchronize()
        traffic_window.forget()
    assert replays() == 0
    ss, sd, ssizes, *_ = store.batch(rng, 16)
    kvcopy.copy_batch(ss, sd, ssizes, stream=store_stream)
    s, d, sizes, s_ids, d_ids = load.batch(rng, 16)
    assert kvcopy.copy_batch(s, d, sizes, stream=load_stream) == "batch"
    assert replays() == 0
    load.check(s_ids, d_ids)


def test_a_replayed_load_still_counts_as_traffic(torch_cuda):
    """Replays of a 16 KiB load note their direction as the full path does: a
    256 KiB store on another stream right after is decided as one side of a copy
    both ways (the copy engines)."""
    torch = torch_cuda
    load = Pools(torch, "h2d", seed=11)
    store = Pools(torch, "d2h", seed=12, block=256 * KiB)
    rng = np.random.default_rng(11)
    load_stream, store_stream = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(2):
        s, d, sizes, *_ = load.batch(rng, 127)
        kvcopy.copy_batch(s, d, sizes, stream=load_stream)
    assert replays() == 1
    ss, sd, ssizes, *_ = store.batch(rng, 4)  # 1 MiB against the load's ~2 MiB
    traffic_window.forget()
    s, d, sizes, *_ = load.batch(rng, 127)
    kvcopy.copy_batch(s, d, sizes, stream=load_stream)  # replayed: the only note
    assert replays() == 2
    assert kvcopy.copy_batch(ss, sd, ssizes, stream=store_stream) == "batch"
    torch.cuda.synchronize()


def test_threads_replaying_on_their_own_streams(torch_cuda):
    torch = torch_cuda
    failures: list[BaseException] = []
    pools = [Pools(torch, direction, seed=20 + k) for k, direction in enumerate(("h2d", "d2h", "h2d", "d2d"))]

    def worker(k: int) -> None:
        try:
            stream = torch.cuda.Stream()
            rng = np.random.default_rng(k)
            for _ in range(40):
                s, d, sizes, s_ids, d_ids = pools[k].batch(rng, 16)
                kvcopy.copy_batch(s, d, sizes, stream=stream)
                stream.synchronize()
                pools[k].check(s_ids, d_ids)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(pools))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert replays() == 4 * 39  # all but each thread's first


@pytest.mark.parametrize("stream", [None, 0, 1, 2])
def test_the_default_streams_replay(torch_cuda, stream):
    torch = torch_cuda
    pools = Pools(torch, "h2d", seed=30)
    rng = np.random.default_rng(30)
    torch.cuda.synchronize()
    for step in range(4):
        s, d, sizes, s_ids, d_ids = pools.batch(rng, 16)
        assert kvcopy.copy_batch(s, d, sizes, stream=stream) == "kernel"
        assert replays() == step
        pools.check(s_ids, d_ids)


def test_other_shapes_and_merged_copies_are_told_apart(torch_cuda):
    """A record of 16 copies does not serve 15 copies, nor 16 copies of which two
    continue each other (planned as 15, the same bytes); each gets its own record,
    and the merged one replays with its blocks right."""
    torch = torch_cuda
    pools, stream, rng = recorded(torch, "h2d", seed=40)
    s, d, sizes, s_ids, d_ids = pools.batch(rng, 15)
    kvcopy.copy_batch(s, d, sizes, stream=stream)
    assert replays() == 0
    pools.check(s_ids, d_ids)

    def merged_batch():
        s, d, sizes, s_ids, d_ids = pools.batch(rng, 16)
        while (
            s_ids[3] + 1 >= POOL_BLOCKS
            or d_ids[3] + 1 >= POOL_BLOCKS
            or s_ids[3] + 1 in s_ids
            or d_ids[3] + 1 in d_ids
        ):
            s, d, sizes, s_ids, d_ids = pools.batch(rng, 16)
        s_ids[4], d_ids[4] = s_ids[3] + 1, d_ids[3] + 1  # copy 4 continues copy 3
        s[4], d[4] = s[3] + np.uint64(BLOCK), d[3] + np.uint64(BLOCK)
        return s, d, sizes, s_ids, d_ids

    for expected in (0, 1, 2):
        s, d, sizes, s_ids, d_ids = merged_batch()
        kvcopy.copy_batch(s, d, sizes, stream=stream)
        assert replays() == expected
        pools.check(s_ids, d_ids)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_copy_engine_batches_replay_as_the_callers_copies(torch_cuda, direction):
    """One copy of a whole block by the copy engines (the policy's 'loop'), then the
    same shape with other blocks: each replayed as its own cuMemcpyAsync, every byte
    where it belongs, the decision as the first call's; a bad copy is refused with
    nothing written and the record still serves; pageable memory goes the full way."""
    torch = torch_cuda
    block = 256 * KiB
    pools = Pools(torch, direction, seed=31, block=block)
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(31)
    s, d, sizes, s_ids, d_ids = pools.batch(rng, 1)
    first = kvcopy.copy_batch(s, d, sizes, stream=stream)
    decided = kvcopy.last_decision()
    pools.check(s_ids, d_ids)
    if first != "loop":
        pytest.skip(f"the policy gives one copy of {block} bytes to {first} here")
    for step in range(1, 5):
        s, d, sizes, s_ids, d_ids = pools.batch(rng, 1)
        assert kvcopy.copy_batch(s, d, sizes, stream=stream) == "loop"
        assert kvcopy.last_decision() == decided
        assert replays() == step
        pools.check(s_ids, d_ids)
    s, d, sizes, *_ = pools.batch(rng, 1)
    with pytest.raises(ValueError, match=r"src_ptrs\[0\] is a null pointer"):
        kvcopy.copy_batch(np.zeros(1, np.uint64), d, sizes, stream=stream)
    assert replays() == 4
    if direction == "h2d":
        pageable = pools.src.numpy().copy()
        s, d, sizes, s_ids, d_ids = pools.batch(rng, 1)
        s = np.uint64(pageable.ctypes.data) + s_ids * np.uint64(block)
        kvcopy.copy_batch(s, d, sizes, stream=stream)
        assert replays() == 4
        pools.check(s_ids, d_ids)
