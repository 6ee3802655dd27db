# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""One C pass that validates, drops zero-size copies and merges adjacent ones.

Planning runs on every call, so it is a single loop instead of a dozen NumPy
passes: 8192 copies take a few microseconds.
"""
from libc.stdint cimport uint64_t, int64_t

import numpy as np

cdef uint64_t _MAX_SIZE = 0x7FFFFFFFFFFFFFFF
cdef uint64_t _U64_MAX = 0xFFFFFFFFFFFFFFFF


def plan_arrays(const uint64_t[::1] src, const uint64_t[::1] dst, const uint64_t[::1] sizes,
                bint merge=True):
    """Return ``(src, dst, sizes, origin)`` ready to issue.

    ``origin[k]`` is the caller's index of the first copy merged into entry k.

    Raises:
        ValueError: lengths differ, a size is at least 2**63, a pointer of a
            non-empty copy is null, or a copy wraps the address space.
    """
    cdef Py_ssize_t n = src.shape[0], i, k = 0, bad = -1
    cdef int why = 0
    cdef uint64_t s, a, b
    if dst.shape[0] != n or sizes.shape[0] != n:
        raise ValueError(f"src_ptrs, dst_ptrs and sizes differ in length: "
                         f"{n}, {dst.shape[0]}, {sizes.shape[0]}")
    out_src = np.empty(n, dtype=np.uint64)
    out_dst = np.empty(n, dtype=np.uint64)
    out_sizes = np.empty(n, dtype=np.uint64)
    origin = np.empty(n, dtype=np.int64)
    cdef uint64_t[::1] os = out_src, od = out_dst, oz = out_sizes
    cdef int64_t[::1] oo = origin
    with nogil:
        for i in range(n):
            s = sizes[i]
            if s == 0:
                continue
            a = src[i]
            b = dst[i]
            if s > _MAX_SIZE:
                why = 1
            elif a == 0:
                why = 2
            elif b == 0:
                why = 3
            elif a > _U64_MAX - s:
                why = 4
            elif b > _U64_MAX - s:
                why = 5
            if why:
                bad = i
                break
            if merge and k > 0 and os[k - 1] + oz[k - 1] == a and od[k - 1] + oz[k - 1] == b:
                oz[k - 1] += s
                continue
            os[k] = a
            od[k] = b
            oz[k] = s
            oo[k] = i
            k += 1
    if why == 1:
        raise ValueError(f"sizes[{bad}] = {sizes[bad]} is larger than 2**63 - 1 bytes")
    if why in (2, 3):
        name = "src_ptrs" if why == 2 else "dst_ptrs"
        raise ValueError(f"{name}[{bad}] is a null pointer with size {sizes[bad]}")
    if why in (4, 5):
        name = "src_ptrs" if why == 4 else "dst_ptrs"
        raise ValueError(f"{name}[{bad}] + sizes[{bad}] runs past the end of the address space")
    return out_src[:k], out_dst[:k], out_sizes[:k], origin[:k]
