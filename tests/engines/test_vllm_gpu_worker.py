"""vLLM's tests of its CPU offload worker's transfers, run on kvcopy.compat.vllm (GPU).

Ported from vllm-project/vllm, ``tests/v1/kv_offload/cpu/test_gpu_worker.py`` at
commit 003ffff6b4d753da7b4a53d5fbbec843eb5b4da3: ``test_transfer`` and
``test_transfer_multi_group``, their grids whole (both directions; GPU pages of 512
and 1,024 bytes; CPU blocks of 1 and 3 GPU pages; 64 GPU and 256 CPU blocks; 4
tensors, or 3 groups of 2 with an empty group and an unaligned one; host tensors
of their own or views of one shared region registered with cudaHostRegister), the
same block draws, skipped sub-blocks and checks: the source unchanged, every
destination page the source page mapped to it or its old bytes. The worker's
handler is vLLM code that this suite does not import; ``_issue`` plays its part,
computing each copy's addresses as vLLM's ``compute_sub_block_ptrs`` documents
them and issuing the one ``swap_blocks_batch`` a transfer makes on a stream of its
own, ordered after the current stream for a store, as vLLM's handler does. Left
out: the handler's job bookkeeping (its events and results, vLLM's own code).
The op copies through the driver, so these run on a GPU only.
"""

from __future__ import annotations

import mmap
import random

import numpy as np
import pytest

from kvcopy.compat import vllm

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

GPU_PAGE_SIZES = [512, 1024]
BLOCK_SIZE_FACTORS = [1, 3]
NUM_GPU_BLOCKS, NUM_CPU_BLOCKS = 64, 256


def _addresses(tensor, blocks: list[int], factor: int, skip: int, count: int) -> np.ndarray:
    """The addresses of ``count`` pages of ``tensor`` (rows of ``factor`` pages, any row
    stride) from page ``skip`` of block ``blocks[0]`` on, block after block."""
    page = tensor.shape[1] // factor
    rows = tensor.data_ptr() + np.asarray(blocks, dtype=np.int64)[:, None] * tensor.stride(0)
    return (rows + np.arange(factor, dtype=np.int64) * page).ravel()[skip : skip + count]


def _issue(src, dst, groups: list, gpu_to_cpu: bool, factor: int) -> None:
    """One transfer: for each group (its GPU blocks, CPU blocks, first skipped page and
    tensors), every tensor's pages, as one swap_blocks_batch on a stream of its own."""
    src_all, dst_all, sizes = [], [], []
    for gpu_blocks, cpu_blocks, skip, tensors in groups:
        if not gpu_blocks:
            continue
        count = len(gpu_blocks)
        gpu, cpu = (src, dst) if gpu_to_cpu else (dst, src)
        for t in tensors:
            gpu_side = _addresses(gpu[t], gpu_blocks, 1, 0, count)
            cpu_side = _addresses(cpu[t], cpu_blocks, factor, skip, count)
            src_all.append(gpu_side if gpu_to_cpu else cpu_side)
            dst_all.append(cpu_side if gpu_to_cpu else gpu_side)
            sizes.append(np.full(count, gpu[t].shape[1], dtype=np.int64))  # a GPU page
    stream = torch.cuda.Stream()
    if gpu_to_cpu:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        vllm.swap_blocks_batch(
            torch.from_numpy(np.concatenate(src_all)),
            torch.from_numpy(np.concatenate(dst_all)),
            torch.from_numpy(np.concatenate(sizes)),
        )
    stream.synchronize()


class _SharedRegion:
    """Host memory shared by every tensor (a region's block holds each tensor's CPU
    page), registered with cudaHostRegister as vLLM pins its shared region."""

    def __init__(self, blocks: int, pages: list[int]) -> None:
        self.row = sum(pages)
        self.area = mmap.mmap(-1, blocks * self.row)
        self.whole = torch.frombuffer(self.area, dtype=torch.int8).view(blocks, self.row)
        cudart = torch.cuda.cudart()
        assert int(cudart.cudaHostRegister(self.whole.data_ptr(), blocks * self.row, 0)) == 0
        starts = np.cumsum([0] + pages)
        self.views = [self.whole[:, a:b] for a, b in zip(starts[:-1], starts[1:])]

    def close(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.whole.data_ptr())
        self.views.clear()
        del self.whole


def _tensors(count: int, page: int, factor: int, shared: bool) -> tuple:
    gpu = [torch.zeros((NUM_GPU_BLOCKS, page), dtype=torch.int8, device="cuda:0") for _ in range(count)]
    region = _SharedRegion(NUM_CPU_BLOCKS, [page * factor] * count) if shared else None
    cpu = (
        region.views
        if region
        else [
            torch.zeros((NUM_CPU_BLOCKS, page * factor), dtype=torch.int8, pin_memory=True)
            for _ in range(count)
        ]
    )
    return gpu, cpu, region


def _check(src, dst, before_src, before_dst, dst_to_src: dict, page: int, pages: int) -> None:
    for s, before in zip(src, before_src):
        assert torch.equal(s, before)
    for s, d, before in zip(src, dst, before_dst):
        s_pages, d_pages, old = (
            x.reshape(-1, page) if x.is_contiguous() else x.contiguous().reshape(-1, page)
            for x in (s, d, before)
        )
        for at in range(pages):
            source = dst_to_src.get(at)
            expected = s_pages[source] if source is not None else old[at]
            torch.testing.assert_close(d_pages[at].cpu(), expected.cpu())


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
@pytest.mark.parametrize("num_mappings", [3])
@pytest.mark.parametrize("gpu_page_size_bytes", GPU_PAGE_SIZES)
@pytest.mark.parametrize("block_size_factor", BLOCK_SIZE_FACTORS)
@pytest.mark.parametrize("num_tensors", [4])
@pytest.mark.parametrize("seed", [0])
@pytest.mark.parametrize("use_shared_memory", [False, True])
@torch.inference_mode()
def test_transfer(
    gpu_to_cpu, num_mappings, gpu_page_size_bytes, block_size_factor, num_tensors, seed, use_shared_memory
):
    random.seed(seed)
    torch.manual_seed(seed)
    page, factor = gpu_page_size_bytes, block_size_factor
    gpu, cpu, region = _tensors(num_tensors, page, factor, use_shared_memory)
    gpu_blocks = random.sample(range(NUM_GPU_BLOCKS), num_mappings * factor)
    cpu_blocks = random.sample(range(NUM_CPU_BLOCKS), num_mappings)
    cpu_pages = [b * factor + j for b in cpu_blocks for j in range(factor)]
    skip = factor - 1  # start in the middle of the first CPU block
    gpu_blocks, cpu_pages = gpu_blocks[skip:], cpu_pages[skip:]
    src, dst = (gpu, cpu) if gpu_to_cpu else (cpu, gpu)
    dst_to_src = dict(zip(cpu_pages, gpu_blocks)) if gpu_to_cpu else dict(zip(gpu_blocks, cpu_pages))
    for t in src + dst:
        t.random_()
    before_src, before_dst = [t.clone() for t in src], [t.clone() for t in dst]

    _issue(src, dst, [(gpu_blocks, cpu_blocks, skip, range(num_tensors))], gpu_to_cpu, factor)
    # (vLLM's test compares the first num_gpu_blocks pages of each destination)
    _check(src, dst, before_src, before_dst, dst_to_src, page, NUM_GPU_BLOCKS)
    if region:
        region.close()


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
@pytest.mark.parametrize("num_mappings_per_group", [2])
@pytest.mark.parametrize("gpu_page_size_bytes", GPU_PAGE_SIZES)
@pytest.mark.parametrize("block_size_factor", BLOCK_SIZE_FACTORS)
@pytest.mark.parametrize("seed", [0])
@torch.inference_mode()
def test_transfer_multi_group(
    gpu_to_cpu, num_mappings_per_group, gpu_page_size_bytes, block_size_factor, seed
):
    random.seed(seed)
    torch.manual_seed(seed)
    page, factor = gpu_page_size_bytes, block_size_factor
    groups, per_group = 3, 2
    gpu, cpu, _ = _tensors(groups * per_group, page, factor, False)
    sizes = [num_mappings_per_group, 0, num_mappings_per_group]  # aligned, empty, unaligned
    gpu_all = random.sample(range(NUM_GPU_BLOCKS), sum(sizes) * factor)
    cpu_all = random.sample(range(NUM_CPU_BLOCKS), sum(sizes))
    gpu_of, cpu_of, pages_of = [], [], []
    g = c = 0
    for size in sizes:
        gpu_of.append(gpu_all[g : g + size * factor])
        cpu_of.append(cpu_all[c : c + size])
        pages_of.append([b * factor + j for b in cpu_of[-1] for j in range(factor)])
        g, c = g + size * factor, c + size
    skip = factor - 1  # group 2 starts and ends inside a CPU block
    if skip:
        gpu_of[2], pages_of[2] = gpu_of[2][skip:-skip], pages_of[2][skip:-skip]
    skips = [0, 0, skip]
    src, dst = (gpu, cpu) if gpu_to_cpu else (cpu, gpu)
    for t in src + dst:
        t.random_()
    before_src, before_dst = [t.clone() for t in src], [t.clone() for t in dst]

    _issue(
        src,
        dst,
        [(gpu_of[k], cpu_of[k], skips[k], range(k * per_group, (k + 1) * per_group)) for k in range(groups)],
        gpu_to_cpu,
        factor,
    )
    pages = NUM_CPU_BLOCKS * factor if gpu_to_cpu else NUM_GPU_BLOCKS
    for k in range(groups):
        dst_to_src = dict(zip(pages_of[k], gpu_of[k])) if gpu_to_cpu else dict(zip(gpu_of[k], pages_of[k]))
        members = slice(k * per_group, (k + 1) * per_group)
        _check(src[members], dst[members], before_src[members], before_dst[members], dst_to_src, page, pages)
