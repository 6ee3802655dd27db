"""What a drop-in's layouts cost to describe at every call against keeping them for the
same tensors (kvcopy.compat.kept_layouts): SGLang's per-layer lists of K and V tensors
(transfer_kv_direct's layouts) and a page-first host pool with one layer's planes
selected (transfer_kv_per_layer_direct_pf_lf's). CPU tensors; needs no GPU. Median
microseconds of 200 calls each.

    python3 experiments/kept_layouts_probe.py"""
from __future__ import annotations

import statistics
import time

import torch

from kvcopy import Layout
from kvcopy.compat import sglang


def median_us(fn, calls: int = 200) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


for layers in (1, 8, 32, 64):
    tensors = [torch.zeros((1024, 8, 128), dtype=torch.bfloat16) for _ in range(2 * layers)]
    anew = median_us(lambda: Layout.of(tensors, slot=0))
    kept = median_us(lambda: sglang._token_rows(tensors, "layers"))
    print(f"per-layer tensors {2 * layers:4d}  described anew {anew:8.1f} us  kept {kept:6.1f} us")

pool = [torch.zeros((64, 64, 16, 8, 128), dtype=torch.bfloat16) for _ in range(2)]
anew = median_us(lambda: Layout.of(pool, page=0, slot=2, planes=(1,)).select([5, 69]))
kept = median_us(lambda: sglang._page_first_layers(pool, "pool", 16, 5, 1))
print(f"page-first pool of 64 layers, one layer  described anew {anew:8.1f} us  kept {kept:6.1f} us")
