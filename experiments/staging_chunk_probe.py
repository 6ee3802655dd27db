"""Experiment: what a staged call's chunk size (config.staging_bytes) costs and buys.

The host_spans benchmark's staged rows reach 0.92-0.97 of the contiguous pair in GPU
time but 0.75-0.89 in wall on a slow host, where the call itself (1.7 ms for 64 MiB
each way of 4 KiB blocks) outlasts the GPU's work: the CPU issues each chunk (plan
its copies, two event waits, two event records, a copy per host span, a launch)
while the chunks before it run. Fewer, larger chunks cost fewer driver calls but
fill the pipeline later (the first chunk's copy runs before its kernel can start).

Measured here, for each chunk size and 4 and 16 KiB blocks (host side one span, GPU
blocks scattered, 64 MiB each way; the bench's host_spans layout): call time, GPU
time and wall of copy_both_ways and of a one-way copy_batch, as fractions of the
contiguous pair (or copy) measured the same way in the same run. The call time's
growth with the number of chunks gives the CPU cost per chunk.

Run on a GPU: python3 experiments/staging_chunk_probe.py [chunk MiB ...]
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.timing import measure
from kvcopy.config import config

KiB, MiB = 1 << 10, 1 << 20
TOTAL = 64 * MiB


def main(chunks_mib: list[int]) -> None:
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    host_in = torch.empty(TOTAL, dtype=torch.uint8).pin_memory()
    host_out = torch.empty(TOTAL, dtype=torch.uint8).pin_memory()
    gpu_in = torch.empty(2 * TOTAL, dtype=torch.uint8, device="cuda")
    gpu_out = torch.randint(0, 255, (2 * TOTAL,), dtype=torch.uint8, device="cuda")
    host_in.copy_(torch.randint(0, 255, (TOTAL,), dtype=torch.uint8))

    def contiguous(both: bool) -> None:
        # both at once, ordered on s1: s2 forks from s1 before either copy and joins it
        # after, as copy_both_ways' side stream does
        if both:
            s2.wait_stream(s1)
        with torch.cuda.stream(s1):
            gpu_in[:TOTAL].copy_(host_in, non_blocking=True)
        if both:
            with torch.cuda.stream(s2):
                host_out.copy_(gpu_out[:TOTAL], non_blocking=True)
            s1.wait_stream(s2)

    ref = {
        way: measure(functools.partial(contiguous, way == "both"), s1, repeats=9) for way in ("both", "h2d")
    }
    print(
        f"# staging_chunk_probe: {torch.cuda.get_device_name()}, 64 MiB each way, host one span; "
        f"contiguous pair {ref['both'].gpu_ms * 1e3:.0f} us GPU ({ref['both'].wall_ms * 1e3:.0f} wall), "
        f"copy {ref['h2d'].gpu_ms * 1e3:.0f} us ({ref['h2d'].wall_ms * 1e3:.0f})",
        flush=True,
    )
    rng = np.random.default_rng(3)
    default = config.staging_bytes
    for block in (4 * KiB, 16 * KiB):
        n = TOTAL // block
        host = np.arange(n, dtype=np.uint64) * np.uint64(block)
        sizes = np.full(n, block, dtype=np.uint64)

        def slots(pool: torch.Tensor) -> np.ndarray:
            picked = rng.permutation(2 * n)[:n].astype(np.uint64)
            return np.uint64(pool.data_ptr()) + picked * np.uint64(block)

        load = (np.uint64(host_in.data_ptr()) + host, slots(gpu_in), sizes)
        store = (slots(gpu_out), np.uint64(host_out.data_ptr()) + host, sizes)
        calls = {
            "both": functools.partial(kvcopy.copy_both_ways, store, load, stream=s1),
            "h2d": functools.partial(kvcopy.copy_batch, *load, stream=s1),
        }
        for way, call in calls.items():  # the kernel alone, for comparison
            t = measure(functools.partial(call, method="kernel"), s1, repeats=9)
            print(
                f"{way:4s} {block // KiB:3d} KiB kernel{'':31s}call {t.cpu_us:7.0f} us  "
                f"GPU {ref[way].gpu_ms / t.gpu_ms:.3f}  wall {ref[way].wall_ms / t.wall_ms:.3f}",
                flush=True,
            )
        for mib in chunks_mib:
            config.staging_bytes = mib * MiB
            for way, call in calls.items():
                call()
                s1.synchronize()
                chose = kvcopy.last_decision().method
                if mib == chunks_mib[0] and way == "h2d":  # the bytes, once per block size
                    ids = (load[1] - np.uint64(gpu_in.data_ptr())).astype(np.int64)
                    got = gpu_in.view(-1, block)[torch.from_numpy(ids // block)].flatten().cpu()
                    assert torch.equal(got, host_in), "staged load: wrong bytes"
                t = measure(call, s1, repeats=9)
                r = ref[way]
                chunks = -(-TOTAL // (mib * MiB)) * (2 if way == "both" else 1)
                print(
                    f"{way:4s} {block // KiB:3d} KiB chunk {mib:3d} MiB ({chunks:3d} chunks) {chose:7s} "
                    f"call {t.cpu_us:7.0f} us  GPU {r.gpu_ms / t.gpu_ms:.3f}  wall {r.wall_ms / t.wall_ms:.3f}",
                    flush=True,
                )
    config.staging_bytes = default


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [4, 8])
