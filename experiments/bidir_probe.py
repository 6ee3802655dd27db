"""Both directions at once over PCIe: the copy kernel's footprint (CTAs x threads)
against the contiguous pair, in GPU time (events spanning both streams), one way
and both ways. KVCOPY_UNROLL picks the loads in flight per thread.
Run on a GPU: python3 experiments/bidir_probe.py"""

from __future__ import annotations

import os

import numpy as np
import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.timing import span_ms as _span
from kvcopy.config import config

KiB, MiB = 1 << 10, 1 << 20
TOTAL = 64 * MiB


def span_ms(fn, s1, s2) -> float:
    """GPU time from both streams' start to both streams' end (a 1 ms sleep covers the calls)."""
    return _span(fn, s1, s2, repeats=7, warmup=2, cover_cycles=2_000_000)


def main() -> None:
    print("KVCOPY_UNROLL", os.environ.get("KVCOPY_UNROLL", "4"))
    host_a = torch.empty(2 * TOTAL, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(2 * TOTAL, dtype=torch.uint8, pin_memory=True)
    gpu_a = torch.empty(2 * TOTAL, dtype=torch.uint8, device="cuda")
    gpu_b = torch.empty(2 * TOTAL, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for block in (4 * KiB, 16 * KiB, 1 * MiB):
        n = TOTAL // block
        rng = np.random.default_rng(block)

        def ptrs(a, b):
            p = rng.permutation(2 * n)
            return (
                (a.data_ptr() + p[:n] * block).astype(np.uint64),
                (b.data_ptr() + p[-n:] * block).astype(np.uint64),
                np.full(n, block, np.uint64),
            )

        h2d, d2h = ptrs(host_a, gpu_a), ptrs(gpu_b, host_b)

        def contiguous_pair():
            with torch.cuda.stream(s1):
                gpu_a[:TOTAL].copy_(host_a[:TOTAL], non_blocking=True)
            with torch.cuda.stream(s2):
                host_b[:TOTAL].copy_(gpu_b[:TOTAL], non_blocking=True)

        pair = span_ms(contiguous_pair, s1, s2)

        def on(stream, fn):
            def run():
                with torch.cuda.stream(stream):
                    fn()

            return run

        alone_h = span_ms(on(s1, lambda: gpu_a[:TOTAL].copy_(host_a[:TOTAL], non_blocking=True)), s1, s2)
        alone_d = span_ms(on(s2, lambda: host_b[:TOTAL].copy_(gpu_b[:TOTAL], non_blocking=True)), s1, s2)
        print(
            f"block {block // KiB} KiB: contiguous pair {2 * TOTAL / pair / 1e6:.1f} GB/s, "
            f"h2d {TOTAL / alone_h / 1e6:.1f}, d2h {TOTAL / alone_d / 1e6:.1f}"
        )
        print("  ctas x threads: h2d/contig, d2h/contig, both/pair")
        for ctas, threads in (
            (2, 512),
            (4, 512),
            (8, 512),
            (16, 512),
            (32, 512),
            (4, 256),
            (8, 256),
            (8, 128),
        ):
            config.threads_per_cta = threads
            h = span_ms(lambda: kvcopy.copy_batch(*h2d, stream=s1, method="kernel", max_ctas=ctas), s1, s2)
            d = span_ms(lambda: kvcopy.copy_batch(*d2h, stream=s2, method="kernel", max_ctas=ctas), s1, s2)
            both = span_ms(
                lambda: (
                    kvcopy.copy_batch(*h2d, stream=s1, method="kernel", max_ctas=ctas),
                    kvcopy.copy_batch(*d2h, stream=s2, method="kernel", max_ctas=ctas),
                ),
                s1,
                s2,
            )
            print(
                f"  {ctas:>3} x {threads}: {alone_h / h:.2f} {alone_d / d:.2f} {pair / both:.2f}", flush=True
            )
        config.threads_per_cta = 512
        for label, fn in (
            (
                "batch+batch",
                lambda: (
                    kvcopy.copy_batch(*h2d, stream=s1, method="batch"),
                    kvcopy.copy_batch(*d2h, stream=s2, method="batch"),
                ),
            ),
            (
                "kernel h2d + batch d2h",
                lambda: (
                    kvcopy.copy_batch(*h2d, stream=s1, method="kernel"),
                    kvcopy.copy_batch(*d2h, stream=s2, method="batch"),
                ),
            ),
            (
                "batch h2d + kernel d2h",
                lambda: (
                    kvcopy.copy_batch(*h2d, stream=s1, method="batch"),
                    kvcopy.copy_batch(*d2h, stream=s2, method="kernel"),
                ),
            ),
        ):
            print(f"  {label}: {pair / span_ms(fn, s1, s2):.2f}", flush=True)


if __name__ == "__main__":
    main()
