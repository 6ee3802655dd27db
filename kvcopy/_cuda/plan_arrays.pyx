# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""One C pass that validates, drops zero-size copies and merges adjacent ones; one
that validates a batch and says whether its copies are plainly apart; one
pass that checks block ids or row slots (bounds and repeats); the writes of ids
into pinned memory for the layout kernel; and strided runs (vLLM's) read into a
table.

Planning runs on every call, so it is a single loop instead of a dozen NumPy
passes. The kernel path does the same in describe.describe_copies, fused with
pointer classification; both walk the batch with copy_loop.next_copy.
"""
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memset
from cpython.long cimport PyLong_CheckExact
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.object cimport PyObject, Py_TYPE

cdef extern from "Python.h":
    long long PyLong_AsLongLongAndOverflow(object value, int* overflow) except? -1

from kvcopy._cuda.copy_loop cimport (PlanCursor, plan_cursor_init, next_copy, copy_problem,
                               COPY_OK, COPY_TOO_LARGE, COPY_NULL_SRC, COPY_NULL_DST,
                               COPY_SRC_WRAPS)

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


def run_table(list runs, type kind):
    """vLLM's strided runs, every one a ``kind`` (a tuple type whose six fields are in
    CopyRunDescriptor's order: src_base, dst_base, fragment_size, num_fragments,
    src_stride, dst_stride) of six non-negative ints below 2**63, as a (6, n) uint64
    table of the runs with fragments, a row a field; None where any run is another
    type, holds another value (a bool, a NumPy integer, a negative or larger int), or
    has fragments and a zero address or size (a reading that names it decides)."""
    cdef Py_ssize_t n = PyList_GET_SIZE(runs), i, f, live = 0
    cdef PyObject* run
    cdef PyObject* value
    cdef uint64_t fields[6]
    cdef long long read
    cdef int overflow = 0
    table = np.empty((6, n), dtype=np.uint64)
    cdef uint64_t[:, ::1] out = table
    for i in range(n):
        run = PyList_GET_ITEM(runs, i)
        if <PyObject*>Py_TYPE(<object>run) != <PyObject*>kind or PyTuple_GET_SIZE(<object>run) != 6:
            return None
        for f in range(6):
            value = PyTuple_GET_ITEM(<object>run, f)
            if not PyLong_CheckExact(<object>value):
                return None
            read = PyLong_AsLongLongAndOverflow(<object>value, &overflow)
            if overflow or read < 0:
                return None
            fields[f] = <uint64_t>read
        if fields[3] == 0:
            continue  # (no fragments: nothing to move)
        if fields[0] == 0 or fields[1] == 0 or fields[2] == 0:
            return None
        for f in range(6):
            out[f, live] = fields[f]
        live += 1
    return table[:, :live]


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


def copies_ok(const uint64_t[::1] src, const uint64_t[::1] dst, const uint64_t[::1] sizes) -> bool:
    """Raises plan_arrays' ValueError for the first bad copy of a batch of equal-length
    arrays; else whether the batch is shown free of order dependence: at a glance (its
    non-empty destinations in address order without meeting, every source but a copy's
    onto exactly itself outside the destinations' span), else by one expected-linear
    pass over buckets of addresses (copies_apart.h). False only means: compare the
    copies exactly (kvcopy._plans.overlaps), which names the copies that meet. One pass
    reads the batch for both the checks and the glance (kvcopy_summarize)."""
    cdef Py_ssize_t i, n = src.shape[0]
    cdef int why = COPY_OK, apart
    cdef kvcopy_batch_summary found
    cdef bint sources_apart
    if n == 0:
        return True
    with nogil:
        kvcopy_summarize(&src[0], &dst[0], &sizes[0], n, &found)
    if found.suspect:  # (rare: which copy, and what is wrong with it)
        for i in range(n):
            if sizes[i] != 0:
                why = copy_problem(src[i], dst[i], sizes[i])
                if why:
                    raise bad_copy_error(why, i, sizes[i])
    sources_apart = found.src_hi <= found.dst_lo or found.src_lo >= found.dst_hi
    # (ordered: the destinations' span is [dst_lo, dst_hi) and none meets the one before)
    if found.ordered and sources_apart:
        return True
    # not at a glance (destinations out of order, sources among them): by buckets
    with nogil:
        apart = kvcopy_copies_apart_summarized(&src[0], &dst[0], &sizes[0], n, sources_apart,
                                               &found)
    return apart == 1


cdef extern from "copies_apart.h":
    ctypedef struct kvcopy_batch_summary:
        uint64_t dst_lo, dst_hi, src_lo, src_hi
        int ordered, suspect
    void kvcopy_summarize(const uint64_t* src, const uint64_t* dst, const uint64_t* sizes,
                          int64_t n, kvcopy_batch_summary* found) noexcept nogil
    int kvcopy_copies_apart_summarized(const uint64_t* src, const uint64_t* dst,
                                       const uint64_t* sizes, int64_t n, int sources_apart,
                                       const kvcopy_batch_summary* found) noexcept nogil


cdef extern from "pinned_writes.h":
    void kvcopy_split_pairs(const int64_t* pairs, int64_t* src, int64_t* dst,
                            int64_t n) noexcept nogil
    void kvcopy_copy_to_pinned(void* dst, const void* src, size_t nbytes) noexcept nogil


# Repeated ids are found in one pass by a set of the ids seen: a bitmap of the id range
# while that range is at most 64 per id checked, else a hash table of twice as many
# slots as ids. Either way its cost follows the batch, never the pool.
cdef inline bint _bitmap_follows_batch(int64_t limit, Py_ssize_t n) noexcept nogil:
    return limit <= 64 * n


cdef extern from *:
    """
    static const uint64_t kvcopy_free_slot = ~0ULL;  /* ids are below 2**63 */
    static const uint64_t kvcopy_fibonacci = 0x9E3779B97F4A7C15ULL;  /* 2**64 / golden ratio */
    """
    const uint64_t _EMPTY "kvcopy_free_slot"
    const uint64_t _FIBONACCI "kvcopy_fibonacci"   # (spreads strided ids over the slots)


cdef struct IdSet:
    uint64_t* words   # the bitmap, or the hash table's slots
    uint64_t mask     # slots - 1 (a hash table), or 0 (a bitmap)
    int shift         # 64 - log2(slots)


cdef int _id_set_init(IdSet* ids, int64_t limit, Py_ssize_t n) except -1:
    """An empty set for up to ``n`` ids in [0, limit); _id_set_free() it."""
    cdef uint64_t slots = 16
    ids.shift = 60
    if _bitmap_follows_batch(limit, n):
        ids.mask = 0
        ids.words = <uint64_t*>calloc((limit + 63) // 64 + 1, sizeof(uint64_t))
    else:
        while slots < <uint64_t>(2 * n):
            slots <<= 1
            ids.shift -= 1
        ids.mask = slots - 1
        ids.words = <uint64_t*>malloc(slots * sizeof(uint64_t))
        if ids.words != NULL:
            memset(ids.words, 0xFF, slots * sizeof(uint64_t))
    if ids.words == NULL:
        raise MemoryError()
    return 0


cdef inline void _id_set_free(IdSet* ids) noexcept:
    free(ids.words)


cdef inline uint64_t* _hash_slot(const IdSet* ids, uint64_t id) noexcept nogil:
    """The slot holding ``id``, or the free slot where it would go."""
    cdef uint64_t at = (id * _FIBONACCI) >> ids.shift
    while ids.words[at] != id and ids.words[at] != _EMPTY:
        at = (at + 1) & ids.mask
    return &ids.words[at]


cdef inline bint _id_set_has(const IdSet* ids, uint64_t id) noexcept nogil:
    if ids.mask == 0:
        return (ids.words[id >> 6] >> (id & 63)) & 1
    return _hash_slot(ids, id)[0] == id


cdef inline void _mark(uint64_t* words, uint64_t id) noexcept nogil:
    """Sets bit ``id`` of a bitmap."""
    words[id >> 6] |= (<uint64_t>1) << (id & 63)


cdef inline bint _seen_before(IdSet* ids, uint64_t id) noexcept nogil:
    """Whether ``id`` (below the set's limit) was added already; adds it."""
    cdef uint64_t* slot
    if ids.mask == 0:
        if (ids.words[id >> 6] >> (id & 63)) & 1:
            return True
        _mark(ids.words, id)
        return False
    slot = _hash_slot(ids, id)
    if slot[0] == id:
        return True
    slot[0] = id
    return False


cdef inline void _id_set_add(IdSet* ids, uint64_t id) noexcept nogil:
    """Adds ``id`` (below the set's limit); a bitmap's bit is set without a test first."""
    if ids.mask == 0:
        _mark(ids.words, id)
    else:
        _seen_before(ids, id)


cdef extern from *:
    int _popcount "__builtin_popcountll"(unsigned long long) noexcept nogil


cdef inline uint64_t _bits_set(const uint64_t* words, uint64_t limit) noexcept nogil:
    """How many of a bitmap's ``limit`` bits are set."""
    cdef uint64_t total = 0, w
    for w in range((limit + 63) >> 6):
        total += _popcount(words[w])
    return total


# A bitmap finds repeats without testing each id's bit: every id's bit is set and the
# bits are counted at the end (fewer than the ids: one repeats). No branch waits on
# what a load found, so the stores pipeline (experiments/id_checks_probe.py). The
# bound is checked before each store, so an id out of range writes nothing.

cdef int _scan_block_ids(const int64_t* pairs, Py_ssize_t n, uint64_t src_limit,
                         uint64_t dst_limit, IdSet* seen) noexcept nogil:
    # (a negative id is a huge unsigned one, so one comparison checks both ends)
    cdef Py_ssize_t i
    cdef uint64_t s, d
    cdef uint64_t* words = seen.words   # (a local: no store through it can change it)
    if seen.mask == 0:
        for i in range(n):
            s = <uint64_t>pairs[2 * i]
            d = <uint64_t>pairs[2 * i + 1]
            if s >= src_limit or d >= dst_limit:
                return 0
            _mark(words, d)
        return 1 if _bits_set(words, dst_limit) == <uint64_t>n else 0
    for i in range(n):
        s = <uint64_t>pairs[2 * i]
        d = <uint64_t>pairs[2 * i + 1]
        if s >= src_limit or d >= dst_limit or _seen_before(seen, d):
            return 0
    return 1


def block_ids_ok(const int64_t[:, ::1] mapping, int64_t src_limit, int64_t dst_limit) -> bool:
    """One pass over a swap_blocks mapping of (source, destination) id pairs: True where
    every source id is in [0, src_limit), every destination id in [0, dst_limit) and no
    destination repeats; False where one of those fails (the caller's checks then say
    which)."""
    cdef Py_ssize_t n = mapping.shape[0]
    cdef IdSet seen
    cdef int found
    if mapping.shape[1] != 2:
        raise ValueError("mapping must have two columns")
    if n == 0:
        return True
    if src_limit < 0 or dst_limit < 0:
        return False
    _id_set_init(&seen, dst_limit, n)
    with nogil:
        found = _scan_block_ids(&mapping[0, 0], n, src_limit, dst_limit, &seen)
    _id_set_free(&seen)
    return found == 1


def split_block_ids(const int64_t[:, ::1] mapping, uintptr_t out, Py_ssize_t start=0,
                    Py_ssize_t count=-1) -> int:
    """Write pairs ``start`` to ``start + count`` of a swap_blocks mapping (count -1: to
    the end) as their source ids, then their destination ids, two int64 arrays at
    address ``out`` (room for 16 bytes per pair): the layout kernel reads each side's
    ids as one array. Returns the bytes written."""
    cdef Py_ssize_t n = mapping.shape[0]
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
    # (around the cache where it can: pinned_writes.h)
    cdef const int64_t* pairs = &mapping[start, 0]
    cdef int64_t* src = <int64_t*>out
    with nogil:
        kvcopy_split_pairs(pairs, src, src + count, count)
    return 16 * count


def block_addresses(const int64_t[:] ids, const uint64_t[::1] base,
                    const uint64_t[::1] stride, const uint64_t[::1] factor,
                    uint64_t block_bytes):
    """The address of every block ``ids`` names in each tensor (a column of a checked
    swap_blocks mapping, read in place), tensor-major: entry t * n + i is tensor t's
    block ids[i], ``base[t] + (id // factor[t]) * stride[t] + (id % factor[t]) *
    block_bytes`` (uint64, wrapping as NumPy's uint64 does). One pass instead of a
    dozen NumPy operations: small swap_blocks calls go to the copy engines as
    pointers, and every such call builds them."""
    cdef Py_ssize_t n = ids.shape[0], tensors = base.shape[0], t, i
    cdef uint64_t b, st, f, id
    if stride.shape[0] != tensors or factor.shape[0] != tensors:
        raise ValueError("base, stride and factor differ in length")
    out = np.empty(tensors * n, dtype=np.uint64)
    cdef uint64_t[::1] o = out
    with nogil:
        for t in range(tensors):
            b, st, f = base[t], stride[t], factor[t]
            if f == 1:
                for i in range(n):
                    o[t * n + i] = b + <uint64_t>ids[i] * st
            else:
                for i in range(n):
                    id = <uint64_t>ids[i]
                    o[t * n + i] = b + (id // f) * st + (id % f) * block_bytes
    return out


def block_copies(const int64_t[:, ::1] mapping, const uint64_t[:, ::1] table, uint64_t block_bytes):
    """Every block copy of a checked swap_blocks ``mapping`` over the tensor pairs of
    ``table`` (rows of src base, dst base, src stride, dst stride, src factor, dst
    factor: BlockPlan.tensor_table) as uint64 (src, dst, size) arrays, tensor-major,
    unmerged: BlockPlan.copy_arrays in one pass, for a repeated call whose table is
    kept (addresses as block_addresses gives them)."""
    cdef Py_ssize_t n = mapping.shape[0], tensors = table.shape[0], t, i
    cdef uint64_t f, id
    if mapping.shape[1] != 2 or table.shape[1] != 6:
        raise ValueError("mapping must have two columns and table six")
    src = np.empty(tensors * n, dtype=np.uint64)
    dst = np.empty(tensors * n, dtype=np.uint64)
    sizes = np.full(tensors * n, block_bytes, dtype=np.uint64)
    cdef uint64_t[::1] s = src, d = dst
    with nogil:
        for t in range(tensors):
            for i in range(n):
                id, f = <uint64_t>mapping[i, 0], table[t, 4]
                s[t * n + i] = table[t, 0] + (id // f) * table[t, 2] + (id % f) * block_bytes
                id, f = <uint64_t>mapping[i, 1], table[t, 5]
                d[t * n + i] = table[t, 1] + (id // f) * table[t, 3] + (id % f) * block_bytes
    return src, dst, sizes


def write_indices(uintptr_t out, const int64_t[::1] indices) -> int:
    """Copy ``indices`` to address ``out`` in pinned memory that the GPU reads next (a
    ring slot; around the cache where it can: pinned_writes.h). Returns the bytes
    written."""
    cdef Py_ssize_t n = indices.shape[0]
    if n == 0:
        return 0
    if out == 0:
        raise ValueError("write_indices: no memory to write to")
    with nogil:
        kvcopy_copy_to_pinned(<void*>out, &indices[0], 8 * n)
    return 8 * n


cdef int _scan_slots(const int64_t* slots, Py_ssize_t n, uint64_t limit,
                     IdSet* seen) noexcept nogil:
    # (seen: an empty set, or NULL to check bounds only; a negative slot skips its row
    # and is neither bounded nor counted)
    cdef Py_ssize_t i
    cdef uint64_t s, counted = 0
    cdef uint64_t* words
    if seen != NULL and seen.mask == 0:
        words = seen.words
        for i in range(n):
            if slots[i] < 0:
                continue
            s = <uint64_t>slots[i]
            if s >= limit:
                return 0
            _mark(words, s)
            counted += 1
        return 1 if _bits_set(words, limit) == counted else 0
    for i in range(n):
        if slots[i] < 0:
            continue
        s = <uint64_t>slots[i]
        if s >= limit or (seen != NULL and _seen_before(seen, s)):
            return 0
    return 1


def row_slots_ok(const int64_t[::1] slots, int64_t limit, bint unique) -> bool:
    """One pass over a copy_rows side's host indices: True where every non-negative slot
    is below ``limit`` and, with ``unique``, none repeats; False where one of those fails
    (the caller's checks then say which)."""
    cdef Py_ssize_t n = slots.shape[0]
    cdef IdSet seen
    cdef int found
    if n == 0:
        return True
    if limit < 0:
        return False
    if not unique:
        with nogil:
            found = _scan_slots(&slots[0], n, limit, NULL)
        return found == 1
    _id_set_init(&seen, limit, n)
    with nogil:
        found = _scan_slots(&slots[0], n, limit, &seen)
    _id_set_free(&seen)
    return found == 1


def first_common_slot(const int64_t[::1] a, const int64_t[::1] b, int64_t limit) -> int:
    """The first index j such that b[j] is also in ``a`` (slots in [0, limit); others
    are passed over), or -1 where none is."""
    cdef Py_ssize_t na = a.shape[0], nb = b.shape[0], i
    cdef IdSet seen
    cdef uint64_t s
    cdef Py_ssize_t found = -1
    if na == 0 or nb == 0 or limit <= 0:
        return -1
    _id_set_init(&seen, limit, na)
    with nogil:
        for i in range(na):
            s = <uint64_t>a[i]
            if s < <uint64_t>limit:
                _id_set_add(&seen, s)
        for i in range(nb):
            s = <uint64_t>b[i]
            if s < <uint64_t>limit and _id_set_has(&seen, s):
                found = i
                break
    _id_set_free(&seen)
    return found
