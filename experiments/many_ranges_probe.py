"""Experiment: caches the driver sees as many allocations.

kvcopy asks the driver what each allocation is once per call and keeps the answers
as address ranges (kvcopy/_cuda/classify.pxd, 64 of them). Two allocation patterns
of other projects make one cache many ranges:
- torch's expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
  map a large tensor as many separately created chunks in one reserved address range;
- SGLang's HiCache registers its host pool with cudaHostRegister in pieces.
Measured here, for each (a plain allocation alongside as the reference):
- what cuPointerGetAttributes says the range is at a few offsets;
- copy_batch of 4096 scattered 16 KiB blocks between a 2 GiB GPU cache and a host
  pool (1 GiB): the call's CPU time (median of 20, stream idle), the method, and
  whether every block arrived;
- with expandable segments, a batch of a good copy and one from an address inside the
  segment's reserved range that nothing is mapped at, by each method, and whether the
  context survives.

Run on a GPU: python3 experiments/many_ranges_probe.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import ctypes, json, mmap, statistics, time
import numpy as np, torch, kvcopy

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BLOCK, COUNT = 16 * KiB, 4096
out = {"alloc_conf": __import__("os").environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}

libcuda = ctypes.CDLL("libcuda.so.1")
ATTRS = (("range start", 11, True), ("range size", 12, False), ("mapped", 13, None),
         ("mapping start", 19, True), ("mapping size", 18, False))
def ranges(base, offsets):
    # [offset, range start, range size, mapped, mapping start, mapping size], MiB, by
    # cuPointerGetAttribute itself (cuda.bindings' wrapper refuses the mapping ones)
    got = []
    for off in offsets:
        row = [off // MiB]
        for _, attr, rel in ATTRS:
            value = ctypes.c_uint64(0)
            err = libcuda.cuPointerGetAttribute(ctypes.byref(value), attr,
                                                ctypes.c_uint64(base + off))
            if err:
                row.append(f"error {err}")
            elif rel is None:
                row.append(bool(value.value & 0xFF))
            else:
                row.append(((value.value - base) if rel else value.value) / MiB)
        got.append(row)
    return got

gpu = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
gpu.random_(0, 255)
out["gpu [offset, range start, size, mapped, mapping start, size] MiB"] = ranges(
    gpu.data_ptr(), [0, 100 * MiB, GiB, 2 * GiB - MiB, 100 * GiB])

if HOST == "registered":
    buf = mmap.mmap(-1, GiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    host_np = np.frombuffer(buf, dtype=np.uint8)
    base = host_np.ctypes.data
    cudart = torch.cuda.cudart()
    for off in range(0, GiB, 2 * MiB):
        assert cudart.cudaHostRegister(base + off, 2 * MiB, 0) == 0
    host = torch.from_numpy(host_np)
else:
    host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
host.copy_(torch.randint(0, 255, (GiB,), dtype=torch.uint8))
out["host"] = HOST
out["host [offset, range start, size, mapped, mapping start, size] MiB"] = ranges(
    host.data_ptr(), [0, 100 * MiB, GiB - MiB])

rng = np.random.default_rng(0)
g_slots = rng.permutation(gpu.numel() // BLOCK)[:COUNT].astype(np.uint64)
h_slots = rng.permutation(host.numel() // BLOCK)[:COUNT].astype(np.uint64)
g_ptrs = np.uint64(gpu.data_ptr()) + g_slots * np.uint64(BLOCK)
h_ptrs = np.uint64(host.data_ptr()) + h_slots * np.uint64(BLOCK)
sizes = np.full(COUNT, BLOCK, dtype=np.uint64)
g_index = torch.from_numpy(g_slots.astype(np.int64)).cuda()
h_index = torch.from_numpy(h_slots.astype(np.int64))
s = torch.cuda.Stream()
for name, src, dst in (("h2d", h_ptrs, g_ptrs), ("d2h", g_ptrs, h_ptrs)):
    chose = kvcopy.copy_batch(src, dst, sizes, stream=s)
    s.synchronize()
    gpu_blocks = gpu.view(-1, BLOCK)[g_index].cpu()
    host_blocks = host.view(-1, BLOCK)[h_index]
    ok = torch.equal(gpu_blocks, host_blocks)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        kvcopy.copy_batch(src, dst, sizes, stream=s)
        times.append((time.perf_counter() - t0) * 1e6)
        s.synchronize()
    out[name] = {"chose": chose, "bytes ok": bool(ok), "cpu_us": round(statistics.median(times), 1)}
print(json.dumps(out))
"""


BAD_CHILD = r"""
import json, numpy as np, torch, kvcopy
gpu = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
host = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
bad = gpu.data_ptr() + (100 << 30)      # inside the segment's reservation, not mapped
s = torch.cuda.Stream()
try:
    # a good copy first: its range is the one the bad pointer is then checked against
    chose = kvcopy.copy_batch([gpu.data_ptr(), bad], [host.data_ptr(), host.data_ptr() + 8192],
                              [4096, 4096], stream=s, method=METHOD)
    s.synchronize()
    out = f"copied by {chose}, no error"
except Exception as e:
    out = f"{type(e).__name__}: {e}"
try:
    torch.cuda.synchronize(); torch.ones(1, device="cuda").sum().item(); after = "usable"
except Exception as e:
    after = f"unusable: {type(e).__name__}: {str(e)[:120]}"
print(json.dumps({"method": METHOD, "result": out[:300], "context after": after}))
"""


def main() -> None:
    for conf, host in (("", "pinned"), ("expandable_segments:True", "pinned"), ("", "registered")):
        env = dict(os.environ)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        run = subprocess.run(
            [sys.executable, "-c", f"HOST = {host!r}\n" + CHILD],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        if run.returncode:
            print(run.stderr[-3000:])
            continue
        print(json.dumps(json.loads(run.stdout.strip().splitlines()[-1])))
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    for method in ("kernel", "batch", "loop", "auto"):
        run = subprocess.run(
            [sys.executable, "-c", BAD_CHILD.replace("METHOD", repr(method))],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        print(
            run.stdout.strip().splitlines()[-1]
            if run.stdout.strip()
            else f"{method}: exit {run.returncode}: {run.stderr[-300:]}"
        )


if __name__ == "__main__":
    main()
