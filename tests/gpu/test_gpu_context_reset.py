"""A context destroyed and created again (cuDevicePrimaryCtxReset, Numba's
cuda.close(), cudaDeviceReset in an extension): what kvcopy kept for the old one
(the loaded kernel, descriptor rings, side streams, recorded launches) must not
be used in the new one, even where the driver hands back the same handle."""

from __future__ import annotations


from helpers.child import run_child


# Plain driver calls, no torch: resetting the primary context would pull torch's
# memory from under it, so the child owns its context alone.
RESET_CHILD = r"""
import ctypes, json
import numpy as np
from cuda.bindings import driver as cu
import kvcopy

def ok(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return rest[0] if len(rest) == 1 else rest

def host_view(ptr, nbytes):
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

def context_id(ctx):
    try:
        return int(ok(cu.cuCtxGetId(ctx)))
    except Exception:
        return None

ok(cu.cuInit(0))
dev = ok(cu.cuDeviceGet(0))
rng = np.random.default_rng(1)
rounds = []
for round_no in range(3):
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))
    stream = ok(cu.cuStreamCreate(1))
    handle = int(stream)
    result = {"ctx": int(ctx), "id": context_id(ctx)}
    for count, method in ((16, "kernel"), (16, "auto"), (300, "auto"), (300, "batch")):
        block = 4096
        nbytes = 2 * count * block
        host = int(ok(cu.cuMemHostAlloc(nbytes, 0)))
        back = int(ok(cu.cuMemHostAlloc(nbytes, 0)))
        dev_mem = int(ok(cu.cuMemAlloc(nbytes)))
        src_view, back_view = host_view(host, nbytes), host_view(back, nbytes)
        src_view[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        back_view[:] = 0
        slots = rng.permutation(2 * count)[:count].astype(np.uint64) * block
        others = rng.permutation(2 * count)[:count].astype(np.uint64) * block
        sizes = np.full(count, block, dtype=np.uint64)
        for _ in range(3):   # again and again: the second call may replay the first
            kvcopy.copy_batch(np.uint64(host) + slots, np.uint64(dev_mem) + others, sizes,
                              stream=handle, method=method)
            kvcopy.copy_batch(np.uint64(dev_mem) + others, np.uint64(back) + slots, sizes,
                              stream=handle, method=method)
            ok(cu.cuStreamSynchronize(stream))
            same = all(np.array_equal(src_view[s:s + block], back_view[s:s + block])
                       for s in slots.tolist())
            key = f"{method} {count}"
            result[key] = bool(result.get(key, True) and same)
            back_view[:] = 0
        ok(cu.cuMemFree(dev_mem)); ok(cu.cuMemFreeHost(host)); ok(cu.cuMemFreeHost(back))
    ok(cu.cuStreamDestroy(stream))
    rounds.append(result)
    ok(cu.cuCtxSetCurrent(cu.CUcontext(0)))
    ok(cu.cuDevicePrimaryCtxRelease(dev))
    ok(cu.cuDevicePrimaryCtxReset(dev))   # (released by all: destroyed)
print(json.dumps(rounds))
"""


def test_copies_stay_right_after_the_primary_context_is_reset():
    rounds = run_child(RESET_CHILD, timeout=180)
    assert len(rounds) == 3
    for number, result in enumerate(rounds):
        copies = {k: v for k, v in result.items() if k not in ("ctx", "id")}
        assert copies and all(copies.values()), (number, result)
    if all(r["id"] is not None for r in rounds):
        assert len({r["id"] for r in rounds}) == 3  # each a new context, whatever its handle
