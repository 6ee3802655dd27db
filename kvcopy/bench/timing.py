"""Timing by CUDA events (GPU time) and wall clock (CPU time of the call)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class Timing:
    gpu_ms: float        # median, CUDA events around the call on its stream
    cpu_us: float        # median wall time from call to return
    runs: int


def measure(fn: Callable[[], object], stream, *, repeats: int = 7, warmup: int = 2) -> Timing:
    """Median GPU and CPU time of ``fn``, which enqueues work on the torch ``stream``."""
    import torch

    for _ in range(warmup):
        fn()
    stream.synchronize()
    gpu, cpu = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t0 = time.perf_counter()
        fn()
        cpu.append((time.perf_counter() - t0) * 1e6)
        end.record(stream)
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return Timing(statistics.median(gpu), statistics.median(cpu), repeats)
