"""Where the CPU time of one call goes (cProfile, which also times Cython calls)."""

from __future__ import annotations

import cProfile
import pstats

import torch

import kvcopy
import bench_package  # noqa: F401 - kvcopy_bench's place
from kvcopy_bench.workloads import block_pairs, layered_caches, scattered_batch


def profile(label: str, fn, calls: int = 200) -> None:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    for _ in range(calls):
        prof.enable()
        fn()
        prof.disable()
        torch.cuda.synchronize()  # outside the profile: CPU cost only, no back-pressure
    torch.cuda.synchronize()
    print(f"==== {label}: per call, {calls} calls")
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def main() -> None:
    _keep, s, d, sizes = scattered_batch()
    stream = torch.cuda.Stream()
    profile("copy_batch 8192 kernel", lambda: kvcopy.copy_batch(s, d, sizes, stream=stream, method="kernel"))
    gpu, host = layered_caches(2048)
    mapping = block_pairs(2048, 1024)
    profile("swap_blocks 64x1024", lambda: kvcopy.swap_blocks(gpu, host, mapping, stream=stream), calls=50)


if __name__ == "__main__":
    main()
