"""The drop-ins' CPU time before the copy: their layouts described at every call
against kept for the same tensors (kvcopy.compat.kept_layouts), on SGLang's per-layer
lists of K and V tensors (transfer_kv_direct's layouts) and a page-first host pool
with one layer's planes selected (transfer_kv_per_layer_direct_pf_lf's); and vLLM's
strided runs grouped into layouts, read in one pass (a list of CopyRunDescriptors)
against one by one (a list of lists); and each drop-in's whole call up to copy_rows
(its arguments checked, its layouts found kept, the stream chosen; copy_rows itself
stood in for by a no-op), for a 32-layer cache moving 256 tokens. CPU tensors; needs
no GPU. Median microseconds of 200 calls each (50 for the runs).

    python3 experiments/dropins_cpu_probe.py"""

from __future__ import annotations

import torch

from kvcopy import Layout
from kvcopy.compat import kept_layouts, lmcache, pointer_tables, sglang, vllm
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
print(f"page-first pool of 64 layers, one layer  described anew {anew:8.1f} us  kept {kept:6.1f} us")

for count in (64, 1024, 8192):
    runs = [CopyRunDescriptor(4096 + i * 65536, 8192 + i * 65536, 512, 16, 512, 4096) for i in range(count)]
    lists = [list(run) for run in runs]
    one_pass = median_us(lambda: run_groups(runs), 50)
    one_by_one = median_us(lambda: run_groups(lists), 50)
    print(f"vLLM runs {count:5d}  one pass {one_pass:8.1f} us  one by one {one_by_one:8.1f} us")


def up_to_copy_rows() -> None:
    """Each drop-in's call with copy_rows a no-op: what the drop-in adds to a copy."""
    layers, tokens, slots = 32, 256, 4096
    kv = [torch.zeros((slots, 8, 128), dtype=torch.bfloat16) for _ in range(2 * layers)]
    host = [torch.zeros((slots, 8, 128), dtype=torch.bfloat16) for _ in range(2 * layers)]
    indices = torch.randperm(slots)[:tokens]
    cases = {
        "SGLang transfer_kv_per_layer": lambda: sglang.transfer_kv_per_layer(
            kv[0], host[0], kv[1], host[1], indices, indices, 2048
        ),
        "SGLang transfer_kv_direct": lambda: sglang.transfer_kv_direct(kv, host, indices, indices, 1),
    }
    k_table = torch.tensor([t.data_ptr() for t in kv[:layers]])
    v_table = torch.tensor([t.data_ptr() for t in kv[layers:]])
    cases["SGLang transfer_kv_all_layer"] = lambda: sglang.transfer_kv_all_layer(
        k_table, k_table, v_table, v_table, indices, indices, 2048, layers
    )
    paged = torch.zeros((2, slots, 1024), dtype=torch.bfloat16)
    ptrs = torch.tensor([paged.data_ptr()] * layers)
    chunk = torch.zeros((2, layers, tokens, 1024), dtype=torch.bfloat16)
    cases["LMCache multi_layer_kv_transfer"] = lambda: lmcache.multi_layer_kv_transfer(
        chunk, ptrs, indices, None, slots, lmcache.TransferDirection.D2H
    )
    backend = vllm.CopyBackend()
    runs = [CopyRunDescriptor(4096 + i * 65536, 8192 + i * 65536, 512, 16, 512, 4096) for i in range(64)]
    cases["vLLM CopyBackend.submit, 64 runs"] = lambda: (backend.submit(runs), backend.clear())
    for name, call in cases.items():
        print(f"{name:<36} up to copy_rows {median_us(call, 200):7.1f} us")


# (the driver's answers stood in for too: how far a table's address reaches is asked
# of it once per table, and CPU tensors have none)
stand_ins = [
    (kept_layouts, "copy_rows", lambda *a, **k: "none"),
    (vllm, "copy_rows", lambda *a, **k: "none"),
    (vllm, "_torch_stream", lambda caller: None),
    (pointer_tables, "_reach_of", lambda address, name: 1 << 30),
]
kept = [(module, name, getattr(module, name)) for module, name, _ in stand_ins]
for module, name, value in stand_ins:
    setattr(module, name, value)
try:
    up_to_copy_rows()
finally:
    for module, name, value in kept:
        setattr(module, name, value)
