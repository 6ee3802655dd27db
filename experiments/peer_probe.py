"""Copies between two GPUs: which device should launch the copy kernel (source or
destination side) and how many CTAs keep NVLink busy, against the contiguous peer
copy in the same run. Also what the driver's access flags say before and after
peer access is enabled. Needs two GPUs: python3 experiments/peer_probe.py"""

from __future__ import annotations

import sys

import numpy as np
import torch

import kvcopy
from kvcopy.testing import cuda

driver = cuda.driver
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.timing import measure

KiB, MiB = 1 << 10, 1 << 20
TOTAL = 128 * MiB


def gpu_ms(fn, stream, reps=7) -> float:
    """Median GPU time of fn's work, enqueued with ``stream`` current (kvcopy_bench.timing)."""

    def on_stream() -> None:
        with torch.cuda.stream(stream):
            fn()

    return measure(on_stream, stream, repeats=reps).gpu_ms


def main() -> int:
    if torch.cuda.device_count() < 2:
        print("peer_probe: needs two GPUs")
        return 2
    print("can access peer 0->1:", driver.can_access_peer(0, 1), "1->0:", driver.can_access_peer(1, 0))
    pools = {d: torch.empty(2 * TOTAL, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)}
    outs = {d: torch.empty(2 * TOTAL, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)}
    for d in (0, 1):
        pools[d].random_(0, 255)
    driver.init()
    driver.push_context(driver.primary_context(0))
    print(
        "access flags of GPU1 memory from GPU0 before any peer access:",
        driver.pointer_access_flags(pools[1].data_ptr()),
    )
    driver.pop_context()
    streams = {d: torch.cuda.Stream(device=d) for d in (0, 1)}
    # kvcopy first, before torch enables peer access for its own copies
    first = [
        np.array([pools[0].data_ptr()], dtype=np.uint64),
        np.array([outs[1].data_ptr() + 4096, outs[1].data_ptr()], dtype=np.uint64),
    ]
    chose = kvcopy.copy_batch(
        np.array([pools[0].data_ptr(), pools[0].data_ptr() + 8192], dtype=np.uint64),
        first[1],
        [4096, 4096],
        stream=streams[0],
    )
    driver.push_context(driver.primary_context(0))
    print(
        f"kvcopy auto GPU0->GPU1 first call chose {chose}; access flags now",
        driver.pointer_access_flags(pools[1].data_ptr()),
    )
    driver.pop_context()
    rng = np.random.default_rng(0)
    for a, b in ((0, 1), (1, 0)):
        for block in (2 * KiB, 16 * KiB, 256 * KiB, 4 * MiB):
            count = TOTAL // block
            slots = np.arange(2 * count, dtype=np.uint64)
            src = np.uint64(pools[a].data_ptr()) + rng.permutation(slots)[:count] * np.uint64(block)
            dst = np.uint64(outs[b].data_ptr()) + rng.permutation(slots)[:count] * np.uint64(block)
            sizes = np.full(count, block, dtype=np.uint64)
            nbytes = count * block
            ceil = gpu_ms(lambda: outs[b][:nbytes].copy_(pools[a][:nbytes], non_blocking=True), streams[a])
            line = [f"{a}->{b} {block // KiB:>5}KiB contiguous {nbytes / ceil / 1e6:6.1f}"]
            for side, s in (("src", streams[a]), ("dst", streams[b])):
                for method, ctas in (
                    ("auto", None),
                    ("batch", None),
                    ("kernel", 8),
                    ("kernel", 16),
                    ("kernel", 32),
                    ("kernel", 64),
                    ("kernel", 132),
                ):
                    if side == "dst" and method == "batch":
                        continue
                    try:
                        chose = kvcopy.copy_batch(src, dst, sizes, stream=s, method=method, max_ctas=ctas)
                        ms = gpu_ms(
                            lambda: kvcopy.copy_batch(
                                src, dst, sizes, stream=s, method=method, max_ctas=ctas
                            ),
                            s,
                        )
                        torch.cuda.synchronize(b)
                        ok = torch.equal(
                            outs[b][int(dst[0]) - outs[b].data_ptr() :][:block].cpu(),
                            pools[a][int(src[0]) - pools[a].data_ptr() :][:block].cpu(),
                        )
                        line.append(
                            f"{side}:{method}{ctas or ''}({chose}) "
                            f"{nbytes / ms / 1e6 / (nbytes / ceil / 1e6):.2f}{'' if ok else '!BAD'}"
                        )
                    except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
                        line.append(f"{side}:{method}{ctas or ''} {type(exc).__name__}: {str(exc)[:160]}")
            print(" | ".join(line), flush=True)
    driver.push_context(driver.primary_context(0))
    print("access flags of GPU1 memory from GPU0 after:", driver.pointer_access_flags(pools[1].data_ptr()))
    driver.pop_context()
    return 0


if __name__ == "__main__":
    sys.exit(main())
