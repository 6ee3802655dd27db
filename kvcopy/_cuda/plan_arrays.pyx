# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""One C pass that validates, drops zero-size copies and merges adjacent ones.

Planning runs on every call, so it is a single loop instead of a dozen NumPy
passes. The kernel path does the same in describe.describe_copies, fused with
pointer classification; both walk the batch with copy_loop.next_copy.
"""
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free

from kvcopy._cuda.copy_loop cimport (PlanCursor, plan_cursor_init, next_copy, COPY_TOO_LARGE,
                               COPY_NULL_SRC, COPY_NULL_DST, COPY_SRC_WRAPS)

import numpy as np


def bad_copy_error(int why, Py_ssize_t index, size) -> ValueError:
    """The ValueError for copy ``index`` that copy_problem rejected with ``why``."""
    if why == COPY_TOO_LARGE:
        return ValueError(f"sizes[{index}] = {size} is larger than 2**63 - 1 bytes")
    if why in (COPY_NULL_SRC, COPY_NULL_DST):
        name = "src_ptrs" if why == COPY_NULL_SRC else "dst_ptrs"
        return ValueError(f"{name}[{index}] is a null pointer with size {size}")
    name = "src_ptrs" if why == COPY_SRC_WRAPS else "dst_ptrs"
    return ValueError(f"{name}[{index}] + sizes[{index}] runs past the end of the address space")


def length_error(Py_ssize_t n_src, Py_ssize_t n_dst, Py_ssize_t n_sizes) -> ValueError:
    return ValueError(f"src_ptrs, dst_ptrs and sizes differ in length: {n_src}, {n_dst}, {n_sizes}")


def empty_plan(Py_ssize_t n):
    """Room for a plan of at most n copies: (src, dst, sizes) uint64 and origin int64."""
    return (np.empty(n, dtype=np.uint64), np.empty(n, dtype=np.uint64),
            np.empty(n, dtype=np.uint64), np.empty(n, dtype=np.int64))


def plan_arrays(const uint64_t[::1] src, const uint64_t[::1] dst, const uint64_t[::1] sizes,
                bint merge=True):
    """Return ``(src, dst, sizes, origin)`` ready to issue.

    ``origin[k]`` is the caller's index of the first copy merged into entry k.

    Raises:
        ValueError: lengths differ, a size is at least 2**63, a pointer of a
            non-empty copy is null, or a copy wraps the address space.
    """
    cdef Py_ssize_t n = src.shape[0], k = 0
    cdef PlanCursor cursor
    if dst.shape[0] != n or sizes.shape[0] != n:
        raise length_error(n, dst.shape[0], sizes.shape[0])
    out_src, out_dst, out_sizes, origin = empty_plan(n)
    cdef uint64_t[::1] os = out_src, od = out_dst, oz = out_sizes
    cdef int64_t[::1] oo = origin
    if n == 0:
        return out_src, out_dst, out_sizes, origin
    plan_cursor_init(&cursor, n, merge)
    with nogil:
        while next_copy(&cursor, &src[0], &dst[0], &sizes[0]):
            os[k] = cursor.src
            od[k] = cursor.dst
            oz[k] = cursor.size
            oo[k] = cursor.origin
            k += 1
    if cursor.why:
        raise bad_copy_error(cursor.why, cursor.bad, sizes[cursor.bad])
    return out_src[:k], out_dst[:k], out_sizes[:k], origin[:k]


# The bitmaps below find repeated ids in one pass. One is used only while the ids'
# range is at most 64 per id checked, so that its cost follows the batch, never the
# pool (callers sort the ids instead past that).
cdef inline bint _bitmap_follows_batch(int64_t limit, Py_ssize_t n) noexcept nogil:
    return limit <= 64 * n


def bitmap_follows_batch(int64_t limit, Py_ssize_t n) -> bool:
    """Whether a bitmap of ``limit`` ids costs in proportion to a batch of ``n``."""
    return _bitmap_follows_batch(limit, n)


cdef uint64_t* _bitmap(int64_t limit) except NULL:
    """A zeroed bitmap of ``limit`` bits (one word more: never empty); free() it."""
    cdef uint64_t* seen = <uint64_t*>calloc((limit + 63) // 64 + 1, sizeof(uint64_t))
    if seen == NULL:
        raise MemoryError()
    return seen


cdef inline bint _marked(const uint64_t* seen, uint64_t id) noexcept nogil:
    return (seen[id >> 6] >> (id & 63)) & 1


cdef inline bint _seen_before(uint64_t* seen, uint64_t id) noexcept nogil:
    """Whether ``id`` was marked already; marks it."""
    if _marked(seen, id):
        return True
    seen[id >> 6] |= (<uint64_t>1) << (id & 63)
    return False


cdef int _scan_block_ids(const int64_t* pairs, Py_ssize_t n, uint64_t src_limit,
                         uint64_t dst_limit, uint64_t* seen) noexcept nogil:
    # (seen: a zeroed bitmap of dst_limit bits, or NULL to check bounds only; a negative
    # id is a huge unsigned one, so one comparison checks both ends)
    cdef Py_ssize_t i
    cdef uint64_t s, d, out = 0
    if seen == NULL:
        for i in range(n):
            out |= (<uint64_t>pairs[2 * i] >= src_limit) | (<uint64_t>pairs[2 * i + 1] >= dst_limit)
        return 0 if out else 1
    for i in range(n):
        s = <uint64_t>pairs[2 * i]
        d = <uint64_t>pairs[2 * i + 1]
        if s >= src_limit or d >= dst_limit or _seen_before(seen, d):
            return 0
    return 1


def block_ids_ok(const int64_t[:, ::1] mapping, int64_t src_limit, int64_t dst_limit) -> int:
    """One pass over a swap_blocks mapping of (source, destination) id pairs: 1 where
    every source id is in [0, src_limit), every destination id in [0, dst_limit) and no
    destination repeats; 0 where one of those fails (the caller's checks then say
    which); -1 where the ids are in range but the destinations span more than 64 ids
    per pair, so that a bitmap of them would follow the pool rather than the batch
    (the caller sorts them instead)."""
    cdef Py_ssize_t n = mapping.shape[0]
    cdef uint64_t* seen
    cdef const int64_t* pairs
    cdef int found
    if mapping.shape[1] != 2:
        raise ValueError("mapping must have two columns")
    if n == 0:
        return 1
    if src_limit < 0 or dst_limit < 0:
        return 0
    pairs = &mapping[0, 0]
    if not _bitmap_follows_batch(dst_limit, n):
        with nogil:
            found = _scan_block_ids(pairs, n, src_limit, dst_limit, NULL)
        return -1 if found else 0
    seen = _bitmap(dst_limit)
    with nogil:
        found = _scan_block_ids(pairs, n, src_limit, dst_limit, seen)
    free(seen)
    return found


def split_block_ids(const int64_t[:, ::1] mapping, uintptr_t out, Py_ssize_t start=0,
                    Py_ssize_t count=-1) -> int:
    """Write pairs ``start`` to ``start + count`` of a swap_blocks mapping (count -1: to
    the end) as their source ids, then their destination ids, two int64 arrays at
    address ``out`` (room for 16 bytes per pair): the layout kernel reads each side's
    ids as one array. Returns the bytes written."""
    cdef Py_ssize_t n = mapping.shape[0], i
    if mapping.shape[1] != 2:
        raise ValueError("mapping must have two columns")
    if count < 0:
        count = n - start
    if start < 0 or count < 0 or start + count > n:
        raise ValueError(f"split_block_ids: pairs {start} to {start + count} of {n}")
    if count and out == 0:
        raise ValueError("split_block_ids: no memory to write to")
    if count == 0:
        return 0
    # (through raw pointers: a 2-D memoryview's indexing makes the loop twice as slow)
    cdef const int64_t* pairs = &mapping[start, 0]
    cdef int64_t* src = <int64_t*>out
    cdef int64_t* dst = src + count
    with nogil:
        for i in range(count):
            src[i] = pairs[2 * i]
            dst[i] = pairs[2 * i + 1]
    return 16 * count


cdef int _scan_slots(const int64_t* slots, Py_ssize_t n, uint64_t limit,
                     uint64_t* seen) noexcept nogil:
    # (seen: a zeroed bitmap of limit bits, or NULL to check bounds only; a negative
    # slot skips its row and is neither bounded nor counted)
    cdef Py_ssize_t i
    cdef uint64_t s
    for i in range(n):
        if slots[i] < 0:
            continue
        s = <uint64_t>slots[i]
        if s >= limit or (seen != NULL and _seen_before(seen, s)):
            return 0
    return 1


def row_slots_ok(const int64_t[::1] slots, int64_t limit, bint unique) -> int:
    """One pass over a copy_rows side's host indices: 1 where every non-negative slot is
    below ``limit`` and, with ``unique``, none repeats; 0 where one of those fails (the
    caller's checks then say which); -1 where the slots are in range but ``limit``
    exceeds 64 per row, so that a bitmap of them would follow the layout rather than
    the batch (the caller sorts them instead)."""
    cdef Py_ssize_t n = slots.shape[0]
    cdef uint64_t* seen = NULL
    cdef int found
    if n == 0:
        return 1
    if limit < 0:
        return 0
    if not unique or not _bitmap_follows_batch(limit, n):
        with nogil:
            found = _scan_slots(&slots[0], n, limit, NULL)
        return 0 if not found else (1 if not unique else -1)
    seen = _bitmap(limit)
    with nogil:
        found = _scan_slots(&slots[0], n, limit, seen)
    free(seen)
    return found


def first_common_slot(const int64_t[::1] a, const int64_t[::1] b, int64_t limit) -> int:
    """The first index j such that b[j] is also in ``a`` (slots in [0, limit)), or -1
    where none is; -2 where ``limit`` exceeds 64 per slot given, so that a bitmap of
    them would follow the layout rather than the batch (the caller sorts instead)."""
    cdef Py_ssize_t na = a.shape[0], nb = b.shape[0], i
    cdef uint64_t* seen
    cdef uint64_t s
    cdef Py_ssize_t found = -1
    if na == 0 or nb == 0:
        return -1
    if limit < 0 or not _bitmap_follows_batch(limit, na + nb):
        return -2
    seen = _bitmap(limit)
    with nogil:
        for i in range(na):
            s = <uint64_t>a[i]
            if s < <uint64_t>limit:
                _seen_before(seen, s)
        for i in range(nb):
            s = <uint64_t>b[i]
            if s < <uint64_t>limit and _marked(seen, s):
                found = i
                break
    free(seen)
    return found
