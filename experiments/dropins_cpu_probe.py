"""The drop-ins' CPU time before the copy: their layouts described at every call
against kept for the same tensors (kvcopy.compat.kept_layouts), on SGLang's per-layer
lists of K and V tensors (transfer_kv_direct's layouts) and a page-first host pool
with one layer's planes selected (transfer_kv_per_layer_direct_pf_lf's); and vLLM's
strided runs grouped into layouts, read in one pass (a list of CopyRunDescriptors)
against one by one (a list of lists). CPU tensors; needs no GPU. Median microseconds
of 200 calls each (50 for the runs).

    python3 experiments/dropins_cpu_probe.py"""
from __future__ import annotations

import torch

from kvcopy import Layout
from kvcopy.compat import sglang
from kvcopy.compat.vllm import CopyRunDescriptor, run_groups
from cpu_timing import median_us


for layers in (1, 8, 32, 64):
    tensors = [torch.zeros((1024, 8, 128), dtype=torch.bfloat16) for _ in range(2 * layers)]
    anew = median_us(lambda: Layout.of(tensors, slot=0), 200)
    kept = median_us(lambda: sglang._token_rows(tensors, "layers"), 200)
    print(f"per-layer tensors {2 * layers:4d}  described anew {anew:8.1f} us  kept {kept:6.1f} us")

pool = [torch.zeros((64, 64, 16, 8, 128), dtype=torch.bfloat16) for _ in range(2)]
anew = median_us(lambda: Layout.of(pool, page=0, slot=2, planes=(1,)).select([5, 69]), 200)
kept = median_us(lambda: sglang._page_first_layers(pool, "pool", 16, 5, 1), 200)
print(f"page-first pool of 64 layers, one layer  described anew {anew:8.1f} us  "
      f"kept {kept:6.1f} us")

for count in (64, 1024, 8192):
    runs = [CopyRunDescriptor(4096 + i * 65536, 8192 + i * 65536, 512, 16, 512, 4096)
            for i in range(count)]
    lists = [list(run) for run in runs]
    one_pass = median_us(lambda: run_groups(runs), 50)
    one_by_one = median_us(lambda: run_groups(lists), 50)
    print(f"vLLM runs {count:5d}  one pass {one_pass:8.1f} us  one by one {one_by_one:8.1f} us")
