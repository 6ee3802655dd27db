"""Where the CPU time of one call goes (cProfile, which also times Cython calls)."""
from __future__ import annotations

import cProfile
import pstats

import numpy as np
import torch

import kvcopy
from kvcopy.bench.workloads import scattered_batch


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
    rng = np.random.default_rng(0)
    stream = torch.cuda.Stream()
    profile("copy_batch 8192 kernel", lambda: kvcopy.copy_batch(s, d, sizes, stream=stream,
                                                                method="kernel"))
    shape = (2048, 16, 8, 128)
    gpu = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(64)]
    host = [torch.empty(shape, dtype=torch.bfloat16, pin_memory=True) for _ in range(64)]
    mapping = np.stack([rng.choice(2048, 1024, replace=False),
                        rng.choice(2048, 1024, replace=False)], axis=1)
    profile("swap_blocks 64x1024", lambda: kvcopy.swap_blocks(gpu, host, mapping, stream=stream),
            calls=50)


if __name__ == "__main__":
    main()
