"""Timing by CUDA events (GPU time) and wall clock (CPU time and end-to-end time)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

_CYCLES_PER_US = 2000  # a safe upper bound of the SM clock (data-centre GPUs run below 2 GHz)


@dataclass
class Timing:
    gpu_ms: float  # median GPU time of the enqueued work, CUDA events
    cpu_us: float  # median wall time from the call to its return
    wall_ms: float  # median wall time from the call until the stream is idle
    runs: int


def measure(fn: Callable[[], object], stream, *, repeats: int = 7, warmup: int = 2) -> Timing:
    """Median GPU, CPU and end-to-end time of ``fn``, which enqueues on the torch ``stream``.

    The GPU time excludes the call's own CPU time: a sleep kernel keeps the
    stream busy while the call enqueues, so the start event fires only once the
    stream reaches the work. The CPU time and the end-to-end wall time are
    reported beside it.
    """
    import torch

    cpu, gpu, wall = [], [], []
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        cpu.append((time.perf_counter() - t0) * 1e6)
        stream.synchronize()
    cover_cycles = int((max(cpu) * 2 + 200) * _CYCLES_PER_US)
    cpu.clear()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        stream.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cover_cycles)
        start.record(stream)
        t0 = time.perf_counter()
        fn()
        cpu.append((time.perf_counter() - t0) * 1e6)
        end.record(stream)
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return Timing(statistics.median(gpu), statistics.median(cpu), statistics.median(wall), repeats)


def _call_times_us(
    fn: Callable[[], object], synchronize: Callable[[], object], calls: int, warmup: int, timed_sync: bool
) -> list[float]:
    """µs of each of ``calls`` calls of ``fn`` from an idle stream, ``synchronize`` after
    each: inside the timing with ``timed_sync``, outside it otherwise."""
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        if timed_sync:
            synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
        if not timed_sync:
            synchronize()
    return times


def call_to_completion_us(
    fn: Callable[[], object], synchronize: Callable[[], object], *, repeats: int = 300, warmup: int = 10
) -> float:
    """Median wall time of ``fn`` and then ``synchronize`` (from an idle stream), in µs."""
    return statistics.median(_call_times_us(fn, synchronize, repeats, warmup, True))


def call_cpu_us(
    fn: Callable[[], object], synchronize: Callable[[], object], *, calls: int = 200, warmup: int = 20
) -> tuple[float, float]:
    """Median and least CPU time from call to return of ``fn`` (µs), each call made on
    an idle stream (``synchronize`` after each, outside the timing)."""
    times = _call_times_us(fn, synchronize, calls, warmup, False)
    return statistics.median(times), min(times)


def span_ms(
    fn: Callable[[], object],
    first,
    second,
    *,
    repeats: int = 7,
    warmup: int = 2,
    cover_cycles: int | None = 4_000_000,
) -> float:
    """Median GPU time of work ``fn`` enqueues on two torch streams (of one device or
    two), from when both may start until both are done: ``second`` waits for the
    start event on ``first``, and ``first`` for the end of ``second``. A sleep on
    ``first`` covers the call's CPU time, as in measure() (``cover_cycles`` None:
    sized from the warm-up calls' CPU time)."""
    import torch

    times: list[float] = []
    cpu: list[float] = []
    for i in range(warmup + repeats):
        if i == warmup and cover_cycles is None:
            cover_cycles = int((max(cpu) * 2 + 200) * _CYCLES_PER_US)
        first.synchronize()
        second.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        joined = torch.cuda.Event()
        with torch.cuda.stream(first):
            torch.cuda._sleep(cover_cycles or 4_000_000)
        start.record(first)
        second.wait_event(start)
        t0 = time.perf_counter()
        fn()
        cpu.append((time.perf_counter() - t0) * 1e6)
        joined.record(second)
        first.wait_event(joined)
        end.record(first)
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)
