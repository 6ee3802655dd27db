"""The Triton alternative: a block-copy kernel of the kind vLLM uses for small
host-to-GPU loads (fixed grid, 8-byte words, pointers through unified addressing).
Written for this benchmark; importing this module needs triton."""

from __future__ import annotations

from typing import Callable

import numpy as np
import triton
import triton.language as tl

PROGRAMS = 16  # kvcopy's default CTA budget for host copies
VLLM_PROGRAMS = 12  # the grid of vLLM's own kernel (vllm/v1/kv_offload/cpu/swap_blocks_triton.py)
WORDS_PER_STEP = 1024  # 8 KiB per program per step


@triton.jit
def _copy_blocks(src_ptrs, dst_ptrs, num_blocks, words_per_block, STEP: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    for b in range(pid, num_blocks, programs):
        src = tl.load(src_ptrs + b).to(tl.pointer_type(tl.int64))
        dst = tl.load(dst_ptrs + b).to(tl.pointer_type(tl.int64))
        for start in range(0, words_per_block, STEP):
            offs = start + tl.arange(0, STEP)
            mask = offs < words_per_block
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def block_copier(
    src_addrs: np.ndarray, dst_addrs: np.ndarray, block: int, stream, programs: int = PROGRAMS
) -> Callable[[], None] | None:
    """A callable that copies every block on ``stream`` (a torch stream), uploading
    the pointer arrays first as an engine does per step; None if it cannot run."""
    import torch

    src_host = torch.from_numpy(np.asarray(src_addrs, dtype=np.int64)).pin_memory()
    dst_host = torch.from_numpy(np.asarray(dst_addrs, dtype=np.int64)).pin_memory()
    src_dev, dst_dev = src_host.cuda(), dst_host.cuda()
    count, words = len(src_addrs), block // 8

    def run() -> None:
        with torch.cuda.stream(stream):
            src_dev.copy_(src_host, non_blocking=True)
            dst_dev.copy_(dst_host, non_blocking=True)
            _copy_blocks[(min(programs, count),)](
                src_dev, dst_dev, count, words, STEP=WORDS_PER_STEP, num_warps=4
            )

    try:
        run()
        stream.synchronize()
    except Exception as exc:  # noqa: BLE001 - an alternative that cannot run is left out
        import sys

        print(f"\nkvcopy bench: Triton alternative left out: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return run
