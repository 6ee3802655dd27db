"""Where one kernel-path copy_batch call spends its CPU time, step by step, inside
the same synchronised loop cpu_overhead.py times (8192 descriptors, 16 KiB blocks,
busy stream). Each step is timed within every call, so the steps add up to the
call and slow calls show which step was slow."""
from __future__ import annotations

import statistics
import time

import torch

from cpu_overhead import BUSY_CYCLES, scattered_batch
from kvcopy import _driver, engine, ring
from kvcopy.arrays import as_u64_array
from kvcopy.context import ContextScope
from kvcopy.streams import effective_handle, resolve_stream


def one_call(s, d, sizes, stream, marks: list[float]) -> None:
    """copy_batch's kernel path (engine._execute_copies), with a timestamp after each step."""
    clock = time.perf_counter
    marks.append(clock())
    src, dst, size_arr = (as_u64_array(a, "x") for a in (s, d, sizes))
    handle = effective_handle(resolve_stream(stream))
    marks.append(clock())
    with ContextScope(handle):
        with ring.ring_for_current_context().reserve(len(size_arr) * 32) as slot:
            marks.append(clock())
            count, total, *kinds, tiles = _driver.describe_copies(src, dst, size_arr, slot.host)
            marks.append(clock())
            target = engine._decide(handle, "auto", count, total, engine._Classes(*kinds))
            marks.append(clock())
            engine._launch_kernel(count, tiles, target, slot, None)
            marks.append(clock())
    marks.append(clock())


STEPS = ("arrays+stream", "scope+reserve", "describe", "decide", "launch+fence", "exit")


def main() -> None:
    _keep, s, d, sizes = scattered_batch()
    stream = torch.cuda.Stream()
    per_step: dict[str, list[float]] = {name: [] for name in STEPS}
    totals = []
    for i in range(220):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(BUSY_CYCLES)
        marks: list[float] = []
        one_call(s, d, sizes, stream, marks)
        stream.synchronize()
        if i < 20:
            continue
        for name, a, b in zip(STEPS, marks, marks[1:]):
            per_step[name].append((b - a) * 1e6)
        totals.append((marks[-1] - marks[0]) * 1e6)
    slow = [i for i, t in enumerate(totals) if t > statistics.median(totals)]
    print(f"steps whole call median_us={statistics.median(totals):.1f} min_us={min(totals):.1f}")
    for name in STEPS:
        v = per_step[name]
        print(f"steps {name:<14} median_us={statistics.median(v):7.1f} min_us={min(v):7.1f} "
              f"median_in_slow_calls_us={statistics.median(v[i] for i in slow):7.1f}")


if __name__ == "__main__":
    main()
