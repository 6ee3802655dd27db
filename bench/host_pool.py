"""Pinned host pools at scale: time until usable, the stall other processes see while
one is registered, and copy bandwidth to and from it, against torch's pinned memory
and cuMemHostAlloc of the same size, in one run.

For each size (GiB):

- until usable (wall, s): ``kvcopy.pinned_pool`` (huge pages as the host grants
  them, then plain pages, then huge pages touched in waves of 1 GiB each registered
  while the next is touched), its first 64 MiB in the background, torch's
  ``empty(pin_memory=True)``, and ``cuMemHostAlloc``;
- stall (ms): the longest ``cuMemGetInfo`` of a second process, called in a loop
  while the pool is built, against while one ``cuMemHostRegister`` of the same
  (already touched) memory runs;
- bandwidth (GB/s): 1 GiB copies by torch ``copy_`` both ways, median of 5, from a
  pool (each kind of page; registered whole, as one copy needs) and from
  torch-pinned memory, and the pool's ratio to it.

    python3 bench/host_pool.py [--sizes 8 64] [--no-stall] [--cold] [--out FILE.json]

Before the timed builds of a size, one pool of it is built and freed untimed, so that
on a virtual machine whose freed memory stays backed by its host no timed build pays
the host's page faults for the others (one whose kernel reports freed pages to the
host, ``page_reporting``, backs nothing for the next build); ``--cold`` leaves that
out.

Each size needs about twice its memory free on the host at its peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

GiB = 1 << 30
Made = TypeVar("Made")

# A second process timing cuMemGetInfo until the file named by argv[1] exists.
STALL_PROBE = r"""
import os, sys, time
from cuda.bindings import driver as cu
cu.cuInit(0)
_, dev = cu.cuDeviceGet(0)
_, ctx = cu.cuDevicePrimaryCtxRetain(dev)
cu.cuCtxSetCurrent(ctx)
print("ready", flush=True)
worst, calls = 0.0, 0
while not os.path.exists(sys.argv[1]):
    start = time.perf_counter()
    cu.cuMemGetInfo()
    worst = max(worst, time.perf_counter() - start)
    calls += 1
    time.sleep(0.0005)
print(f"{worst * 1e3:.3f} {calls}", flush=True)
"""


def _timed(build: Callable[[], Made]) -> tuple[float, Made]:
    start = time.perf_counter()
    made = build()
    return time.perf_counter() - start, made


def _host_alloc(nbytes: int) -> Callable[[], None]:
    """cuMemHostAlloc of ``nbytes``; returns what frees it."""
    from cuda.bindings import driver as cu

    err, ptr = cu.cuMemHostAlloc(nbytes, cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemHostAlloc: {err.name}")
    return lambda: cu.cuMemFreeHost(ptr)


def until_usable(torch, nbytes: int, warm: bool = True) -> dict:
    import kvcopy
    import kvcopy.policy.host_pool as pool_policy

    found: dict = {}
    if warm:
        # (untimed) a virtual machine's first touch of memory its host has not backed
        # yet costs the host's page faults too: where freed memory stays backed, the
        # first build would pay them for every build after it
        kvcopy.pinned_pool(nbytes).close()
    for pages in ("auto", "none"):
        seconds, pool = _timed(lambda: kvcopy.pinned_pool(nbytes, huge_pages=pages))
        report = pool.wait()
        found[f"pool ({report.pages} pages)"] = seconds
        found.setdefault("pool report", []).append(dataclasses.asdict(report))
        pool.close()
        del pool
    # the same pool touched in waves of 1 GiB, each registered while the next is
    # touched, against the default (POOL_TOUCH_WAVE_BYTES)
    wave = pool_policy.POOL_TOUCH_WAVE_BYTES
    pool_policy.POOL_TOUCH_WAVE_BYTES = GiB
    try:
        seconds, pool = _timed(lambda: kvcopy.pinned_pool(nbytes))
    finally:
        pool_policy.POOL_TOUCH_WAVE_BYTES = wave
    found[f"pool ({pool.wait().pages} pages), waves of 1 GiB"] = seconds
    pool.close()
    del pool
    start = time.perf_counter()
    pool = kvcopy.pinned_pool(nbytes, background=True)
    first = pool.view(0, 64 << 20)
    found["pool, first 64 MiB (background)"] = time.perf_counter() - start
    pool.wait()
    del first
    pool.close()
    del pool
    seconds, tensor = _timed(lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
    found["torch pin_memory=True"] = seconds
    del tensor
    getattr(torch._C, "_host_emptyCache", lambda: None)()  # (torch keeps freed pinned memory)
    seconds, free = _timed(lambda: _host_alloc(nbytes))
    found["cuMemHostAlloc"] = seconds
    free()
    return found


def _stall_during(work: Callable[[], None]) -> float:
    """The longest cuMemGetInfo of a second process while ``work`` runs, ms."""
    with tempfile.TemporaryDirectory() as folder:
        stop = Path(folder) / "stop"
        probe = subprocess.Popen(
            [sys.executable, "-c", STALL_PROBE, str(stop)], stdout=subprocess.PIPE, text=True
        )
        assert probe.stdout is not None
        if probe.stdout.readline().strip() != "ready":
            raise RuntimeError("the stall probe did not start")
        time.sleep(0.2)
        try:
            work()
        finally:
            time.sleep(0.2)
            stop.touch()
        worst, _ = probe.stdout.readline().split()
        probe.wait()
        return float(worst)


def stalls(nbytes: int) -> dict:
    import kvcopy

    def pool() -> None:
        kvcopy.pinned_pool(nbytes).close()

    def one_registration() -> None:
        region = mmap.mmap(-1, nbytes)
        try:  # touched first, as the pool's pages are
            region.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
        except OSError:
            for offset in range(0, nbytes, mmap.PAGESIZE):
                region[offset] = 0
        with kvcopy.register(region, chunk_bytes=nbytes):
            pass
        region.close()

    started = time.perf_counter()
    during_pool = _stall_during(pool)
    pool_s = time.perf_counter() - started
    during_one = _stall_during(one_registration)
    return {"pool": during_pool, "one registration": during_one, "pool build s": pool_s}


def bandwidth(torch, nbytes: int = GiB, repeats: int = 5) -> dict:
    import kvcopy

    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def rates(host) -> dict:
        out = {}
        for way, (dst, src) in {"h2d": (device, host), "d2h": (host, device)}.items():
            times = []
            for _ in range(repeats + 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            out[way] = nbytes / statistics.median(times[1:]) / 1e9
        return out

    found = {}
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    found["torch pinned"] = rates(pinned)
    del pinned
    for pages in ("auto", "none"):
        # one registration: the copy engines refuse a copy across two (as of any pool's)
        pool = kvcopy.pinned_pool(nbytes, huge_pages=pages, chunk_bytes=nbytes)
        array = pool.view()
        kind = pool.wait().pages
        found[f"pool ({kind} pages)"] = rates(torch.from_numpy(array))
        del array
        pool.close()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64], help="pool sizes, GiB")
    parser.add_argument("--no-stall", action="store_true", help="skip the second process's stall")
    parser.add_argument(
        "--cold", action="store_true", help="no untimed build first: the first build finds memory unbacked"
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("host_pool: no CUDA GPU here; this benchmark needs one", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}; {os.cpu_count()} CPUs")
    results: dict = {"device": torch.cuda.get_device_name(), "sizes": {}}
    for size in args.sizes:
        nbytes = size * GiB
        figures: dict = {"until usable s": until_usable(torch, nbytes, warm=not args.cold)}
        for name, value in figures["until usable s"].items():
            if not isinstance(value, list):
                print(f"{size:4d} GiB  until usable  {name:40s} {value:8.2f} s", flush=True)
        if not args.no_stall:
            figures["stall ms"] = stalls(nbytes)
            for name, value in figures["stall ms"].items():
                print(f"{size:4d} GiB  stall         {name:40s} {value:8.1f}", flush=True)
        results["sizes"][size] = figures
    results["bandwidth GB/s"] = bandwidth(torch)
    base = results["bandwidth GB/s"]["torch pinned"]
    for name, rate in results["bandwidth GB/s"].items():
        shown = "  ".join(f"{way} {rate[way]:6.2f} ({rate[way] / base[way]:.3f})" for way in ("h2d", "d2h"))
        print(f"   1 GiB  bandwidth     {name:40s} {shown}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
