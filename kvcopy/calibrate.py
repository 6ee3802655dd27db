"""calibrate(): where batched DMA catches up with the copy kernel on this GPU."""
from __future__ import annotations

import numpy as np

from kvcopy import device as devices
from kvcopy._cuda import driver
from kvcopy.engine import execute
from kvcopy.plan import plan_copies
from kvcopy.policy import Thresholds

CALIBRATION_BLOCKS = (64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _scattered_plan(src_base: int, dst_base: int, block: int, total: int, rng):
    """Blocks at random, non-adjacent slots of two pools twice the batch's size."""
    count = max(total // block, 2)
    slots = np.arange(2 * count, dtype=np.uint64)
    src = np.uint64(src_base) + rng.permutation(slots)[:count] * np.uint64(block)
    dst = np.uint64(dst_base) + rng.permutation(slots)[:count] * np.uint64(block)
    return plan_copies(src, dst, np.full(count, block, dtype=np.uint64), merge=False)


def _median_ms(run, stream: int, start: int, end: int, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        driver.event_record(start, stream)
        run()
        driver.event_record(end, stream)
        driver.event_synchronize(end)
        times.append(driver.event_elapsed_ms(start, end))
    return sorted(times)[len(times) // 2]


def calibrate(device: int = 0, *, total_bytes: int = 64 << 20, repeats: int = 5,
              save_result: bool = True) -> Thresholds:
    """Measure where batched DMA catches up with the copy kernel on this GPU.

    Uses only scratch memory it allocates (2 x total_bytes on the device and in
    pinned host memory) and a stream of its own; takes a few seconds. The result
    is used by method='auto' from then on and, with save_result, persisted per
    device model and driver version.
    """
    driver.init()
    driver.push_context(driver.primary_context(device))
    stream = dev = host = start = end = 0
    try:
        info = devices.device_info(device)
        stream = driver.stream_create()
        dev = driver.mem_alloc(2 * total_bytes)
        host = driver.host_alloc(2 * total_bytes)
        start, end = driver.event_create(timing=True), driver.event_create(timing=True)
        rng = np.random.default_rng(0)
        measured: dict = {}
        found: dict = {}
        methods = ["kernel"] + (["batch"] if info.caps.batch_available else [])
        for direction, (src, dst) in {"h2d": (host, dev), "d2h": (dev, host)}.items():
            found[direction] = float("inf")
            for block in CALIBRATION_BLOCKS:
                plan = _scattered_plan(src, dst, block, total_bytes, rng)
                gbps = {}
                for method in methods:
                    ms = _median_ms(lambda: execute(plan, stream, method), stream, start, end, repeats)
                    gbps[method] = plan.total_bytes / ms / 1e6
                measured[f"{direction}/{block}"] = gbps
                batch_wins = "batch" in gbps and gbps["batch"] >= 0.98 * gbps["kernel"]
                if batch_wins and found[direction] == float("inf"):
                    found[direction] = float(block)
                elif not batch_wins:
                    found[direction] = float("inf")
        result = Thresholds(batch_min_bytes=found)
        devices.set_thresholds(device, result)
        if save_result:
            devices.save_thresholds(info, result, measured)
        return result
    finally:
        for event in (start, end):
            if event:
                driver.event_destroy(event)
        if stream:
            driver.stream_synchronize(stream)
            driver.stream_destroy(stream)
        if dev:
            driver.mem_free(dev)
        if host:
            driver.host_free(host)
        driver.pop_context()
