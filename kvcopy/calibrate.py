"""calibrate(): where batched DMA catches up with the copy kernel on this GPU."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np

from kvcopy._runtime import device as devices, first_use, peers
from kvcopy._runtime.calibration_file import rates_of
from kvcopy._runtime.context import relaxed_capture
from kvcopy._cuda import driver, memory
from kvcopy._engine.both_ways import execute_both
from kvcopy.arguments import require_bool, require_int
from kvcopy._engine.dispatch import execute
from kvcopy._plans.copies import plan_copies
from kvcopy.policy import DeviceCaps, Thresholds, dma_crossover, fewest_ctas
from kvcopy.policy.defaults import (
    AUTO_CALIBRATION_BYTES,
    AUTO_CALIBRATION_REPEATS,
    BOTH_WAYS_CALIBRATION_MIN_BYTES,
)

# From 4 KiB: on a host whose SMs read host memory slowly, the copy engines win from
# 16 KiB, where the kernel keeps 0.6 of the link (policy.dma_crossover).
CALIBRATION_BLOCKS = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
# Between two GPUs the kernel keeps NVLink's rate at small blocks: from 64 KiB.
PEER_CALIBRATION_BLOCKS = CALIBRATION_BLOCKS[2:]
# Outside policy.BULK_MIN_BYTES..BULK_MAX_BYTES: the footprint is the register copier's
# (host_ctas), and max_ctas would set the bulk copier's CTAs inside that window.
FOOTPRINT_BLOCKS = (4 << 10, 256 << 10)
FOOTPRINT_CTAS = (1, 2, 4, 8, 16)
FOOTPRINT_FLOOR = 0.90
# A store and a load at once (copy_both_ways): the copy engines' CPU cost per copy,
# which differs between hosts, decides from which block size they beat the kernel pair.
BOTH_WAYS_BLOCKS = (32 << 10, 64 << 10, 128 << 10, 256 << 10)
# The least scratch a calibration may be given: two blocks of the largest size measured.
CALIBRATION_MIN_BYTES = 2 * max(CALIBRATION_BLOCKS)


def _scattered_plan(src_base: int, dst_base: int, block: int, total: int, rng):
    """Blocks at random, non-adjacent slots of two pools twice the batch's size."""
    count = max(total // block, 2)
    slots = np.arange(2 * count, dtype=np.uint64)
    src = np.uint64(src_base) + rng.permutation(slots)[:count] * np.uint64(block)
    dst = np.uint64(dst_base) + rng.permutation(slots)[:count] * np.uint64(block)
    return plan_copies(src, dst, np.full(count, block, dtype=np.uint64), merge=False)


def _median_ms(run, stream: int, start: int, end: int, repeats: int, primed: bool = False) -> float:
    """Median time of ``run``'s work from the call to the end of the work, which
    counts the call's CPU time where the GPU waits for it (batched DMA's cost per
    copy). ``primed``: each measured call is enqueued while the call before it
    still runs, which leaves the CPU time out wherever it is shorter than the GPU
    time (the copy kernel's own speed, for its footprint)."""
    run()  # warm-up
    times = []
    for _ in range(repeats):
        if primed:
            run()
        driver.event_record(start, stream)
        run()
        driver.event_record(end, stream)
        driver.event_synchronize(end)
        times.append(driver.event_elapsed_ms(start, end))
    return sorted(times)[len(times) // 2]


def _release(stream: int, start: int, end: int, device_memory: int) -> None:
    """Free what a calibration allocated in the current context (0: not allocated)."""
    for event in (start, end):
        if event:
            driver.event_destroy(event)
    if stream:
        driver.stream_synchronize(stream)
        driver.stream_destroy(stream)
    if device_memory:
        memory.mem_free(device_memory)


def _footprint(src: int, dst: int, total_bytes: int, time_ms, rng) -> tuple[int, dict]:
    """The fewest copy-kernel CTAs that keep one direction at FOOTPRINT_FLOOR of the
    contiguous copy (one cuMemcpyAsync of the same bytes) at every FOOTPRINT_BLOCKS
    size; and the fractions behind it (CTAs -> the worst over the sizes)."""
    contiguous = plan_copies(
        np.array([src], np.uint64), np.array([dst], np.uint64), np.array([total_bytes], np.uint64)
    )
    reference = time_ms(contiguous, "loop", None)
    worst: dict = {}
    for block in FOOTPRINT_BLOCKS:
        plan = _scattered_plan(src, dst, block, total_bytes, rng)
        for ctas in FOOTPRINT_CTAS:
            fraction = reference * plan.total_bytes / total_bytes / time_ms(plan, "kernel", ctas)
            worst[ctas] = min(worst.get(ctas, fraction), fraction)
    return fewest_ctas(worst, FOOTPRINT_FLOOR), worst


def _both_ways_threshold(
    device: int,
    host: int,
    dev: int,
    total_bytes: int,
    stream: int,
    events: tuple[int, int],
    repeats: int,
    rng,
) -> tuple[float, dict]:
    """The smallest BOTH_WAYS_BLOCKS size from which a store and a load at once by
    copy engines (interleaved chunks) keep up with the kernel pair at every larger
    size, each timed from the call to the end of both; and the GB/s behind it. The
    load goes host[0:T] -> dev[0:T], the store dev[T:2T] -> host[T:2T] (T =
    total_bytes), so the two never touch the same bytes."""
    # 'auto' with a crossover of 0 sends both sides to the engines, 'kernel' fuses them;
    # the crossover is this measurement's own: other threads' copies decide as before
    engines = dataclasses.replace(devices.thresholds(device), both_ways_batch_min_bytes=0)
    by_block, measured = {}, {}
    for block in BOTH_WAYS_BLOCKS:
        load = _scattered_plan(host, dev, block, total_bytes // 2, rng)
        store = _scattered_plan(dev + total_bytes, host + total_bytes, block, total_bytes // 2, rng)
        pair = ((store.src, store.dst, store.sizes), (load.src, load.dst, load.sizes))
        gbps: dict = {}
        for method, label in (("kernel", "kernel"), ("auto", "batch")):

            def run(m: str = method) -> tuple[str, str]:
                return execute_both(*pair, stream, m, thresholds=engines)

            if run() != (label, label):
                continue  # that path is not available here
            ms = _median_ms(run, stream, *events, repeats)
            gbps[label] = (store.total_bytes + load.total_bytes) / ms / 1e6
        measured[f"both_ways/{block}"] = by_block[block] = gbps
    return dma_crossover(by_block), measured


def measures_both_ways(caps: DeviceCaps, total_bytes: int) -> bool:
    """Whether a calibration of ``total_bytes`` measures a store and a load at once: both
    paths there to compare, and enough bytes that the copy engines' submission does not
    outweigh their rate (policy.BOTH_WAYS_CALIBRATION_MIN_BYTES)."""
    return bool(caps.kernel_available and caps.batch_available) and (
        total_bytes >= BOTH_WAYS_CALIBRATION_MIN_BYTES
    )


def _save(info: devices.DeviceInfo, updates: dict, measured: dict) -> None:
    """Persist a calibration; a cache folder that cannot be written costs the file, not
    the result (it is in use in this process already)."""
    try:
        devices.save_thresholds(info, updates, measured)
    except OSError as exc:
        warnings.warn(
            f"kvcopy: the calibration of device {info.ordinal} is in use but could "
            f"not be saved ({exc}); set KVCOPY_CACHE_DIR to a writable folder",
            RuntimeWarning,
            stacklevel=3,
        )


def _check_args(total_bytes: Any, repeats: Any, save_result: Any, minimum_bytes: int) -> None:
    require_int(total_bytes, "total_bytes", minimum=minimum_bytes, maximum=1 << 40)
    require_int(repeats, "repeats", minimum=1, maximum=1000)
    require_bool(save_result, "save_result")


def _check_device(value: Any, name: str) -> int:
    """``value`` as a device ordinal this process sees; call _check_ordinal first."""
    ordinal = _check_ordinal(value, name)
    count = driver.device_count()
    if ordinal >= count:
        raise ValueError(
            f"{name} is {ordinal}, but this process sees {count} device{'' if count == 1 else 's'}"
        )
    return ordinal


def _check_ordinal(value: Any, name: str) -> int:
    """``value`` as a device ordinal, checked before the driver is loaded."""
    return require_int(value, name, minimum=0, maximum=1 << 16)


def calibrate(
    device: int = 0, *, total_bytes: int = 64 << 20, repeats: int = 5, save_result: bool = True
) -> Thresholds:
    """Measure, on this GPU and host, where batched DMA catches up with the copy
    kernel (one way, and for a store and a load at once: copy_both_ways), and the
    fewest copy-kernel CTAs that keep each host direction at 0.90 of the contiguous
    copy (the default footprint, config.host_ctas=None). A store and a load at once
    are measured only with ``total_bytes`` of at least 64 MiB (the default): less
    misjudges the copy engines there, and the crossover held before stays.

    Uses only scratch memory it allocates (2 x total_bytes on the device and in
    pinned host memory) and a stream of its own; takes a few seconds. The result
    is used by method='auto' from then on and, with save_result, persisted for this
    GPU, its PCIe link, this host and this driver (a host where any of them differs
    measures again).
    """
    _check_args(total_bytes, repeats, save_result, CALIBRATION_MIN_BYTES)
    _check_ordinal(device, "device")
    driver.init()
    device = _check_device(device, "device")
    driver.push_context(driver.primary_context(device))
    stream = dev = host = start = end = 0
    try:
        info = devices.device_info(device)
        stream = driver.stream_create()
        dev = memory.mem_alloc(2 * total_bytes)
        host = memory.host_alloc(2 * total_bytes)
        start, end = driver.event_create(timing=True), driver.event_create(timing=True)
        rng = np.random.default_rng(0)
        measured: dict = {}
        found: dict = {}
        ctas: dict = {}
        methods = ["kernel"] + (["batch"] if info.caps.batch_available else [])

        def time_ms(plan, method, max_ctas) -> float:
            return _median_ms(
                lambda: execute(plan, stream, method, max_ctas=max_ctas),
                stream,
                start,
                end,
                repeats,
                primed=True,
            )

        for direction, (src, dst) in {"h2d": (host, dev), "d2h": (dev, host)}.items():
            if info.caps.kernel_available:
                ctas[direction], fractions = _footprint(src, dst, total_bytes, time_ms, rng)
                measured[f"{direction}/ctas"] = fractions
            by_block: dict = {}
            for block in CALIBRATION_BLOCKS:
                plan = _scattered_plan(src, dst, block, total_bytes, rng)
                gbps = {}
                for method in methods:
                    ms = _median_ms(lambda: execute(plan, stream, method), stream, start, end, repeats)
                    gbps[method] = plan.total_bytes / ms / 1e6
                measured[f"{direction}/{block}"] = by_block[block] = gbps
            found[direction] = dma_crossover(by_block)
        before = devices.thresholds(device)
        updates: dict = {"batch_min_bytes": found, "host_ctas": ctas}
        if measures_both_ways(info.caps, total_bytes):
            updates["both_ways_batch_min_bytes"], by_block = _both_ways_threshold(
                device, host, dev, total_bytes, stream, (start, end), repeats, rng
            )
            measured.update(by_block)
        result = dataclasses.replace(
            before,
            batch_min_bytes={**before.batch_min_bytes, **found},
            host_ctas={**before.host_ctas, **ctas},
            both_ways_batch_min_bytes=updates.get(
                "both_ways_batch_min_bytes", before.both_ways_batch_min_bytes
            ),
            rates={**before.rates, **rates_of(measured)},
        )
        devices.set_thresholds(device, result)
        if save_result:
            _save(info, updates, measured)
        return result
    finally:
        _release(stream, start, end, dev)
        if host:
            memory.host_free(host)
        driver.pop_context()


def calibrate_peers(
    src_device: int = 0,
    dst_device: int = 1,
    *,
    total_bytes: int = 128 << 20,
    repeats: int = 5,
    save_result: bool = True,
) -> Thresholds:
    """Measure, for copies between two GPUs in both directions, where batched DMA
    catches up with the copy kernel; the result is stored under 'p2p A>B' in the
    thresholds of the source device A, which launches such copies for tensors
    (swap_blocks and TransferQueue run them on the source GPU).

    Peer access is enabled first where possible (config.enable_peer_access);
    without it the kernel cannot reach the other GPU and only DMA is measured
    (no threshold is stored). Uses scratch memory it allocates (2 x total_bytes
    on each GPU) and streams of its own. Returns the source device's thresholds.
    """
    _check_args(total_bytes, repeats, save_result, CALIBRATION_MIN_BYTES)
    if _check_ordinal(src_device, "src_device") == _check_ordinal(dst_device, "dst_device"):
        raise ValueError(
            f"src_device and dst_device are both {int(src_device)}; "
            "calibrate_peers measures copies between two GPUs"
        )
    driver.init()
    src_device = _check_device(src_device, "src_device")
    dst_device = _check_device(dst_device, "dst_device")
    for a, b in ((src_device, dst_device), (dst_device, src_device)):
        _calibrate_pair(a, b, total_bytes, repeats, save_result)
    return devices.thresholds(src_device)


def _calibrate_pair(a: int, b: int, total_bytes: int, repeats: int, save_result: bool) -> None:
    """calibrate_peers for copies from device a to device b, launched on a."""
    driver.push_context(driver.primary_context(b))
    dst = memory.mem_alloc(2 * total_bytes)
    driver.pop_context()
    driver.push_context(driver.primary_context(a))
    stream = src = start = end = 0
    try:
        info = devices.device_info(a)
        peers.enable_for(a, [b])
        stream = driver.stream_create()
        src = memory.mem_alloc(2 * total_bytes)
        start, end = driver.event_create(timing=True), driver.event_create(timing=True)
        rng = np.random.default_rng(0)
        key = f"p2p {a}>{b}"
        by_block, measured = {}, {}
        for block in PEER_CALIBRATION_BLOCKS:
            plan = _scattered_plan(src, dst, block, total_bytes, rng)
            gbps = {}
            for method in ("kernel", "batch"):
                if method == "batch" and not info.caps.batch_available:
                    continue
                try:
                    ms = _median_ms(lambda: execute(plan, stream, method), stream, start, end, repeats)
                except ValueError:  # the kernel cannot reach device b: nothing to calibrate
                    return
                gbps[method] = plan.total_bytes / ms / 1e6
            measured[f"{key}/{block}"] = by_block[block] = gbps
        found = dma_crossover(by_block)
        before = devices.thresholds(a)
        result = dataclasses.replace(before, batch_min_bytes={**before.batch_min_bytes, key: found})
        devices.set_thresholds(a, result)
        if save_result:
            _save(info, {"batch_min_bytes": {key: found}}, measured)
    finally:
        _release(stream, start, end, src)
        driver.pop_context()
        driver.push_context(driver.primary_context(b))
        memory.mem_free(dst)
        driver.pop_context()


def _measure_at_first_use(ordinal: int) -> None:
    """calibrate() as kvcopy._runtime.first_use runs it, on its own thread: in relaxed
    capture mode (a graph another thread captures forbids none of its calls, and its
    stream and memory are its own, so it joins none), with a small scratch."""
    with relaxed_capture():
        calibrate(ordinal, total_bytes=AUTO_CALIBRATION_BYTES, repeats=AUTO_CALIBRATION_REPEATS)


first_use.measure = _measure_at_first_use
