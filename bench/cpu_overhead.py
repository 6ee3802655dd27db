"""CPU time from the Python call to its return, kernel path: copy_batch with 8192
descriptors as NumPy arrays, and swap_blocks over 64 tensors x 1024 block pairs.

Each call is timed in three states: on an idle stream (synchronised just
before the call), on a busy stream (a sleep kernel queued ahead, as when an
engine enqueues copies behind compute), and busy with a warm CPU: the thread
also works (spins) for WARM_SECONDS before the call, as an engine's scheduler
does before it issues a step's copies. Right after a synchronize the CPU may
have clocked down or lost its caches while it waited, which the first two
states include and the third does not. A fourth series, pipelined, times
calls issued back to back (the stream is synchronised after every fourth), as
an engine that keeps several steps' copies in flight issues them. A fifth,
busy_pinned, is the busy state with the thread pinned to one core (as
engines that set CPU affinity run): a synchronise then cannot move the thread
to a core whose caches hold none of its data.
"""

from __future__ import annotations

import statistics
import time

import torch

import kvcopy
from kvcopy_bench.workloads import block_pairs, layered_caches, scattered_batch

KiB = 1 << 10
BUSY_CYCLES = 4_000_000  # ~2 ms of sleep kernel ahead of each timed call
WARM_SECONDS = 0.001
STATES = ("idle", "busy", "busy_warm")


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def cpu_times(call, stream, calls: int = 200) -> dict[str, list[float]]:
    """Call->return microseconds of ``call`` in each of STATES."""
    for _ in range(5):
        call()
    stream.synchronize()
    out: dict[str, list[float]] = {state: [] for state in STATES}
    for _ in range(calls):
        for state in STATES:
            if state != "idle":
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(BUSY_CYCLES)
            if state == "busy_warm":
                spin(WARM_SECONDS)
            t0 = time.perf_counter()
            call()
            out[state].append((time.perf_counter() - t0) * 1e6)
            stream.synchronize()
    out["pipelined"] = []
    for i in range(calls):
        t0 = time.perf_counter()
        call()
        out["pipelined"].append((time.perf_counter() - t0) * 1e6)
        if i % 4 == 3:
            stream.synchronize()
    stream.synchronize()
    out["busy_pinned"] = busy_pinned(call, stream, calls)
    return out


def busy_pinned(call, stream, calls: int) -> list[float]:
    """The busy state with the calling thread pinned to one core."""
    import os

    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {sorted(allowed)[len(allowed) // 2]})  # not core 0 (interrupts)
    try:
        times = []
        for _ in range(calls):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(BUSY_CYCLES)
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e6)
            stream.synchronize()
        return times
    finally:
        os.sched_setaffinity(0, allowed)


def report(label: str, times: dict[str, list[float]]) -> None:
    parts = [
        f"{state}_median_us={statistics.median(v):.1f} "
        f"{state}_p25_us={statistics.quantiles(v, n=4)[0]:.1f} {state}_min_us={min(v):.1f}"
        for state, v in times.items()
    ]
    print(f"cpu_overhead {label} " + " ".join(parts))


def main() -> None:
    count, block = 8192, 16 * KiB
    _keep, s, d, sizes = scattered_batch(count, block)
    stream = torch.cuda.Stream()
    for method in ("kernel", "batch"):
        times = cpu_times(
            lambda m=method: kvcopy.copy_batch(s, d, sizes, stream=stream, method=m),
            stream,
            calls=200 if method == "kernel" else 10,
        )
        report(f"copy_batch method={method} count={count} block={block}", times)


def swap_blocks_overhead(pairs: int = 1024) -> None:
    """swap_blocks over 64 tensors (32 layers, K and V) and ``pairs`` block pairs, kernel path."""
    layers, blocks = 32, max(2048, 2 * pairs)
    gpu, host = layered_caches(blocks, layers)
    mapping = block_pairs(blocks, pairs)
    stream = torch.cuda.Stream()
    for direction, (src, dst) in {"d2h": (gpu, host), "h2d": (host, gpu)}.items():
        used = kvcopy.swap_blocks(src, dst, mapping, stream=stream)
        times = cpu_times(lambda: kvcopy.swap_blocks(src, dst, mapping, stream=stream), stream, calls=50)
        report(f"swap_blocks {direction} tensors={2 * layers} pairs={pairs} method={used}", times)


if __name__ == "__main__":
    import sys

    main()
    for pairs in [int(a) for a in sys.argv[1:]] or [1024]:
        swap_blocks_overhead(pairs)
