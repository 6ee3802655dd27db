"""Batches the benchmark and the probes measure, built in one place."""

from __future__ import annotations

from typing import Any

import numpy as np

KiB = 1 << 10


def scattered_batch(
    count: int = 8192, block: int = 16 * KiB, seed: int = 0
) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
    """``count`` blocks of ``block`` bytes at random slots of a pinned pool, to random
    slots of a device pool (each pool twice the batch): (buffers to keep alive,
    source pointers, destination pointers, sizes), the pointers as uint64 arrays."""
    import torch

    src = torch.empty(2 * count * block, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(2 * count * block, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(seed)
    s = np.uint64(src.data_ptr()) + (rng.permutation(2 * count)[:count] * block).astype(np.uint64)
    d = np.uint64(dst.data_ptr()) + (rng.permutation(2 * count)[:count] * block).astype(np.uint64)
    return (src, dst), s, d, np.full(count, block, dtype=np.uint64)


def layered_caches(blocks: int = 2048, layers: int = 32) -> tuple[list, list]:
    """A paged KV cache as engines keep it: one GPU and one pinned host tensor per
    layer for K and for V (2 x layers tensors per side), 16-token blocks of 8
    heads of 128, bf16: 32 KiB per block."""
    import torch

    shape = (blocks, 16, 8, 128)
    gpu = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2 * layers)]
    host = [torch.empty(shape, dtype=torch.bfloat16, pin_memory=True) for _ in range(2 * layers)]
    return gpu, host


def block_pairs(blocks: int, pairs: int, seed: int = 1) -> np.ndarray:
    """(pairs, 2) distinct random [source block, destination block] ids below ``blocks``."""
    rng = np.random.default_rng(seed)
    return np.stack(
        [rng.choice(blocks, pairs, replace=False), rng.choice(blocks, pairs, replace=False)], axis=1
    )
