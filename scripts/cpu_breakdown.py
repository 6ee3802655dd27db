"""Where copy_batch's CPU time goes, piece by piece, with minor page faults per call.

Times each step of the kernel path for 8192 descriptors (NumPy pointer arrays)
in isolation: argument conversion, the planner the DMA paths use, the fused
describe pass (into pinned and into pageable memory), and the whole call.
"""
from __future__ import annotations

import resource
import statistics
import time

import numpy as np
import torch

import kvcopy
from kvcopy import _driver
from kvcopy.arrays import as_u64_array
from kvcopy.plan import plan_copies
from cpu_overhead import scattered_batch


def timed(label: str, fn, calls: int = 300, sync=None) -> None:
    for _ in range(10):
        fn()
    if sync:
        sync()
    times, faults = [], []
    for _ in range(calls):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        if sync:
            sync()
    print(f"breakdown {label:<34} median_us={statistics.median(times):8.1f} "
          f"min_us={min(times):8.1f} minor_faults={statistics.median(faults):.0f}")


def main() -> None:
    _keep, s, d, sizes = scattered_batch()
    stream = torch.cuda.Stream()
    kvcopy.copy_batch(s, d, sizes, stream=stream, method="kernel")
    torch.cuda.synchronize()
    ref = np.arange(8192, dtype=np.uint64)
    out = np.empty_like(ref)
    timed("reference: np.add 8192 (out=)", lambda: np.add(ref, ref, out=out))
    timed("reference: np.empty x4 64 KiB", lambda: [np.empty(8192, np.uint64) for _ in range(4)])
    timed("as_u64_array x3", lambda: [as_u64_array(a, "x") for a in (s, d, sizes)])
    timed("plan_copies", lambda: plan_copies(s, d, sizes))
    plan = plan_copies(s, d, sizes)
    pinned = _driver.host_alloc(plan.count * _driver.DESCRIPTOR_BYTES)
    pageable = np.empty(plan.count * 4, dtype=np.uint64)
    timed("describe_copies -> pinned", lambda: _driver.describe_copies(s, d, sizes, pinned))
    timed("describe_copies -> pageable", lambda: _driver.describe_copies(s, d, sizes,
                                                                          pageable.ctypes.data))
    view = np.empty_like(plan.src)
    timed("classify_pointers src", lambda: _driver.classify_pointers(plan.src, plan.sizes, view))
    timed("copy_batch kernel (synced)", lambda: kvcopy.copy_batch(s, d, sizes, stream=stream,
                                                                  method="kernel"),
          sync=stream.synchronize)
    _driver.host_free(pinned)


if __name__ == "__main__":
    main()
