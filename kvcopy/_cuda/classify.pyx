# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""Pointer classification: what the driver says each pointer of a batch is.

The driver is asked once per allocation, not once per pointer: its answers are
kept as address ranges for the duration of one call (classify.pxd).
"""

from libc.stdint cimport uint64_t, int64_t
from libc.stdlib cimport malloc, free

from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport CUdeviceptr, CUdevice, CUcontext, CUpointer_attribute

from kvcopy._cuda.driver cimport context_key

KIND_DEVICE = _KIND_DEVICE
KIND_HOST_MAPPED = _KIND_HOST_MAPPED
KIND_HOST_UNMAPPED = _KIND_HOST_UNMAPPED
KIND_MANAGED = _KIND_MANAGED
KIND_STRADDLE = _KIND_STRADDLE
KIND_PAGEABLE = _KIND_PAGEABLE
KIND_PEER = _KIND_PEER
KIND_PEER_UNMAPPED = _KIND_PEER_UNMAPPED
WIDEN_BUDGET = _WIDEN_BUDGET


# (context key, peer device) pairs between which peer access is known to be enabled:
# entered by kvcopy._runtime.peers, which enables it (or learns that it already was).
# Entries are written before the count grows, so GIL-free readers see whole ones.
cdef enum:
    _PEER_TABLE = 256
cdef unsigned long long _peer_ctx[_PEER_TABLE]   # driver.context_key's
cdef int _peer_dev[_PEER_TABLE]
cdef int _peer_count = 0


def note_peer_access(unsigned long long ctx, int peer) -> None:
    """Record that the context of key ``ctx`` (driver.current_context_key) may
    access device ``peer``'s memory (its primary context's cuMemAlloc
    allocations). Callers serialise (kvcopy._runtime.peers' lock)."""
    global _peer_count
    cdef int i
    for i in range(_peer_count):
        if _peer_ctx[i] == ctx and _peer_dev[i] == peer:
            return
    if _peer_count < _PEER_TABLE:
        _peer_ctx[_peer_count] = ctx
        _peer_dev[_peer_count] = peer
        _peer_count += 1


cdef bint _peer_enabled(unsigned long long ctx, int peer) noexcept nogil:
    cdef int i
    for i in range(_peer_count):
        if _peer_ctx[i] == ctx and _peer_dev[i] == peer:
            return True
    return False


cdef int _device_kind(uint64_t ptr, int ordinal) noexcept nogil:
    """Device memory of the current context's device, or another device's memory that
    it can or cannot reach. Reachable needs both: peer access from this context to
    that device known to be enabled (the driver cannot be asked; the access flags
    read 'read-write' for cudaMalloc memory even without it), and the access flags
    granting read-write (virtual-memory and pool allocations are mapped per device)."""
    cdef CUdevice here
    cdef CUcontext ctx = NULL
    cdef unsigned int flags = 0
    if cydriver.cuCtxGetDevice(&here) != cydriver.CUDA_SUCCESS or <int>here == ordinal:
        return _KIND_DEVICE
    if (cydriver.cuCtxGetCurrent(&ctx) != cydriver.CUDA_SUCCESS
            or not _peer_enabled(context_key(ctx), ordinal)):
        return _KIND_PEER_UNMAPPED
    if cydriver.cuPointerGetAttribute(&flags, cydriver.CU_POINTER_ATTRIBUTE_ACCESS_FLAGS,
                                      <CUdeviceptr>ptr) != cydriver.CUDA_SUCCESS:
        return _KIND_PEER_UNMAPPED
    if flags == cydriver.CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE:
        return _KIND_PEER
    return _KIND_PEER_UNMAPPED


cdef int query_range(uint64_t ptr, uint64_t size, _Range* out) noexcept nogil:
    """Asks the driver what ptr points to and which range that answer covers.

    One cuPointerGetAttributes call, the device pointer included; where the
    driver refuses that attribute (host memory not mapped for this context),
    the other five are asked again without it."""
    cdef CUpointer_attribute attrs[6]
    cdef void* data[6]
    cdef unsigned int memtype = 0
    cdef int ordinal = -1
    cdef CUdeviceptr start = 0
    cdef size_t range_size = 0
    cdef unsigned int managed = 0
    cdef CUdeviceptr dptr = 0
    attrs[0] = cydriver.CU_POINTER_ATTRIBUTE_MEMORY_TYPE
    attrs[1] = cydriver.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    attrs[2] = cydriver.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR
    attrs[3] = cydriver.CU_POINTER_ATTRIBUTE_RANGE_SIZE
    attrs[4] = cydriver.CU_POINTER_ATTRIBUTE_IS_MANAGED
    attrs[5] = cydriver.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
    data[0] = &memtype
    data[1] = &ordinal
    data[2] = &start
    data[3] = &range_size
    data[4] = &managed
    data[5] = &dptr
    out.delta = 0
    out.ordinal = -1
    if cydriver.cuPointerGetAttributes(6, attrs, data, <CUdeviceptr>ptr) != cydriver.CUDA_SUCCESS:
        memtype, ordinal, start, range_size, managed, dptr = 0, -1, 0, 0, 0, 0
        if cydriver.cuPointerGetAttributes(5, attrs, data, <CUdeviceptr>ptr) != cydriver.CUDA_SUCCESS:
            memtype = 0
    if range_size > 0 and start <= ptr:
        out.start = start
        out.end = start + range_size
    else:
        out.start = ptr
        out.end = ptr + size
    if memtype == cydriver.CU_MEMORYTYPE_DEVICE and managed == 0:
        out.kind = _device_kind(ptr, ordinal)
        out.ordinal = ordinal
    elif memtype == cydriver.CU_MEMORYTYPE_HOST:
        if dptr != 0:
            out.kind = _KIND_HOST_MAPPED
            out.delta = <int64_t>(dptr - ptr)
        else:
            out.kind = _KIND_HOST_UNMAPPED
    elif managed != 0 or memtype == cydriver.CU_MEMORYTYPE_UNIFIED:
        out.kind = _KIND_MANAGED
    else:
        out.kind = _KIND_HOST_UNMAPPED | _KIND_PAGEABLE
    return 0


cdef int _ask(_Classifier* c, uint64_t ptr, uint64_t size, _Range* out) noexcept nogil:
    """query_range, or the classifier's seeded answers where a test gave some."""
    cdef Py_ssize_t j
    cdef const int64_t* row
    c.queries += 1
    if c.answers == NULL:
        return query_range(ptr, size, out)
    for j in range(c.answer_count):
        row = c.answers + 5 * j
        if <uint64_t>row[0] <= ptr < <uint64_t>row[1]:
            out.start, out.end = <uint64_t>row[0], <uint64_t>row[1]
            out.kind, out.ordinal, out.delta = <int>row[2], <int>row[3], row[4]
            return 0
    out.start, out.end = ptr, ptr + size
    out.kind, out.ordinal, out.delta = _KIND_HOST_UNMAPPED | _KIND_PAGEABLE, -1, 0
    return 0


cdef inline bint _joinable(const _Range* r) noexcept nogil:
    """Memory the kernel reaches the same way across allocations."""
    return r.kind == _KIND_DEVICE or r.kind == _KIND_HOST_MAPPED or r.kind == _KIND_PEER


cdef inline bint _same_memory(const _Range* r, const _Range* other) noexcept nogil:
    return (other.kind == r.kind and other.delta == r.delta
            and other.ordinal == r.ordinal)


cdef bint _extend_range(_Classifier* c, _Range* r, uint64_t end) noexcept nogil:
    """Grow r over the ranges that follow it while they are the same kind of memory,
    seen by the device at the same offset: memory registered in chunks, or
    back-to-back device allocations, is one range for the kernel."""
    cdef _Range nxt
    if not _joinable(r):
        return False
    while end > r.end:
        _ask(c, r.end, end - r.end, &nxt)
        if not _same_memory(r, &nxt) or nxt.start != r.end or nxt.end <= r.end:
            return False
        r.end = nxt.end
    return True


cdef bint _neighbour(_Classifier* c, _Range* r, uint64_t addr, bint ask,
                     _Range* out) noexcept nogil:
    """The range holding addr, for joining with r: a cached one of the same memory is
    taken without asking the driver (and emptied, its span being r's from now on);
    otherwise, with ``ask`` and questions left, the driver is asked."""
    cdef int j
    cdef _Range* e
    for j in range(c.cached):
        e = &c.cache[j]
        if e != r and e.start <= addr < e.end and _same_memory(r, e):
            out[0] = e[0]
            e.start, e.end = 1, 0
            return True
    if not ask or c.widen_left <= 0:
        return False
    c.widen_left -= 1
    _ask(c, addr, 1, out)
    return True


cdef void _widen(_Classifier* c, _Range* r, bint ask) noexcept nogil:
    """Join a newly asked-for range with the ranges on each side of it while they are
    the same memory: cached ones always, ones asked of the driver with ``ask``, up to
    _WIDEN_STEPS each way (classify.pxd), so that copies scattered over memory
    registered in pieces, or over allocations back to back, find their range among
    a few."""
    cdef _Range near
    cdef int steps = 0
    if not _joinable(r):
        return
    while steps < _WIDEN_STEPS and _neighbour(c, r, r.end, ask, &near):
        steps += 1
        if not _same_memory(r, &near) or near.start > r.end or near.end <= r.end:
            break
        r.end = near.end
    steps = 0
    while steps < _WIDEN_STEPS and r.start > 0 and _neighbour(c, r, r.start - 1, ask, &near):
        steps += 1
        if not _same_memory(r, &near) or near.end < r.start or near.start >= r.start:
            break
        r.start = near.start


cdef int classifier_seed(_Classifier* c, const int64_t[:, ::1] ranges) except -1:
    """Enter ranges as if the driver had answered them: rows of (start, end, kind,
    ordinal, delta). Lookups still go the slow way first, so kinds are recorded."""
    cdef Py_ssize_t j, k = ranges.shape[0]
    if ranges.shape[1] != 5 or k >= _RANGE_CACHE:
        raise ValueError(f"ranges must be (k, 5) with k < {_RANGE_CACHE}")
    for j in range(k):
        c.cache[j].start = <uint64_t>ranges[j, 0]
        c.cache[j].end = <uint64_t>ranges[j, 1]
        c.cache[j].kind = <int>ranges[j, 2]
        c.cache[j].ordinal = <int>ranges[j, 3]
        c.cache[j].delta = ranges[j, 4]
    c.cached = k
    c.last = k
    c.cache[k].start = 1
    c.cache[k].end = 0
    for j in range(k + 1):
        c.succ[j] = -1
    return 0


cdef uint64_t classify_slow(_Classifier* c, uint64_t p, uint64_t size) noexcept nogil:
    """classify for a copy outside the last range used: look it up, or ask the driver."""
    cdef int asked = c.queries
    cdef _Range* r = locate(c, p, size)
    if c.queries != asked:   # a miss: r was just asked for
        _widen(c, r, c.cached >= _WIDEN_ASKING_FROM)
    c.kinds |= r.kind
    if p + size > r.end and not _extend_range(c, r, p + size):
        c.kinds |= _KIND_STRADDLE
    if r.kind & _KIND_ANY_DEVICE:
        if c.ordinal == -1:
            c.ordinal = r.ordinal
        elif c.ordinal != r.ordinal:
            c.ordinal = -2
    return <uint64_t>(<int64_t>p + r.delta)


def classify_pointers(const uint64_t[::1] ptrs, const uint64_t[::1] sizes, uint64_t[::1] device_view):
    """Classify every pointer of a batch and write the address the device uses.

    Returns ``(kinds, ordinal)``: the OR of KIND_* bits over all pointers and the
    device ordinal of the device memory among them (-1: none, -2: several).
    """
    cdef Py_ssize_t n = ptrs.shape[0], i
    cdef _Classifier* c
    if sizes.shape[0] != n or device_view.shape[0] != n:
        raise ValueError("classify_pointers: arrays differ in length")
    c = <_Classifier*>malloc(sizeof(_Classifier))
    if c == NULL:
        raise MemoryError()
    classifier_init(c, n)
    with nogil:
        for i in range(n):
            device_view[i] = classify(c, ptrs[i], sizes[i])
    kinds, ordinal = c.kinds, c.ordinal
    free(c)
    return kinds, ordinal


cdef _Range* locate(_Classifier* c, uint64_t p, uint64_t size) noexcept nogil:
    """The driver's range (one allocation, never joined with its neighbours) that
    holds p: the DMA engines refuse a copy that leaves its allocation, so DMA
    copies are merged only inside one."""
    cdef int j, hit = -1
    cdef _Range* r = &c.cache[c.last]
    if r.start <= p < r.end:
        return r
    # (any cached range holding p is right: a stale successor only costs the search)
    j = c.succ[c.last]
    if 0 <= j < c.cached and c.cache[j].start <= p < c.cache[j].end:
        c.last = j
        return &c.cache[j]
    for j in range(c.cached):
        if c.cache[j].start <= p < c.cache[j].end:
            hit = j
            break
    if hit < 0:
        if c.cached < _RANGE_CACHE:
            hit = c.cached
            c.cached += 1
        else:
            # a slot emptied by joining (classify_slow) before the last one
            hit = _RANGE_CACHE - 1
            for j in range(c.cached):
                if c.cache[j].start > c.cache[j].end:
                    hit = j
                    break
        _ask(c, p, size, &c.cache[hit])
        c.succ[hit] = -1
    c.succ[c.last] = hit
    c.last = hit
    return &c.cache[hit]
