"""Batches past config.launch_bytes go out as several launches, each over a slice of
the described table, in order on the caller's stream: on a real GPU every
destination byte must be right, host to GPU and GPU to host, for 16-byte pairs
and for full descriptors (mixed and odd sizes, odd addresses, copies of
several tiles, whose tiles each slice numbers from 0), with a last slice small
enough to be split over warps; and work queued behind the batch must see all
of it. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from helpers.gpu import address, expected_after, host_bytes, make_pool, ordered_stream


KINDS = {"h2d": ("pinned", "cuda"), "d2h": ("cuda", "pinned")}
CASES = {  # count, sizes, addresses moved off 16 bytes, launch_bytes
    "pairs of 16 KiB, last slice of 3": (1003, 16384, False, 100 * 16384),
    "pairs of 2 KiB": (9000, 2048, False, 1 << 20),
    "16 and 4 KiB, last slice split over warps": (1003, "two", False, 1024000),
    "mixed sizes up to 16 KiB": (2500, "mixed", False, 1 << 20),
    "odd sizes and addresses": (2000, "odd", True, 1 << 20),
    "64 KiB copies of 4 tiles each": (1100, 65536, False, 100 * 65536),
    "several tiles, mixed and odd sizes": (1500, "multi", True, 4 << 20),
}


def _sizes(kind, count: int, rng) -> np.ndarray:
    if kind == "two":  # two block sizes: described as full descriptors, not pairs
        return np.where(np.arange(count) % 2 == 0, 16384, 4096).astype(np.int64)
    if kind == "mixed":
        return rng.integers(1, 1025, count) * 16
    if kind == "odd":
        return rng.integers(1, 16385, count)
    if kind == "multi":  # 1 to 5 tiles each: tile numbering restarts in every slice
        return rng.integers(1, 5 * 16384, count)
    return np.full(count, kind, dtype=np.int64)


def _slots(count: int, slot: int, rng, odd: bool) -> np.ndarray:
    """Offsets of ``count`` distinct slots of ``slot`` bytes (a multiple of 16) in a pool
    of twice as many: 16-byte aligned, or (``odd``) moved by 1-15 bytes each."""
    offsets = rng.permutation(2 * count)[:count].astype(np.int64) * slot
    return offsets + rng.integers(1, 16, count) if odd else offsets


@pytest.fixture
def launch_bytes():
    before = kvcopy.config.launch_bytes
    yield lambda value: setattr(kvcopy.config, "launch_bytes", value)
    kvcopy.config.launch_bytes = before


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("direction", KINDS)
def test_every_slice_of_a_batch_lands(torch_cuda, launch_bytes, direction, case):
    count, kind, odd, limit = CASES[case]
    launch_bytes(limit)
    rng = np.random.default_rng(count)
    sizes = _sizes(kind, count, rng)
    slot = (int(sizes.max()) + 31) // 16 * 16
    pool_bytes = 2 * count * slot
    src, dst = make_pool(KINDS[direction][0], pool_bytes, 1), make_pool(KINDS[direction][1], pool_bytes, 2)
    src_before, dst_before = host_bytes(src), host_bytes(dst)
    src_off, dst_off = _slots(count, slot, rng, odd), _slots(count, slot, rng, odd)
    stream = torch_cuda.cuda.Stream()
    used = kvcopy.copy_batch(address(src) + src_off, address(dst) + dst_off, sizes, stream=stream)
    assert used == "kernel", kvcopy.last_decision()
    stream.synchronize()
    np.testing.assert_array_equal(
        host_bytes(dst), expected_after(src_before, dst_before, src_off, dst_off, sizes)
    )


def test_work_behind_a_sliced_load_sees_every_block(torch_cuda, launch_bytes):
    """A host-to-GPU batch of 8 launches, then a GPU kernel on the same stream that
    reads every block: it must run after the last slice."""
    torch = torch_cuda
    launch_bytes(512 * 4096)
    count, block = 4096, 4096
    host = torch.empty(count, block, dtype=torch.uint8, pin_memory=True)
    gpu = torch.zeros(2 * count, block, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(2 * count)[:count]
    stream = ordered_stream(torch)
    for round_ in range(5):
        host.copy_(torch.randint(0, 255, host.shape, dtype=torch.uint8))
        src = np.uint64(host.data_ptr()) + np.arange(count, dtype=np.uint64) * np.uint64(block)
        dst = np.uint64(gpu.data_ptr()) + slots.numpy().astype(np.uint64) * np.uint64(block)
        kvcopy.copy_batch(src, dst, np.full(count, block, np.uint64), stream=stream)
        with torch.cuda.stream(stream):
            sums = gpu[slots.cuda(non_blocking=True)].sum(dim=1, dtype=torch.int64)
        stream.synchronize()
        assert torch.equal(sums.cpu(), host.sum(dim=1, dtype=torch.int64)), round_
