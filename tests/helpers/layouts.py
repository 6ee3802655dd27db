"""Paged caches of random bytes and their gathered oracle, for the layout tests."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy


def rand(torch, shape, seed, device="cuda", pinned=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if device == "cuda":
        return t.cuda()
    return t.pin_memory() if pinned else t


def paged(torch, layers, blocks, block_size, row, seed, **kw):
    """vLLM flash-attention caches: [2, blocks, block_size, row] per layer."""
    return [rand(torch, (2, blocks, block_size, row), seed + i, **kw) for i in range(layers)]


def gathered(torch, caches, slots):
    """Oracle: the chunk [2, layers, tokens, row] gathered by slot (zeros where -1)."""
    flat = [c.reshape(2, -1, c.shape[-1]).cpu() for c in caches]
    out = torch.zeros((2, len(caches), len(slots), caches[0].shape[-1]), dtype=torch.uint8)
    for t, s in enumerate(slots):
        if s >= 0:
            for layer, f in enumerate(flat):
                out[:, layer, t] = f[:, s]
    return out


def replay_with_new_indices(
    torch, graph, src, dst, src_index, dst_index, steps: int, seed: int, out_of_range_at: int | None = None
) -> None:
    """Replay ``graph`` (a captured copy of rows src[src_index] into every plane of
    ``dst`` [planes, slots, row] at dst_index) ``steps`` times, refilling the indices in
    place each time, and check every byte; at step ``out_of_range_at`` one destination
    index is out of range: its row is skipped and check_indices reports it."""
    rows, slots = len(src_index), dst.shape[1]
    rng = np.random.default_rng(seed)
    for step in range(steps):
        s = rng.choice(len(src), rows, replace=False)
        d = rng.choice(slots, rows, replace=False)
        if step == out_of_range_at:
            d[7] = slots
        src_index.copy_(torch.from_numpy(s))
        dst_index.copy_(torch.from_numpy(d))
        dst.zero_()
        graph.replay()
        torch.cuda.synchronize()
        want = torch.zeros_like(dst)
        for r in range(rows):
            if d[r] < slots:
                want[:, d[r]] = src[s[r]].cpu()
        assert torch.equal(dst, want), step
        if step == out_of_range_at:
            with pytest.raises(kvcopy.IndexOutOfRange) as info:
                kvcopy.check_indices()
            assert info.value.first_row == 7
            del info  # (its traceback holds this frame, and so the graph, in a cycle)
    kvcopy.check_indices()
