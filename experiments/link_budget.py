"""Experiment: why a store and a load at once by the copy kernel stay near 0.8 of the
contiguous pair, and whether any split of the work between SMs and copy engines can
reach 0.9.

Both directions share one PCIe link. The GPU-to-host lane carries the stores' data
(write TLPs) and the loads' read requests (header-only TLPs); the host-to-GPU lane
carries the loads' data (completions). SM traffic to host memory goes out in pieces
of at most 128 bytes (h200-bulk-probe.txt: neither registers nor the bulk copy unit
do better one way than 0.93-0.95 of the copy engines), the copy engines' in larger
ones, and every TLP pays the same ~24-30 bytes of header, sequence number, LCRC and
framing. So per byte moved, SM stores and SM loads' requests cost the GPU-to-host
lane more than the engines' do.

Measured here: each direction's GB/s while the other direction runs (its batch
issued once, the other's three times, so that the other runs for all of it), for
every pairing of the copy engines (batched DMA of 1 MiB blocks, and the contiguous
copy) and the copy kernel (16 KiB blocks; CTAs per side varied), plus each alone.
Then, for assumed TLP sizes, the bytes each pairing puts on the GPU-to-host lane:
if the model holds, that figure is about the same for every pairing that fills the
link, and the pairings' data rates follow from it.

Last, where the copy engines' CPU cost per copy may allow them on one side (32-128 KiB
blocks): copy_both_ways as it decides now, against the load by batched DMA on one
stream beside the store by the kernel with 2 or 4 CTAs on another, GPU time and wall
(call to completion), fractions of the contiguous pair's.

Run on a GPU: python3 experiments/link_budget.py
"""

from __future__ import annotations

from typing import Callable

import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.timing import call_to_completion_us

from serving_probe import TOTAL, KiB, MiB, BothWays, per_stream_ms  # scripts/

OVERHEAD = 26  # bytes per TLP on the wire besides its payload (header, seq, LCRC, framing)
SM_PIECE = 128  # an SM store's payload, and the data an SM load's request asks for
ENGINE_WRITE = 256  # a copy engine's write payload (the usual max payload size)
ENGINE_READ = 512  # a copy engine's read request (the usual max read request size)


def upstream_bytes(h2d_gbps: float, d2h_gbps: float, h2d_by: str, d2h_by: str) -> float:
    """GB/s on the GPU-to-host lane for the given data rates: the stores' payload and
    headers, and one request header per piece the loads ask for."""
    write = SM_PIECE if d2h_by == "kernel" else ENGINE_WRITE
    read = SM_PIECE if h2d_by == "kernel" else ENGINE_READ
    return d2h_gbps * (1 + OVERHEAD / write) + h2d_gbps * OVERHEAD / read


def main() -> None:
    both = BothWays()
    s1, s2 = both.s1, both.s2
    small, large = 16 * KiB, 1 * MiB
    batches = {small: both.batches(small), large: both.batches(large)}

    def issuer(side: int, method: str, ctas: int | None):
        """Enqueue one TOTAL-byte batch of the load (side 0, on s1) or the store (side 1,
        on s2) by ``method``."""
        if method == "contiguous":

            def contiguous():
                with torch.cuda.stream(s1 if side == 0 else s2):
                    if side == 0:
                        both.gpu_a[:TOTAL].copy_(both.host_a[:TOTAL], non_blocking=True)
                    else:
                        both.host_b[:TOTAL].copy_(both.gpu_b[:TOTAL], non_blocking=True)

            return contiguous
        block = small if method == "kernel" else large
        ptrs = batches[block][side]
        stream = s1 if side == 0 else s2

        def copy():
            kvcopy.copy_batch(*ptrs, stream=stream, method=method, max_ctas=ctas)

        return copy

    def rates(h2d: tuple, d2h: tuple) -> tuple[float, float]:
        """Each direction's GB/s while the other runs the whole time."""
        load, store = issuer(0, *h2d), issuer(1, *d2h)

        def enqueue(loads: int, stores: int):
            def run():
                for k in range(max(loads, stores)):
                    if k < loads:
                        load()
                    if k < stores:
                        store()

            return run

        h_ms, _ = per_stream_ms(enqueue(1, 3), s1, s2)
        _, d_ms = per_stream_ms(enqueue(3, 1), s1, s2)
        return TOTAL / h_ms / 1e6, TOTAL / d_ms / 1e6

    def alone(side: int, method: str, ctas: int | None) -> float:
        fn = issuer(side, method, ctas)
        ms = per_stream_ms(fn, s1, s2)[side]
        return TOTAL / ms / 1e6

    print(
        f"# link_budget on {torch.cuda.get_device_name()}: GB/s of data; 'up' = modelled "
        f"GB/s on the GPU-to-host lane ({OVERHEAD} B per TLP; SM pieces {SM_PIECE} B, "
        f"engine writes {ENGINE_WRITE} B, engine read requests {ENGINE_READ} B)"
    )
    for side, name in ((0, "h2d"), (1, "d2h")):
        for method, ctas in (("contiguous", None), ("batch", None), ("kernel", 4), ("kernel", 16)):
            label = method + (f" {ctas} CTAs" if ctas else "")
            print(f"alone {name} {label:<16} {alone(side, method, ctas):6.1f}", flush=True)
    pairings = [
        (("contiguous", None), ("contiguous", None)),
        (("batch", None), ("batch", None)),
        (("kernel", 16), ("batch", None)),
        (("kernel", 64), ("batch", None)),
        (("batch", None), ("kernel", 4)),
        (("batch", None), ("kernel", 16)),
        (("kernel", 4), ("kernel", 4)),
        (("kernel", 16), ("kernel", 4)),
        (("kernel", 16), ("kernel", 16)),
        (("kernel", 32), ("kernel", 16)),
        (("kernel", 64), ("kernel", 8)),
        (("kernel", 8), ("kernel", 32)),
    ]
    reference = None
    for h2d, d2h in pairings:
        h, d = rates(h2d, d2h)
        reference = reference or h + d
        by = ["kernel" if m == "kernel" else "engine" for m, _ in (h2d, d2h)]
        up = upstream_bytes(h, d, *by)
        label = " + ".join(m + (f" {c}" if c else "") for m, c in (h2d, d2h))
        print(
            f"both {label:<30} h2d {h:5.1f} d2h {d:5.1f} sum {h + d:6.1f} "
            f"({(h + d) / reference:.2f} of the engines' pair)  up {up:5.1f}",
            flush=True,
        )


def engines_for_the_load(blocks=(32 * KiB, 64 * KiB, 128 * KiB)) -> None:
    """copy_both_ways against the load by the engines beside the store by the kernel."""
    both = BothWays()
    s1, s2 = both.s1, both.s2

    def sync() -> None:
        s1.synchronize()
        s2.synchronize()

    pair_gpu = both.span_ms(both.contiguous)
    pair_wall = call_to_completion_us(both.contiguous, sync, repeats=30)
    for block in blocks:
        load, store = both.batches(block)
        cases: dict[str, Callable[[], object]] = {
            "copy_both_ways": lambda: kvcopy.copy_both_ways(store, load, stream=s2)
        }
        for ctas in (2, 4):

            def mixed(ctas: int = ctas) -> None:
                kvcopy.copy_batch(*load, stream=s1, method="batch")
                kvcopy.copy_batch(*store, stream=s2, method="kernel", max_ctas=ctas)

            cases[f"engines load + kernel store {ctas}"] = mixed
        cells = []
        for name, fn in cases.items():
            gpu = pair_gpu / both.span_ms(fn)
            wall = pair_wall / call_to_completion_us(fn, sync, repeats=30)
            cells.append(f"{name}: gpu {gpu:.3f} wall {wall:.3f}")
        print(f"mix {block // KiB:>3} KiB  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    torch.cuda.init()
    main()
    engines_for_the_load()
