# What the driver says a pointer is, kept as address ranges: shared by the
# describe pass (kernel path) and the DMA planner.
from libc.stdint cimport uint64_t, int64_t

# Classification bits: the kinds of memory a batch touches.
cdef enum:
    _KIND_DEVICE = 1          # device memory of one device, not managed
    _KIND_HOST_MAPPED = 2     # pinned host memory the current context's device can dereference
    _KIND_HOST_UNMAPPED = 4   # pageable host memory, or pinned but not mapped: DMA only
    _KIND_MANAGED = 8         # managed (unified) memory: DMA only
    _KIND_STRADDLE = 16       # a copy runs past the end of its allocation: DMA decides
    _KIND_PAGEABLE = 32       # memory the driver does not know (always with _KIND_HOST_UNMAPPED)
    _KIND_PEER = 64           # another device's memory, readable and writable from this one
    _KIND_PEER_UNMAPPED = 128  # another device's memory this device cannot access: DMA only
    _KIND_ANY_DEVICE = _KIND_DEVICE | _KIND_PEER | _KIND_PEER_UNMAPPED

cdef enum:
    # Ranges kept per side and call. A batch that cycles through its allocations
    # (block by block over every layer's tensor: 160 of them for 80 layers' K and V)
    # asked the driver about once per copy when they outnumbered the 64 kept before;
    # each range also remembers the one used after it (succ), so that such a batch
    # finds the next range without searching.
    _RANGE_CACHE = 256
    # Memory registered in pieces (SGLang registers its host pool a GiB at a time),
    # or allocated back to back, is many ranges: a batch scattered over more than
    # _RANGE_CACHE of them asked the driver once per copy. A range a side newly asks
    # for is joined with the cached ranges of the same memory next to it, for free;
    # from _WIDEN_ASKING_FROM cached ranges on, also with neighbours asked of the
    # driver, up to _WIDEN_STEPS each way, no more such questions per call than the
    # batch has copies (so joining at most doubles what asking once per copy costs)
    # and at most _WIDEN_BUDGET.
    _WIDEN_ASKING_FROM = 16
    _WIDEN_STEPS = 32
    _WIDEN_BUDGET = 2048


cdef struct _Range:
    uint64_t start
    uint64_t end
    int kind
    int ordinal
    int64_t delta    # device view = host pointer + delta


cdef struct _Classifier:
    # Driver answers kept as address ranges, for one call only: the driver is
    # asked once per allocation, not once per pointer.
    _Range cache[_RANGE_CACHE]
    int succ[_RANGE_CACHE]   # the slot used after this one last time (-1: none)
    int cached
    int last
    int kinds        # OR of _KIND_* over every pointer seen
    int ordinal      # device of the device memory seen (-1: none, -2: several)
    int queries      # ranges asked for (of the driver, or of the answers below)
    int widen_left   # questions left for joining neighbours (classifier_init)
    # tests: rows of (start, end, kind, ordinal, delta) answered instead of the
    # driver (NULL: ask the driver); an address in none of them is pageable
    const int64_t* answers
    Py_ssize_t answer_count


cdef int query_range(uint64_t ptr, uint64_t size, _Range* out) noexcept nogil
cdef uint64_t classify_slow(_Classifier* c, uint64_t p, uint64_t size) noexcept nogil
cdef _Range* locate(_Classifier* c, uint64_t p, uint64_t size) noexcept nogil
cdef int classifier_seed(_Classifier* c, const int64_t[:, ::1] ranges) except -1


cdef inline void classifier_init(_Classifier* c, Py_ssize_t copies) noexcept nogil:
    """An empty classifier for one side of a batch of ``copies`` copies."""
    c.cached = 0
    c.last = 0
    c.succ[0] = -1
    c.kinds = 0
    c.ordinal = -1
    c.queries = 0
    # Earned up front, not per miss: where a pool's pieces are dense in the batch,
    # the first joins must walk far to pay off (4096 copies over 512 pieces: ~800
    # questions earned one per miss, ~530 up front); where they are sparse, the
    # questions a batch may spend stay bounded by its size.
    c.widen_left = <int>(copies if copies < _WIDEN_BUDGET else _WIDEN_BUDGET)
    c.answers = NULL
    c.answer_count = 0
    c.cache[0].start = 1   # an empty range: the first lookup goes the slow way
    c.cache[0].end = 0


cdef inline uint64_t classify(_Classifier* c, uint64_t p, uint64_t size) noexcept nogil:
    """Classify the copy [p, p + size) and return the address the device uses for p.

    Batches mostly stay in one allocation per side: a copy inside the last
    range used needs two comparisons (its kind and device were recorded when
    that range was first used)."""
    cdef _Range* r = &c.cache[c.last]
    if r.start <= p and p + size <= r.end:
        return <uint64_t>(<int64_t>p + r.delta)
    return classify_slow(c, p, size)
