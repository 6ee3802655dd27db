"""Faults, threads, huge batches, leaks, graph capture and environment, on a real GPU."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

import kvcopy
from helpers.child import run_child
from helpers.gpu import make_pool, ordered_stream
from kvcopy.calibrate import BOTH_WAYS_BLOCKS, FOOTPRINT_CTAS
from kvcopy.testing import cuda


FAULT_CHILD = r"""
import json, numpy as np, torch, kvcopy
from kvcopy.testing import cuda
kv_memory = cuda.memory
torch.cuda.init(); torch.zeros(1, device="cuda")
MiB = 1 << 20
a, b = kv_memory.mem_alloc(MiB), kv_memory.mem_alloc(MiB)
kv_memory.memset_d8_async(a, 7, MiB, 1); torch.cuda.synchronize()
src = np.array([a + i * 4096 for i in range(10)], dtype=np.uint64)
dst = np.array([b + i * 8192 for i in range(10)], dtype=np.uint64)
sizes = np.full(10, 4096, dtype=np.uint64)
sizes[7] = 64 * MiB          # runs far past both allocations
s = torch.cuda.Stream()
out = {}
try:
    # (copy 7 now also writes over copies 8 and 9, which kvcopy would refuse before the
    # driver: the check is left out, so that the driver's own failure is what is tested)
    kvcopy.copy_batch(src, dst, sizes, stream=s, method=METHOD, check_overlap=False)
    s.synchronize()
    out["raised"] = None
except kvcopy.CudaError as e:
    out.update(raised=e.name, index=e.index, message=str(e))
sizes[7] = 4096
kv_memory.memset_d8_async(b, 0, MiB, 1); torch.cuda.synchronize()
used = kvcopy.copy_batch(src, dst, sizes, stream=s, method=METHOD)
s.synchronize()
host = np.empty(MiB, np.uint8)
torch.cuda.synchronize()
t = torch.empty(MiB, dtype=torch.uint8, device="cuda")
kvcopy.copy_batch([b], [t.data_ptr()], [MiB], stream=1); torch.cuda.synchronize()
got = t.cpu().numpy()
out["after_ok"] = bool(all((got[i * 8192:i * 8192 + 4096] == 7).all() for i in range(10)))
out["after_method"] = used
print(json.dumps(out))
"""


@pytest.mark.parametrize("method", ["loop", "batch"])
def test_invalid_copy_mid_batch_names_its_index_and_the_library_stays_usable(torch_cuda, method):
    res = run_child(FAULT_CHILD.replace("METHOD", repr(method)))
    assert res["raised"] == "CUDA_ERROR_INVALID_VALUE", res
    if method == "loop":
        assert res["index"] == 7
    else:  # the 13.0 driver ABI reports no failing index; 12.8 does
        assert res["index"] in (7, None)
    assert res["after_ok"] and res["after_method"] == method


def test_explicit_kernel_refuses_memory_it_cannot_map(torch_cuda):
    # a copy running past its allocation is not given to the kernel: it would fault.
    # (allocations of the driver's own, of exactly 1 MiB: a framework's caching
    # allocator may hand out a tensor inside a larger allocation, which the copy would
    # then not run past; the overlap check is off, since the range run past may hold
    # the other allocation)
    torch_cuda.zeros(1, device="cuda")
    a, b = cuda.memory.mem_alloc(1 << 20), cuda.memory.host_alloc(1 << 20)
    try:
        with pytest.raises(ValueError, match="method='kernel' needs"):
            kvcopy.copy_batch(
                [a, a + 8192], [b, b + 8192], [4096, 8 << 20], method="kernel", check_overlap=False
            )
    finally:
        cuda.memory.mem_free(a)
        cuda.memory.host_free(b)


KERNEL_FAULT_CHILD = r"""
import json, numpy as np, torch, kvcopy
from kvcopy.testing import cuda
kv_driver, kv_launch = cuda.driver, cuda.launch
from kvcopy.testing import engine
kernels, device = engine.kernels, engine.device
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
info = device.device_info(0)
k = kernels.kernel_for_current_context(*info.cc, info.driver_version)
# never mapped for the device: above the 47 bits of a host process's address space,
# where unified addressing places no allocation (an address within that space can fall
# inside one of the process's allocations and be read without a fault)
bogus = np.array([0x1000000001000], dtype=np.uint64)
good = np.array([torch.empty(64, device="cuda").data_ptr()], dtype=np.uint64)
out = {}
descs = np.zeros(4, dtype=np.uint64)   # one kvcopy_desc: dst <- src bytes, raw (unchecked) pointers
descs[:] = [good[0], bogus[0], 256, 0]
kv_launch.launch_descs_inline(k.function, k.per_launch, descs.ctypes.data, 1, 1, 32, 1)
try:
    kv_driver.stream_synchronize(1)
    out["sync"] = "ok"
except kvcopy.CudaError as e:
    out["sync"] = e.name
try:
    kvcopy.copy_batch([good[0]], [good[0] + 128], [64], stream=1); kv_driver.stream_synchronize(1)
    out["after"] = "ok"
except kvcopy.CudaError as e:
    out["after"] = e.name
print(json.dumps(out))
"""


def test_illegal_address_in_the_kernel_poisons_the_context(torch_cuda):
    """Documented: a fault inside a kernel is sticky; the process must restart its CUDA work."""
    res = run_child(KERNEL_FAULT_CHILD)
    assert res["sync"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert res["after"] == "CUDA_ERROR_ILLEGAL_ADDRESS"


# ------------------------------------------------------------------ load


def test_eight_threads_thousand_calls_each(torch_cuda):
    torch = torch_cuda
    calls, per_call, block = 1000, 16, 256
    src = make_pool("pinned", per_call * block * 8, 21)
    errors = []

    def worker(t: int) -> None:
        try:
            dst = torch.zeros(calls * per_call * block, dtype=torch.uint8, device="cuda")
            stream = ordered_stream(torch)
            rng = np.random.default_rng(t)
            picks = []
            for i in range(calls):
                pick = rng.integers(0, per_call * 8, per_call)
                picks.append(pick)
                kvcopy.copy_batch(
                    src.data_ptr() + pick * block,
                    dst.data_ptr() + (i * per_call + np.arange(per_call)) * block,
                    np.full(per_call, block),
                    stream=stream,
                )
            stream.synchronize()
            got = dst.cpu().numpy().reshape(calls * per_call, block)
            want = src.numpy().reshape(-1, block)[np.concatenate(picks)]
            if not np.array_equal(got, want):
                errors.append(f"thread {t}: data mismatch")
        except Exception as exc:  # noqa: BLE001
            errors.append(f"thread {t}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("method", ["auto", "batch", "loop", "kernel"])
def test_200000_descriptors(torch_cuda, method):
    torch = torch_cuda
    n, block = 200_000, 64
    src = make_pool("pinned", n * block * 2, 31)
    dst = torch.zeros(n * block * 2, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(5)
    s_off = rng.permutation(2 * n)[:n] * block
    d_off = rng.permutation(2 * n)[:n] * block
    stream = ordered_stream(torch)
    kvcopy.copy_batch(
        src.data_ptr() + s_off, dst.data_ptr() + d_off, np.full(n, block), stream=stream, method=method
    )
    stream.synchronize()
    got = dst.cpu().numpy().reshape(-1, block)[d_off // block]
    want = src.numpy().reshape(-1, block)[s_off // block]
    assert np.array_equal(got, want)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.alone  # (the device's free memory: another process's allocations move it)
def test_100000_calls_do_not_grow_memory(torch_cuda):
    torch = torch_cuda
    src = make_pool("pinned", 1 << 20, 41)
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    s_ptrs = np.uint64(src.data_ptr()) + np.arange(16, dtype=np.uint64) * np.uint64(8192)
    d_ptrs = np.uint64(dst.data_ptr()) + np.arange(16, dtype=np.uint64) * np.uint64(16384)
    sizes = np.full(16, 4096, dtype=np.uint64)
    big_s = np.uint64(src.data_ptr()) + np.arange(2000, dtype=np.uint64) * np.uint64(256)
    big_d = np.uint64(dst.data_ptr()) + np.arange(2000, dtype=np.uint64) * np.uint64(512)
    big_sizes = np.full(2000, 128, dtype=np.uint64)
    stream = torch.cuda.Stream()

    def burst(count: int) -> None:
        for i in range(count):
            if i % 10 == 0:  # the staged (ring) path too
                kvcopy.copy_batch(big_s, big_d, big_sizes, stream=stream)
            kvcopy.copy_batch(s_ptrs, d_ptrs, sizes, stream=stream)
            if i % 1000 == 0:
                stream.synchronize()
        stream.synchronize()

    burst(2000)
    rss, free = _rss_bytes(), torch.cuda.mem_get_info()[0]
    burst(100_000)
    assert _rss_bytes() - rss < 32 << 20
    assert free - torch.cuda.mem_get_info()[0] < 64 << 20
    assert torch.equal(dst[:4096].cpu(), src[:4096])


def test_calibrate_and_queue_close_repeated(torch_cuda, tmp_path, monkeypatch):
    torch = torch_cuda
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(tmp_path))
    for _ in range(2):
        thresholds = kvcopy.calibrate(total_bytes=64 << 20, repeats=3)  # (both ways too)
        # plus the 'p2p' default and any 'p2p A>B' entries calibrate_peers stored earlier
        assert {"h2d", "d2h", "p2p"} <= set(thresholds.batch_min_bytes)
        assert all(k.startswith("p2p") for k in set(thresholds.batch_min_bytes) - {"h2d", "d2h"})
        # the footprint: the fewest CTAs measured at 0.90 of the contiguous copy each way
        assert set(thresholds.host_ctas) == {"h2d", "d2h"}
        assert set(thresholds.host_ctas.values()) <= set(FOOTPRINT_CTAS)
    saved = json.loads(next(tmp_path.glob("calibration-*.json")).read_text())
    assert saved["host_ctas"] == thresholds.host_ctas
    assert {"h2d/ctas", "d2h/ctas"} <= set(saved["measurements"])
    # both ways at once: kernel pair and engines measured at each size, and the
    # crossover is the first size from which the engines keep up to the end
    both = {block: saved["measurements"][f"both_ways/{block}"] for block in BOTH_WAYS_BLOCKS}
    assert all(set(gbps) == {"kernel", "batch"} and min(gbps.values()) > 0 for gbps in both.values())
    keeps_up = [gbps["batch"] >= 0.98 * gbps["kernel"] for gbps in both.values()]
    expected = float("inf")
    for block, ok in zip(reversed(BOTH_WAYS_BLOCKS), reversed(keeps_up)):
        if not ok:
            break
        expected = block
    assert thresholds.both_ways_batch_min_bytes == expected
    # 'never' (no size from which the engines keep up) is stored as null: strict JSON
    assert saved["both_ways_batch_min_bytes"] == (None if expected == float("inf") else expected)
    gpu = torch.zeros((8, 256), device="cuda")
    host = torch.ones((8, 256)).pin_memory()
    # one queue first: its job may be the process's first block-kernel launch, and the
    # driver loads that kernel (lazy loading) and sizes its local memory then (about
    # 100 MB where this test runs first in a process)
    with kvcopy.TransferQueue(host, gpu) as q:
        q.submit("first", [[0, 1]])
    free = torch.cuda.mem_get_info()[0]
    for i in range(50):
        with kvcopy.TransferQueue(host, gpu) as q:
            q.submit(i, [[i % 8, (i + 1) % 8]])
    assert free - torch.cuda.mem_get_info()[0] < 16 << 20
    from kvcopy.testing import engine

    device = engine.device

    device.set_thresholds(0, kvcopy.policy.Thresholds())  # leave the defaults for other tests


# ------------------------------------------------------------------ capture with cuda.core


@pytest.mark.parametrize("method", ["auto", "loop", "kernel"])
def test_capture_on_a_cuda_core_stream(torch_cuda, method):
    core = pytest.importorskip("cuda.core")
    from cuda.bindings import driver

    dev = core.Device(0)
    dev.set_current()
    stream = dev.create_stream()
    handle = kvcopy.resolve_stream(stream)
    src = make_pool("pinned", 1 << 22, 51)
    dst = torch_cuda.zeros(1 << 22, dtype=torch_cuda.uint8, device="cuda")
    rng = np.random.default_rng(6)
    s_off, d_off = rng.permutation(512)[:256] * 8192, rng.permutation(512)[:256] * 8192
    sizes = np.full(256, 8192)
    mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    (err,) = driver.cuStreamBeginCapture(handle, mode)
    assert err == driver.CUresult.CUDA_SUCCESS
    used = kvcopy.copy_batch(
        src.data_ptr() + s_off, dst.data_ptr() + d_off, sizes, stream=stream, method=method
    )
    err, graph = driver.cuStreamEndCapture(handle)
    assert err == driver.CUresult.CUDA_SUCCESS and used != "batch"
    err, exe = driver.cuGraphInstantiate(graph, 0)
    assert err == driver.CUresult.CUDA_SUCCESS
    torch_cuda.cuda.synchronize()
    assert dst.sum().item() == 0  # nothing ran during capture
    (err,) = driver.cuGraphLaunch(exe, handle)
    stream.sync()
    got = dst.cpu().numpy().reshape(-1, 8192)[d_off // 8192]
    assert np.array_equal(got, src.numpy().reshape(-1, 8192)[s_off // 8192])
    driver.cuGraphExecDestroy(exe)
    driver.cuGraphDestroy(graph)


# ------------------------------------------------------------------ environment

PER_THREAD_CHILD = r"""
import json, numpy as np, torch, kvcopy
torch.zeros(1, device="cuda")
src = torch.arange(1 << 16, dtype=torch.int32).pin_memory()
dst = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
ptr_s = src.data_ptr() + np.arange(0, 1 << 18, 8192)
ptr_d = dst.data_ptr() + np.arange(0, 1 << 18, 8192)
used = [kvcopy.copy_batch(ptr_s, ptr_d, np.full(32, 4096), stream=0, method=m) for m in ("auto", "batch")]
torch.cuda.synchronize()
same = torch.equal(dst.cpu().view(32, -1)[:, :1024], src.view(32, -1)[:, :1024])
print(json.dumps({"used": used, "ok": bool(same)}))
"""


def test_per_thread_default_stream_env(torch_cuda):
    res = run_child(PER_THREAD_CHILD, env={"CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM": "1"})
    assert res["ok"]
    assert res["used"][1] == "batch"  # handle 0 means the per-thread stream: batch is allowed


def test_primary_context_is_retained_once_and_is_the_one_torch_uses(torch_cuda):
    """kvcopy keeps the primary context it retained: the same handle every time (a
    retain per call would grow the driver's count without bound), and the context
    torch's CUDA work runs in."""
    from kvcopy.testing import cuda

    kv_driver = cuda.driver

    torch_cuda.zeros(1, device="cuda:0")
    first = kv_driver.primary_context(0)
    assert first != 0 and kv_driver.primary_context(0) == first
    with torch_cuda.cuda.device(0):
        assert kv_driver.current_context() == first


PREPARE_CHILD = r"""
import json, threading, numpy as np, torch, kvcopy
from kvcopy.testing import engine
kernels = engine.kernels
from kvcopy.testing import cuda
kv_driver = cuda.driver
seen = {}
def worker():   # a thread of its own: no current context until kvcopy pushes one
    seen["before"] = kv_driver.current_context()
    kvcopy.prepare(0)
    seen["after"] = kv_driver.current_context()
t = threading.Thread(target=worker); t.start(); t.join()
primary = kv_driver.primary_context(0)
kv_driver.push_context(primary)        # (kernels are kept by context key, not handle)
loaded = kv_driver.current_context_key() in kernels._loaded
kv_driver.pop_context()
kvcopy.prepare()                       # again, here with torch's context current
src = torch.arange(1 << 16, dtype=torch.int32).pin_memory()
dst = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
ptr_s = src.data_ptr() + np.arange(0, 1 << 18, 8192, dtype=np.uint64)
ptr_d = dst.data_ptr() + np.arange(0, 1 << 18, 8192, dtype=np.uint64)[::-1].copy()
used = kvcopy.copy_batch(ptr_s, ptr_d, np.full(32, 4096, dtype=np.uint64), method="kernel")
torch.cuda.synchronize()
want = src.view(32, -1)[:, :1024].flip(0)
print(json.dumps({"before": seen["before"], "after": seen["after"], "loaded": loaded,
                  "used": used, "ok": bool(torch.equal(dst.cpu().view(32, -1)[:, :1024], want))}))
"""


def test_prepare_loads_the_kernel_in_the_primary_context_and_leaves_the_thread_as_it_was(torch_cuda):
    """kvcopy.prepare(0) from a thread with no context: the kernel is loaded in device
    0's primary context, the thread has no current context after, and copies run."""
    res = run_child(PREPARE_CHILD)
    assert (res["before"], res["after"]) == (0, 0)
    assert res["loaded"]
    assert res["used"] == "kernel" and res["ok"]


QUEUE_PREPARES_CHILD = r"""
import json, torch, kvcopy
from kvcopy.testing import engine
kernels = engine.kernels
from kvcopy.testing import cuda
kv_driver = cuda.driver
gpu = torch.arange(8 * 1024, dtype=torch.float32, device="cuda").view(8, 1024)
host = torch.zeros(8, 1024).pin_memory()
key = kv_driver.current_context_key()   # torch's: device 0's primary context
assert kv_driver.current_context() == kv_driver.primary_context(0)
before = key in kernels._loaded
queue = kvcopy.TransferQueue(gpu, host)
made = key in kernels._loaded   # before any job
queue.submit("offload", [[1, 5], [6, 2]])
results = queue.wait()
queue.close()
print(json.dumps({"before": before, "made": made, "jobs": [r.job_id for r in results],
                  "ok": bool(torch.equal(host[5], gpu[1].cpu()) and torch.equal(host[2], gpu[6].cpu()))}))
"""


def test_a_transfer_queue_loads_the_kernel_when_made_not_at_its_first_job(torch_cuda):
    """An engine makes its queues at startup: loading the kernel's module, which waits
    for all work on the GPU, happens then (kvcopy.prepare), not in its first step."""
    res = run_child(QUEUE_PREPARES_CHILD)
    assert (res["before"], res["made"]) == (False, True)
    assert res["jobs"] == ["offload"] and res["ok"]


EXPANDABLE_CHILD = r"""
import json, numpy as np, torch, kvcopy
MiB, BLOCK, N = 1 << 20, 16 << 10, 4096
gpu = torch.randint(0, 256, (512 * MiB,), dtype=torch.uint8, device="cuda")   # 26 mappings
host = torch.zeros(512 * MiB, dtype=torch.uint8, pin_memory=True)
s = torch.cuda.Stream()
out = {}
rng = np.random.default_rng(3)
slots = rng.permutation(512 * MiB // BLOCK)[:N].astype(np.uint64)
src = np.uint64(gpu.data_ptr()) + slots * np.uint64(BLOCK)
wanted = gpu.view(-1, BLOCK)[torch.from_numpy(slots.astype(np.int64)).cuda()]
# the host side scattered too (the kernel), then in one span (staged: the copy engines
# move the span, the kernel gathers the GPU's blocks over every mapping)
for name, host_slots in (("scattered", rng.permutation(512 * MiB // BLOCK)[:N]),
                         ("one span", np.arange(N))):
    host.zero_()
    dst = np.uint64(host.data_ptr()) + host_slots.astype(np.uint64) * np.uint64(BLOCK)
    out[name] = kvcopy.copy_batch(src, dst, np.full(N, BLOCK, np.uint64), stream=s)
    s.synchronize()
    got = host.view(-1, BLOCK)[torch.from_numpy(host_slots.astype(np.int64))].cuda()
    out[name + " ok"] = bool(torch.equal(got, wanted))
torch.cuda.synchronize()
out["usable"] = torch.ones(4, device="cuda").sum().item() == 4
print(json.dumps(out))
"""


def test_expandable_segments_blocks_over_every_piece_go_by_the_kernel(torch_cuda):
    """torch's expandable segments map a tensor in 20 MiB pieces into one reserved
    range, which the driver reports whole: 4096 blocks scattered over every piece of a
    512 MiB tensor go by the kernel, or staged where the host side is one span (the
    kernel gathers them inside the GPU), every byte right, and the context stays
    usable. (A raw pointer into a part of the reservation where nothing is mapped is
    not caught: RELIABILITY.md.)"""
    out = run_child(EXPANDABLE_CHILD, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert (out["scattered"], out["scattered ok"]) == ("kernel", True), out
    assert (out["one span"], out["one span ok"], out["usable"]) == ("staged", True, True), out
