"""GPU-to-host copies through the bulk copy unit (sm_90+) on a real GPU: every way
descriptors reach the kernel, spans the unit cannot take (odd sizes and
addresses, which go through registers inside the same launch), one CTA reusing
its ring many times, graph replay, and stream order with the work after it.
Where the GPU has no bulk copy unit the same copies run on the register copier
and must be as exact. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from helpers.gpu import address, expected_after, host_bytes, make_pool, ordered_stream
from kvcopy.policy import BULK_MAX_BYTES, BULK_MIN_BYTES


def has_bulk_unit(torch) -> bool:
    return torch.cuda.get_device_capability() >= (9, 0)


def expected_variant(torch, sizes, bulk_stores: bool = True) -> str:
    """The copier a GPU-to-host batch of these sizes should get (policy.kernel_variant)."""
    in_window = BULK_MIN_BYTES <= float(np.mean(sizes)) <= BULK_MAX_BYTES
    return "bulk" if bulk_stores and has_bulk_unit(torch) and in_window else "registers"


def slots(count: int, slot: int, rng, odd: bool) -> np.ndarray:
    """Offsets of ``count`` distinct slots of ``slot`` bytes (a multiple of 16) in a pool
    of twice as many: 16-byte aligned, or (``odd``) moved by 1-15 bytes each."""
    offsets = rng.permutation(2 * count)[:count].astype(np.int64) * slot
    return offsets + rng.integers(1, 16, count) if odd else offsets


def copy_to_host(torch, count, sizes, *, odd=False, seed=0, **options):
    """Copy scattered GPU ranges to pinned host memory (16-byte aligned unless ``odd``),
    check every destination byte, and return the decision."""
    rng = np.random.default_rng(seed)
    sizes = np.broadcast_to(np.asarray(sizes, dtype=np.int64), (count,)).copy()
    slot = (int(sizes.max()) + 16 + 15) // 16 * 16
    pool_bytes = 2 * count * slot
    src, dst = make_pool("cuda", pool_bytes, seed), make_pool("pinned", pool_bytes, seed + 1)
    src_before, dst_before = host_bytes(src), host_bytes(dst)
    src_off, dst_off = slots(count, slot, rng, odd), slots(count, slot, rng, odd)
    stream = torch.cuda.Stream()
    used = kvcopy.copy_batch(address(src) + src_off, address(dst) + dst_off, sizes, stream=stream, **options)
    decision = kvcopy.last_decision()
    torch.cuda.synchronize()
    assert used == "kernel"
    np.testing.assert_array_equal(
        host_bytes(dst), expected_after(src_before, dst_before, src_off, dst_off, sizes)
    )
    return decision


CASES = {  # count, sizes, addresses moved off 16 bytes
    "3 tiles split over warps": (3, 16384, False),
    "16 by value (tiny)": (16, 16384, False),
    "200 mixed by value": (200, "mixed16", False),
    "1000 by value": (1000, 16384, False),
    "5000 as pairs, read in place": (5000, 16384, False),
    "3000 multi-tile, uploaded": (3000, "multi", False),
    "2 KiB pairs (below the window)": (20000, 2048, False),
    "256 KiB (above the window)": (64, 256 << 10, False),
    "odd sizes": (300, "odd", False),
    "odd addresses": (2000, 16384, True),
}


def _sizes(kind, count, seed):
    rng = np.random.default_rng(seed)
    if kind == "mixed16":
        return rng.integers(1, 4096, count) * 16
    if kind == "multi":
        return rng.integers(1, 40_000 // 16, count) * 16
    if kind == "odd":
        return rng.integers(1, 70_000, count)
    return kind


@pytest.mark.parametrize("bulk_stores", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_to_host_batches_are_exact_on_either_copier(torch_cuda, monkeypatch, case, bulk_stores):
    kvcopy.config.bulk_stores = bulk_stores
    count, kind, odd = CASES[case]
    sizes = np.broadcast_to(_sizes(kind, count, count), (count,))
    decision = copy_to_host(torch_cuda, count, sizes, odd=odd, seed=count, method="kernel")
    assert decision.variant == expected_variant(torch_cuda, sizes, bulk_stores)


def test_auto_takes_the_bulk_copier_where_the_gpu_has_one(torch_cuda):
    decision = copy_to_host(torch_cuda, 4096, 16384)
    assert decision.method == "kernel"
    assert decision.variant == expected_variant(torch_cuda, [16384])


@pytest.mark.parametrize("ctas", [1, 3])
def test_few_ctas_cycle_their_rings_many_times(torch_cuda, ctas):
    """One or three CTAs of two warps over 6000 copies: each ring stage is refilled
    hundreds of times, so every mbarrier phase and every wait on a store's read of
    its buffer is exercised."""
    copy_to_host(torch_cuda, 6000, 16384, seed=5, max_ctas=ctas)
    copy_to_host(torch_cuda, 700, 40_000 // 16 * 16, seed=6, max_ctas=ctas)


def test_work_after_the_copy_on_its_stream_sees_every_byte(torch_cuda):
    """A load back to the GPU enqueued right behind the store, on the same stream,
    must read what the store wrote to host memory (its bulk stores are complete when
    the kernel ends), over many rounds."""
    torch = torch_cuda
    n, block = 2048, 16384
    gpu_a = torch.empty(n * block, dtype=torch.uint8, device="cuda")
    gpu_b = torch.empty_like(gpu_a)
    host = torch.empty(n * block, dtype=torch.uint8, pin_memory=True)
    stream = ordered_stream(torch)
    order = np.random.default_rng(1).permutation(n).astype(np.int64) * block
    sizes = np.full(n, block)
    for round_ in range(20):
        with torch.cuda.stream(stream):
            gpu_a.random_(0, 256)
            gpu_b.zero_()
        kvcopy.copy_batch(
            gpu_a.data_ptr() + order, host.data_ptr() + order[::-1].copy(), sizes, stream=stream
        )
        kvcopy.copy_batch(
            host.data_ptr() + order[::-1].copy(), gpu_b.data_ptr() + order, sizes, stream=stream
        )
        stream.synchronize()
        assert torch.equal(gpu_a, gpu_b), f"round {round_}"


def test_a_captured_bulk_copy_replays_with_new_bytes(torch_cuda):
    torch = torch_cuda
    n, block = 600, 16384
    src = make_pool("cuda", 2 * n * block, 21)
    dst = make_pool("pinned", 2 * n * block, 22)
    rng = np.random.default_rng(4)
    src_off = rng.permutation(2 * n)[:n].astype(np.int64) * block
    dst_off = rng.permutation(2 * n)[:n].astype(np.int64) * block
    sizes = np.full(n, block)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        kvcopy.copy_batch(src.data_ptr() + src_off, dst.data_ptr() + dst_off, sizes, stream=stream)
    assert kvcopy.last_decision().variant == expected_variant(torch, [block])
    for seed in (31, 32):
        src.random_(0, 256, generator=torch.Generator("cuda").manual_seed(seed))
        torch.cuda.synchronize()
        src_now, dst_before = host_bytes(src), host_bytes(dst)
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(
            host_bytes(dst), expected_after(src_now, dst_before, src_off, dst_off, sizes)
        )
