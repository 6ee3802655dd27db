"""Copies between two GPUs (needs two; skipped elsewhere): bytes by every method and
from either side's stream, peer access enabled on first need or left alone
(config.enable_peer_access), memory the other GPU may not access (virtual-memory
allocations), swap_blocks and TransferQueue between two caches with torch's
ordering, mixed-device batches, capture, and calibrate_peers."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from helpers.gpu import expected_after
from helpers.child import run_child

KiB, MiB = 1 << 10, 1 << 20
METHODS = ("auto", "batch", "loop", "kernel")


@pytest.fixture
def two_gpus(torch_cuda):
    if torch_cuda.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    return torch_cuda


def _pools(torch, a: int, b: int, nbytes: int, seed: int):
    gen = torch.Generator(device=f"cuda:{a}").manual_seed(seed)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=f"cuda:{a}", generator=gen)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{b}")
    return src, dst


def _scattered(count: int, block: int, pool: int, rng, odd: bool = False):
    slots = pool // (block + 64)
    chosen = rng.choice(slots, size=2 * count, replace=False).astype(np.int64) * (block + 64)
    sizes = np.full(count, block, dtype=np.int64)
    if odd:  # unaligned starts and sizes: every word width of the kernel
        chosen[:count] += rng.integers(0, 7, count)
        sizes -= rng.integers(0, 13, count)
    return chosen[:count], chosen[count:], sizes


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("pair", [(0, 1), (1, 0)])
@pytest.mark.parametrize("launch", ["src", "dst"])
@pytest.mark.parametrize("block", [2 * KiB, 16 * KiB, 300 * KiB])
def test_peer_copy_bytes(two_gpus, method, pair, launch, block):
    torch = two_gpus
    a, b = pair
    pool = 8 * MiB
    src, dst = _pools(torch, a, b, pool, seed=block + a)
    rng = np.random.default_rng(block)
    count = min(64, pool // (2 * (block + 64)))
    src_off, dst_off, sizes = _scattered(count, block, pool, rng, odd=block == 2 * KiB)
    before = dst.cpu().numpy()
    stream = torch.cuda.Stream(device=a if launch == "src" else b)
    chose = kvcopy.copy_batch(
        (src.data_ptr() + src_off).astype(np.uint64),
        (dst.data_ptr() + dst_off).astype(np.uint64),
        sizes,
        stream=stream,
        method=method,
    )
    stream.synchronize()
    assert np.array_equal(
        dst.cpu().numpy(), expected_after(src.cpu().numpy(), before, src_off, dst_off, sizes)
    )
    if method == "auto" and kvcopy.testing.cuda.driver.can_access_peer(a, b):
        assert chose == "kernel", kvcopy.last_decision()
        assert kvcopy.last_decision().method == "kernel"


ENABLE_CHILD = r"""
import json, numpy as np, torch, kvcopy
from kvcopy.testing import cuda
driver = cuda.driver
kvcopy.config.enable_peer_access = ENABLE
MiB = 1 << 20
src = torch.arange(4 * MiB, dtype=torch.int32, device="cuda:0").view(torch.uint8)[:4 * MiB]
dst = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda:1")
s = torch.cuda.Stream(device=0)
out = {"can": driver.can_access_peer(0, 1)}
driver.push_context(driver.primary_context(0))
out["flags_before"] = driver.pointer_access_flags(dst.data_ptr())
driver.pop_context()
ptr = lambda t, o: np.array([t.data_ptr() + x for x in o], dtype=np.uint64)
out["auto"] = kvcopy.copy_batch(ptr(src, [0, 65536]), ptr(dst, [131072, 0]), [65536, 65536], stream=s)
s.synchronize()
out["auto_ok"] = bool(torch.equal(dst[131072:196608].cpu(), src[:65536].cpu())
                      and torch.equal(dst[:65536].cpu(), src[65536:131072].cpu()))
driver.push_context(driver.primary_context(0))
out["flags_after"] = driver.pointer_access_flags(dst.data_ptr())
driver.pop_context()
try:
    kvcopy.copy_batch(ptr(src, [0, 8192]), ptr(dst, [0, 8192]), [4096, 4096], stream=s, method="kernel")
    s.synchronize()
    out["kernel"] = "ran"
except ValueError as e:
    out["kernel"] = str(e)
print(json.dumps(out))
"""


def test_peer_access_enabled_on_first_need(two_gpus):
    """A fresh process: kvcopy enables access from GPU0 to GPU1 itself and runs the kernel."""
    out = run_child(ENABLE_CHILD.replace("ENABLE", "True"))
    if not out["can"]:
        pytest.skip("no peer-to-peer path between GPU0 and GPU1")
    assert (out["auto"], out["auto_ok"], out["kernel"]) == ("kernel", True, "ran")


def test_peer_access_left_alone_when_disabled(two_gpus):
    """enable_peer_access=False: auto copies by DMA, the kernel refuses and says why."""
    out = run_child(ENABLE_CHILD.replace("ENABLE", "False"))
    assert (out["auto"], out["auto_ok"]) == ("batch", True)
    assert "method='kernel'" in out["kernel"] and "memory of device 1" in out["kernel"]
    assert "enable_peer_access is False" in out["kernel"] or "cuDeviceCanAccessPeer is 0" in out["kernel"]


VMM_CHILD = r"""
import json, numpy as np, torch, kvcopy
MiB = 1 << 20
src = torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8, device="cuda:0")
dst = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda:1")    # expandable segment: VMM
ptr = lambda t, o: np.array([t.data_ptr() + x for x in o], dtype=np.uint64)
out = {}
for side in (0, 1):
    s = torch.cuda.Stream(device=side)
    for method in ("auto", "batch", "loop", "kernel"):
        dst.zero_()
        torch.cuda.synchronize(1)
        key = f"{method}@{side}"
        try:
            chose = kvcopy.copy_batch(ptr(src, [0, MiB]), ptr(dst, [2 * MiB, 0]), [MiB, MiB],
                                      stream=s, method=method)
            s.synchronize()
            ok = bool(torch.equal(dst[2 * MiB:3 * MiB].cpu(), src[:MiB].cpu())
                      and torch.equal(dst[:MiB].cpu(), src[MiB:2 * MiB].cpu()))
            out[key] = f"{chose}:{'ok' if ok else 'WRONG BYTES'}"
        except (ValueError, kvcopy.CudaError) as e:
            out[key] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def test_virtual_memory_without_peer_mapping_is_never_touched_by_the_kernel(two_gpus):
    """torch's expandable segments map each GPU's memory for that GPU alone: kvcopy
    must not let the other GPU's kernel touch it, even after enabling peer access,
    and says so. Every method either copies the right bytes or raises a CudaError
    (the driver itself refuses some such copies): never a fault, never wrong bytes."""
    out = run_child(VMM_CHILD, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    print(out)
    for side in (0, 1):
        refusal = out[f"kernel@{side}"]
        assert refusal.startswith("ValueError") and f"memory of device {1 - side}" in refusal
        assert "cuMemSetAccess" in refusal or "cuDeviceCanAccessPeer is 0" in refusal
        for method in ("auto", "batch", "loop"):
            result = out[f"{method}@{side}"]
            assert result.endswith(":ok") or (
                result.startswith("CudaError") and "not mapped for device" in result
            ), result
            assert not result.startswith("kernel")


def _layered(torch, device: str, blocks: int, layers: int, fill: bool):
    shape = (blocks, 16, 8, 64)
    make = (
        (lambda: torch.randn(shape, dtype=torch.float16, device=device))
        if fill
        else (lambda: torch.zeros(shape, dtype=torch.float16, device=device))
    )
    return [make() for _ in range(layers)]


def test_swap_blocks_between_gpus_orders_like_torch(two_gpus):
    """stream=None: the copy waits for the destination GPU's current stream (a fill
    queued behind a sleep would otherwise overwrite the copied blocks), and that
    stream then waits for the copy (a clone there sees the copied bytes)."""
    torch = two_gpus
    src = _layered(torch, "cuda:0", 64, 4, fill=True)
    dst = _layered(torch, "cuda:1", 64, 4, fill=False)
    mapping = np.array([[3, 10], [7, 0], [63, 5], [20, 21]], dtype=np.int64)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    with torch.cuda.device(1):
        torch.cuda._sleep(100_000_000)
        for t in dst:
            t.fill_(1.0)
    with torch.cuda.device(0):
        torch.cuda._sleep(100_000_000)  # the source side is late too: the clone must wait
    chose = kvcopy.swap_blocks(src, dst, mapping)
    with torch.cuda.device(1):
        seen = [t[mapping[:, 1]].clone() for t in dst]
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    for s, got in zip(src, seen):
        assert torch.equal(got.cpu(), s[mapping[:, 0]].cpu())
    if kvcopy.testing.cuda.driver.can_access_peer(0, 1):
        assert chose == "kernel"


@pytest.mark.parametrize("method", ["auto", "batch", "kernel"])
def test_transfer_queue_between_gpus(two_gpus, method):
    """Prefill GPU0 -> decode GPU1: jobs wait for both GPUs' current streams."""
    torch = two_gpus
    src = _layered(torch, "cuda:0", 32, 2, fill=True)
    dst = _layered(torch, "cuda:1", 32, 2, fill=False)
    expected = [t.clone() for t in src]
    with kvcopy.TransferQueue(src, dst, method=method) as queue:
        with torch.cuda.device(0):
            torch.cuda._sleep(100_000_000)
            for t, e in zip(src, expected):  # the final bytes, written late on GPU0
                t.copy_(e * 2)
        with torch.cuda.device(1):
            torch.cuda._sleep(50_000_000)
            for t in dst:
                t.fill_(3.0)  # queued on GPU1 before the job: must come first
        queue.submit("seq", np.array([[1, 2], [30, 31], [4, 4]]))
        (result,) = queue.wait(["seq"])
    assert result.ok
    assert result.method == (method if method != "auto" else result.method)
    for s, d in zip(src, dst):
        assert torch.equal(d[[2, 31, 4]].cpu(), s[[1, 30, 4]].cpu())
        untouched = [i for i in range(32) if i not in (2, 31, 4)]
        assert torch.all(d[untouched].cpu() == 3.0)


@pytest.mark.parametrize("method", METHODS)
def test_mixed_device_batch(two_gpus, method):
    """One batch: host->GPU0, host->GPU1, GPU0->GPU1, GPU1->GPU0, GPU0->GPU0 and
    GPU1->host; every byte lands (one kernel where the launching GPU reaches
    everything, else DMA)."""
    torch = two_gpus
    n = 1 * MiB
    host = torch.randint(0, 256, (n,), dtype=torch.uint8).pin_memory()
    host_out = torch.zeros(n, dtype=torch.uint8).pin_memory()
    g0 = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    g1 = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:1")
    o0 = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    o1 = torch.zeros(n, dtype=torch.uint8, device="cuda:1")
    k = 16 * KiB
    copies = [
        (host, 0, o0, 0),
        (host, k, o1, 0),
        (g0, 0, o1, k),
        (g1, 0, o0, k),
        (g0, k, o0, 2 * k),
        (g1, k, host_out, 0),
    ]
    src = np.array([s.data_ptr() + so for s, so, _, _ in copies], dtype=np.uint64)
    dst = np.array([d.data_ptr() + do for _, _, d, do in copies], dtype=np.uint64)
    stream = torch.cuda.Stream(device=0)
    kvcopy.copy_batch(src, dst, np.full(len(copies), k, dtype=np.uint64), stream=stream, method=method)
    stream.synchronize()
    for s, so, d, do in copies:
        assert torch.equal(d[do : do + k].cpu(), s[so : so + k].cpu())


def test_default_stream_between_gpus(two_gpus):
    torch = two_gpus
    src, dst = _pools(torch, 1, 0, 1 * MiB, seed=5)
    kvcopy.copy_batch([src.data_ptr()], [dst.data_ptr() + 4096], [65536], stream=0)
    kvcopy.copy_batch(
        [src.data_ptr(), src.data_ptr() + 8192],
        [dst.data_ptr(), dst.data_ptr() + 100000],
        [4096, 4096],
        stream=0,
    )
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert torch.equal(dst[4096 : 4096 + 65536].cpu(), src[:65536].cpu())
    assert torch.equal(dst[100000:104096].cpu(), src[8192:12288].cpu())


def test_capture_between_gpus(two_gpus):
    """A peer kernel copy captured on GPU0 after a warm-up, replayed with new bytes."""
    torch = two_gpus
    src, dst = _pools(torch, 0, 1, 4 * MiB, seed=9)
    offs = np.arange(0, 64, dtype=np.uint64) * np.uint64(32 * KiB)
    s_ptr, d_ptr = np.uint64(src.data_ptr()) + offs, np.uint64(dst.data_ptr()) + offs[::-1]
    sizes = np.full(64, 16 * KiB, dtype=np.uint64)
    with torch.cuda.device(0):
        stream = torch.cuda.Stream()
        kvcopy.copy_batch(s_ptr, d_ptr, sizes, stream=stream)  # warm-up
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            kvcopy.copy_batch(s_ptr, d_ptr, sizes, stream=stream)
        src.random_(0, 255)
        dst.zero_()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        graph.replay()
        torch.cuda.synchronize(0)
    for i in range(64):
        s_at, d_at = int(offs[i]), int(offs[63 - i])
        assert torch.equal(dst[d_at : d_at + 16 * KiB].cpu(), src[s_at : s_at + 16 * KiB].cpu())


def test_calibrate_peers(two_gpus, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(tmp_path))
    found = kvcopy.calibrate_peers(0, 1, total_bytes=16 * MiB, repeats=2, save_result=False)
    if not kvcopy.testing.cuda.driver.can_access_peer(0, 1):
        pytest.skip("no peer-to-peer path: nothing to calibrate")
    assert "p2p 0>1" in found.batch_min_bytes
    from kvcopy.testing import engine

    device = engine.device
    assert "p2p 1>0" in device.thresholds(1).batch_min_bytes
