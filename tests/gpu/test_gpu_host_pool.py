"""kvcopy.pinned_pool on a GPU: the pool is pinned memory the driver knows, kvcopy's
copies into and out of it move the right bytes by the kernel and by the copy engines,
a pool built in the background hands out arrays a copy can use at once, and the pool
goes on the GPU's NUMA node."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvcopy
from kvcopy import testing
from helpers.gpu import ordered_stream

BLOCK = 64 << 10
BLOCKS = 256


def _copy_both_ways(torch, pool_bytes: np.ndarray, method: str) -> None:
    """Scattered blocks pool -> GPU and back into other blocks of the pool, bytes checked."""
    rng = np.random.default_rng(0)
    pool_bytes[:] = rng.integers(0, 256, pool_bytes.size, dtype=np.uint8)
    host = torch.from_numpy(pool_bytes).view(BLOCKS, BLOCK)
    gpu = torch.zeros(BLOCKS, BLOCK, dtype=torch.uint8, device="cuda")
    taken, placed = rng.permutation(BLOCKS)[:64], rng.permutation(BLOCKS)[:64]
    stream = ordered_stream(torch)
    mapping = torch.tensor(np.stack([taken, placed], 1), dtype=torch.int64)
    kvcopy.swap_blocks(host, gpu, mapping, stream=stream, method=method)
    stream.synchronize()
    assert torch.equal(gpu[placed].cpu(), host[taken])
    back = torch.tensor(np.stack([placed, np.arange(64)], 1), dtype=torch.int64)
    expected = host[taken].clone()
    kvcopy.swap_blocks(gpu, host, back, stream=stream, method=method)
    stream.synchronize()
    assert torch.equal(host[:64], expected)


@pytest.mark.parametrize("method", ["kernel", "batch", "auto"])
@pytest.mark.parametrize("huge_pages", ["auto", "none"])
def test_copies_into_and_out_of_a_pool_move_the_right_bytes(torch_cuda, method, huge_pages):
    with kvcopy.pinned_pool(
        BLOCKS * BLOCK, block_bytes=BLOCK, chunk_bytes=4 << 20, huge_pages=huge_pages
    ) as pool:
        report = pool.wait()
        assert report.registered_bytes == pool.nbytes and report.registrations == 4
        array = pool.view()
        assert kvcopy.device_pointer(array) != 0  # pinned memory the driver knows
        _copy_both_ways(torch_cuda, array, method)
        del array


def test_a_pool_built_in_the_background_hands_out_usable_arrays(torch_cuda):
    seen = []
    pool = kvcopy.pinned_pool(
        BLOCKS * BLOCK,
        block_bytes=BLOCK,
        chunk_bytes=2 << 20,
        background=True,
        on_progress=lambda *a: seen.append(a),
    )
    first = pool.view(0, BLOCKS * BLOCK, timeout=60)
    _copy_both_ways(torch_cuda, first, "kernel")
    report = pool.wait(timeout=60)
    assert report.registrations == 8 and seen[-1] == (pool.nbytes, pool.nbytes)
    del first
    pool.close()


def test_the_pool_goes_on_the_gpus_numa_node(torch_cuda):
    pool = kvcopy.pinned_pool(8 << 20)
    report = pool.wait()
    attrs = testing.cuda.driver.device_attributes(0)
    address = f"{attrs['pci_domain']:04x}:{attrs['pci_bus']:02x}:{attrs['pci_device']:02x}.0"
    listed = Path("/sys/bus/pci/devices") / address / "numa_node"
    node = int(listed.read_text()) if listed.exists() else -1
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    if node >= 0 and len(nodes) > 1:
        assert report.node == node and report.bytes_by_node.get(node, 0) >= 8 << 20
    else:  # one node, or none named for the GPU: the pool says so or sits on node 0
        assert report.node in (None, 0)
    pool.close()
