"""Other projects' call patterns, run as a user would (each in its own process,
since some of them used to kill the interpreter). Prints one line per pattern:
  adjacent   cuda.core pinned + pool buffers lying back to back, every method
  capture    a large kernel-path batch run once, then captured (torch.cuda.graph)
  bogus      a host address that is not mapped (42) in a batch
Run on a GPU machine with kvcopy installed: python3 bench/patterns.py
"""

from __future__ import annotations

import subprocess
import sys

ADJACENT = r"""
import numpy as np, kvcopy
try:
    from cuda.core import Device, LegacyPinnedMemoryResource
except ImportError:
    from cuda.core.experimental import Device, LegacyPinnedMemoryResource
dev = Device(0); dev.set_current(); s = dev.create_stream()
pinned = LegacyPinnedMemoryResource()
N, S = 4, 4096
for _ in range(50):   # find four pinned and four device buffers lying back to back
    hb = [pinned.allocate(S, stream=s) for _ in range(N)]
    db = [dev.allocate(S, stream=s) for _ in range(N)]
    hp = [int(b.handle) for b in hb]; dp = [int(b.handle) for b in db]
    if (all(hp[i + 1] == hp[i] + S for i in range(N - 1))
            and all(dp[i + 1] == dp[i] + S for i in range(N - 1))):
        break
else:
    print("adjacent: could not get back-to-back buffers"); raise SystemExit
h = np.frombuffer(np.ctypeslib.as_array((__import__('ctypes').c_uint8 * (N * S))
                                        .from_address(hp[0])), np.uint8)
out = []
for method in ("auto", "batch", "loop", "kernel"):
    h[:] = np.random.default_rng(1).integers(0, 256, N * S, dtype=np.uint8)
    back = np.zeros(N * S, np.uint8)
    try:
        m1 = kvcopy.copy_batch(hp, dp, [S] * N, stream=s, method=method)
        with kvcopy.register(back):
            m2 = kvcopy.copy_batch(dp, [back.ctypes.data + i * S for i in range(N)], [S] * N,
                                   stream=s, method=method)
            s.sync()
        out.append(f"{method}:{m1}/{m2}:" + ("ok" if np.array_equal(back, h) else "WRONG"))
    except Exception as e:
        out.append(f"{method}:{type(e).__name__}:{str(e)[:60]}")
print("adjacent:", "  ".join(out))
"""

CAPTURE = r"""
import numpy as np, torch, kvcopy
S, N = 8192, 1500
host = torch.randint(0, 256, (2 * N * S,), dtype=torch.uint8).pin_memory()
gpu = torch.zeros(2 * N * S, dtype=torch.uint8, device="cuda")
p = np.random.default_rng(0).permutation(2 * N)
src = (host.data_ptr() + p[:N] * S).astype(np.uint64)
dst = (gpu.data_ptr() + p[N:] * S).astype(np.uint64)
sz = np.full(N, S, dtype=np.uint64)
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    kvcopy.copy_batch(src, dst, sz, stream=s)
torch.cuda.synchronize(); gpu.zero_(); torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g, stream=s):
        used = kvcopy.copy_batch(src, dst, sz, stream=s)
    g.replay(); torch.cuda.synchronize()
    off = (dst - gpu.data_ptr()).astype(np.int64); so = (src - host.data_ptr()).astype(np.int64)
    got, want = gpu.cpu().numpy(), host.numpy()
    ok = all(np.array_equal(got[d:d + S], want[a:a + S]) for a, d in zip(so, off))
    print("capture:", used, "bytes ok" if ok else "BYTES WRONG")
except Exception as e:
    print("capture: FAILED", type(e).__name__, str(e)[:120])
"""

BOGUS = r"""
import torch, kvcopy
h = torch.empty(4096, dtype=torch.uint8).pin_memory()
d = torch.empty(8192, dtype=torch.uint8, device="cuda")
s = torch.cuda.Stream()
try:
    kvcopy.copy_batch([h.data_ptr(), 42], [d.data_ptr(), d.data_ptr() + 4096], [4096, 4096], stream=s)
    s.synchronize(); print("bogus: no error raised")
except Exception as e:
    print("bogus:", type(e).__name__, str(e)[:120])
"""

for name, code in (("adjacent", ADJACENT), ("capture", CAPTURE), ("bogus", BOGUS)):
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    line = (run.stdout.strip().splitlines() or [""])[-1]
    if run.returncode != 0:
        line = f"{name}: process ended with {run.returncode}: {run.stderr.strip()[-200:]}"
    print(line, flush=True)
