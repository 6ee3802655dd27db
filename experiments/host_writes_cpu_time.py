"""Does what a call moves into host memory slow the CPU work of the next call? The
SGLang drop-in's all-layer and per-layer calls, repeated, with items of 2 KiB, 512 and
128 bytes a token and layer (32, 8 and 2 MiB an all-layer call), each call timed call
to return after the stream drained; and a per-layer call right after torch moved 32 MiB
into pinned memory.

    python3 experiments/host_writes_cpu_time.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from kvcopy.compat import sglang

LAYERS, TOKENS = 32, 256


def median_us(call, stream, calls: int = 1000) -> float:
    for _ in range(30):
        call()
    stream.synchronize()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        stream.synchronize()
    return statistics.median(times) * 1e6


def main() -> None:
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(0)
    print(torch.cuda.get_device_name(), "; median µs of 1,000 calls")
    with torch.cuda.stream(stream):
        for item in (2048, 512, 128):
            shape = (4096, item // 2)
            k_g, v_g = (
                [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)] for _ in "kv"
            )
            k_h, v_h = (
                [torch.empty(shape, dtype=torch.bfloat16, pin_memory=True) for _ in range(LAYERS)]
                for _ in "kv"
            )
            slots = torch.from_numpy(rng.choice(4096, TOKENS, replace=False).astype(np.int64)).cuda()
            tables = [
                torch.tensor([t.data_ptr() for t in side], dtype=torch.uint64, device="cuda")
                for side in (k_g, k_h, v_g, v_h)
            ]

            def all_layer() -> None:
                sglang.transfer_kv_all_layer(*tables, slots, slots, item, LAYERS)

            def per_layer() -> None:
                sglang.transfer_kv_per_layer(k_g[0], k_h[0], v_g[0], v_h[0], slots, slots, item)

            mib = TOKENS * item * 2 * LAYERS / 2**20
            print(
                f"item {item:5d} B: all-layer ({mib:4.1f} MiB a call) {median_us(all_layer, stream):6.2f}; "
                f"per-layer ({mib / LAYERS:.2f} MiB) {median_us(per_layer, stream):6.2f}"
            )
        wide_g = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
        wide_h = torch.empty(32 << 20, dtype=torch.uint8, pin_memory=True)
        times = []
        for _ in range(300):
            wide_h.copy_(wide_g, non_blocking=True)
            stream.synchronize()
            start = time.perf_counter()
            per_layer()
            times.append(time.perf_counter() - start)
        stream.synchronize()
        print(
            f"per-layer (128 B) right after torch moved 32 MiB into pinned memory: {statistics.median(times) * 1e6:6.2f}"
        )


if __name__ == "__main__":
    main()
