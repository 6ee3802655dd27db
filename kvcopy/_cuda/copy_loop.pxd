# The planning loop shared by the planner (plan_arrays.pyx, for the DMA paths) and the
# fused describe pass (_cuda/describe.pyx, for the kernel path): both walk a batch with
# next_copy, so both validate, drop and merge copies exactly alike.
from libc.stdint cimport uint64_t

cdef enum:
    COPY_OK = 0
    COPY_TOO_LARGE = 1
    COPY_NULL_SRC = 2
    COPY_NULL_DST = 3
    COPY_SRC_WRAPS = 4
    COPY_DST_WRAPS = 5


cdef struct PlanCursor:
    Py_ssize_t next      # caller's index of the next copy to read
    Py_ssize_t n
    bint merge
    int why              # COPY_* of the first bad copy, COPY_OK while none
    Py_ssize_t bad       # its caller index
    uint64_t src         # the planned copy next_copy produced
    uint64_t dst
    uint64_t size
    Py_ssize_t origin    # caller's index of its first part
    uint64_t largest     # the largest of the caller's copies read so far
    Py_ssize_t empty     # the caller's empty copies skipped so far


cdef inline int copy_problem(uint64_t src, uint64_t dst, uint64_t size) noexcept nogil:
    """What is wrong with one non-empty copy, or COPY_OK."""
    if size > 0x7FFFFFFFFFFFFFFFULL:
        return COPY_TOO_LARGE
    if src == 0:
        return COPY_NULL_SRC
    if dst == 0:
        return COPY_NULL_DST
    if src > 0xFFFFFFFFFFFFFFFFULL - size:
        return COPY_SRC_WRAPS
    if dst > 0xFFFFFFFFFFFFFFFFULL - size:
        return COPY_DST_WRAPS
    return COPY_OK


cdef inline void plan_cursor_init(PlanCursor* c, Py_ssize_t n, bint merge) noexcept nogil:
    c.next = 0
    c.n = n
    c.merge = merge
    c.why = COPY_OK
    c.bad = -1
    c.largest = 0
    c.empty = 0


cdef inline bint next_copy(PlanCursor* c, const uint64_t* src, const uint64_t* dst,
                           const uint64_t* sizes) noexcept nogil:
    """Produce the next planned copy in c.src/dst/size/origin: zero-size copies
    skipped, copies that continue it on both sides merged into it. False at the
    end, or at a bad copy (c.why and c.bad say which)."""
    cdef Py_ssize_t i = c.next
    cdef uint64_t s
    while i < c.n and sizes[i] == 0:
        i += 1
        c.empty += 1
    if i >= c.n:
        c.next = i
        return False
    c.why = copy_problem(src[i], dst[i], sizes[i])
    if c.why:
        c.bad = i
        return False
    c.src, c.dst, c.size, c.origin = src[i], dst[i], sizes[i], i
    if sizes[i] > c.largest:
        c.largest = sizes[i]
    i += 1
    while c.merge and i < c.n:
        s = sizes[i]
        if s == 0:
            i += 1
            c.empty += 1
            continue
        if src[i] != c.src + c.size or dst[i] != c.dst + c.size:
            break
        c.why = copy_problem(src[i], dst[i], s)
        if c.why:
            c.bad = i
            return False
        c.size += s
        if s > c.largest:
            c.largest = s
        i += 1
    c.next = i
    return True
