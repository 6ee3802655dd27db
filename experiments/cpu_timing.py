"""The median CPU time of a call, for the probes that need no GPU."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_us(fn: Callable[[], object], calls: int = 400) -> float:
    """Median microseconds of ``calls`` calls of ``fn``, after one call to warm up."""
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6
