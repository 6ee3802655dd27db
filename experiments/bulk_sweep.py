"""GPU-to-host copies by kvcopy's two copiers, measured through the public API:
registers (config.bulk_stores = False, the H200's 2 CTAs of 512 threads) against
the bulk copy unit (config.bulk_stores = True) at several CTA counts
(config.bulk_ctas, two warps each).

  alone   GPU time and wall of a 64 MiB batch of scattered blocks, 2 KiB-256 KiB,
          as fractions of the contiguous copy measured in the same run
  beside  a full-GPU bf16 matmul loop alone and beside continuous 16 KiB stores
          (alternating pairs, median slowdown and its spread)
  small   call to completion of 16, 64 and 256 x 16 KiB

Run on a GPU: python3 experiments/bulk_sweep.py [alone] [beside] [small]"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.beside import Copier, Matmuls, paired, settings
from kvcopy_bench.scenarios import Pools
from kvcopy_bench.timing import call_to_completion_us, measure

KiB, MiB = 1 << 10, 1 << 20
TOTAL = 64 * MiB
BULK_CTAS = (2, 4, 8)


@contextlib.contextmanager
def copier(bulk_ctas: int | None) -> Iterator[str]:
    """Registers where ``bulk_ctas`` is None, else the bulk copier with that many CTAs."""
    with settings({"bulk_stores": bulk_ctas is not None, "bulk_ctas": bulk_ctas}):
        yield "registers" if bulk_ctas is None else f"bulk x{bulk_ctas}"


def alone() -> None:
    stream = torch.cuda.Stream()
    pools = Pools("d2h", TOTAL, "torch")
    for block in (2 * KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB):
        ptrs = pools.scattered(block, TOTAL // block, 1)

        def contiguous() -> None:
            with torch.cuda.stream(stream):
                pools.dst[:TOTAL].copy_(pools.src[:TOTAL], non_blocking=True)

        ceiling = measure(contiguous, stream)
        line = f"alone d2h {block // KiB:4d} KiB  contiguous {TOTAL / ceiling.gpu_ms / 1e6:5.1f} GB/s"
        for ctas in (None, *BULK_CTAS):
            with copier(ctas) as name:
                t = measure(lambda: kvcopy.copy_batch(*ptrs, stream=stream), stream)
                variant = kvcopy.last_decision().variant
            line += (
                f"  {name} {ceiling.gpu_ms / t.gpu_ms:.3f}/{ceiling.wall_ms / t.wall_ms:.3f}"
                f"{'' if variant == name.split()[0] else ' (' + variant + ')'}"
            )
        print(line + "   (GPU time / wall, of contiguous)", flush=True)


def beside(pairs: int = 10) -> None:
    matmuls = Matmuls()
    pools = Pools("d2h", TOTAL, "torch")
    ptrs = pools.scattered(16 * KiB, TOTAL // (16 * KiB), 2)
    stream = torch.cuda.Stream()
    for ctas in (None, *BULK_CTAS):
        with copier(ctas) as name:
            call = lambda: kvcopy.copy_batch(*ptrs, stream=stream)  # noqa: E731
            spread, rates, _ = paired(matmuls, [Copier("d2h", call, stream, TOTAL)], pairs)
        print(
            f"beside d2h 16 KiB {name:10s} median {spread['median_slowdown']:+.3f} "
            f"p25 {spread['p25_slowdown']:+.3f} p75 {spread['p75_slowdown']:+.3f} "
            f"copy {rates['d2h']:.1f} GB/s",
            flush=True,
        )


def small() -> None:
    pools = Pools("d2h", 4 * MiB, "torch")
    stream = torch.cuda.Stream()
    for count in (16, 64, 256):
        ptrs = pools.scattered(16 * KiB, count, 3)
        line = f"small d2h {count:3d} x 16 KiB call to completion"
        for ctas in (None, 4):
            with copier(ctas) as name:
                us = call_to_completion_us(
                    lambda: kvcopy.copy_batch(*ptrs, stream=stream), stream.synchronize
                )
            line += f"  {name} {us:.1f} us"
        print(line, flush=True)


def main(parts: list[str]) -> None:
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    print(
        f"# bulk_sweep on {torch.cuda.get_device_name()} "
        f"(sm_{''.join(map(str, torch.cuda.get_device_capability()))})",
        flush=True,
    )
    for part in parts or ["alone", "beside", "small"]:
        {"alone": alone, "beside": beside, "small": small}[part]()


if __name__ == "__main__":
    main(sys.argv[1:])
