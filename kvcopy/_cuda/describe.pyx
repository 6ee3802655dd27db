# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""The kernel path's describe pass: plan, classify and write the kernel's
descriptors in one pass over a batch."""

from libc.stdint cimport uint64_t, uintptr_t, int64_t
from libc.stdlib cimport malloc, free

from kvcopy._cuda.classify cimport (_Range, _Classifier, _KIND_STRADDLE, classifier_init,
                                    classify)
from kvcopy._cuda.descriptor cimport kvcopy_desc, kvcopy_compact_desc, KVCOPY_TILE_BYTES
from kvcopy._cuda.copy_loop cimport (PlanCursor, plan_cursor_init, next_copy, copy_problem, COPY_OK)

from kvcopy._cuda.plan_arrays import bad_copy_error, length_error

cdef extern from "describe_fast.h":
    ctypedef struct kvcopy_sides:
        uint64_t src_runs
        uint64_t dst_runs
        uint64_t largest
    int kvcopy_fast_describe_available() nogil
    unsigned KVCOPY_FAST_MISFIT
    unsigned KVCOPY_FAST_MERGES
    unsigned KVCOPY_FAST_SIZES
    unsigned kvcopy_describe_in_ranges(const uint64_t* src, const uint64_t* dst,
                                       const uint64_t* sizes, void* descs_out, int compact,
                                       uint64_t tiles_per_copy, int64_t n,
                                       uint64_t src_start, uint64_t src_span, int64_t src_delta,
                                       uint64_t dst_start, uint64_t dst_span, int64_t dst_delta,
                                       uint64_t* total_out, kvcopy_sides* sides_out) nogil
    int64_t kvcopy_describe_merging(const uint64_t* src, const uint64_t* dst,
                                    const uint64_t* sizes, kvcopy_desc* out, int64_t n,
                                    int merge, int64_t src_delta, int64_t dst_delta,
                                    uint64_t* tiles_out) nogil


DESCRIPTOR_BYTES = sizeof(kvcopy_desc)
COMPACT_BYTES = sizeof(kvcopy_compact_desc)


cdef inline void _describe_one(kvcopy_desc* d, _Classifier* sides, uint64_t a, uint64_t b,
                               uint64_t size, unsigned long long* tiles) noexcept nogil:
    d.src = classify(&sides[0], a, size)
    d.dst = classify(&sides[1], b, size)
    d.size = size
    d.tile_start = tiles[0]
    tiles[0] += (size + KVCOPY_TILE_BYTES - 1) // KVCOPY_TILE_BYTES


cdef bint _fast_describe = kvcopy_fast_describe_available()
cdef enum:
    _KEEP_GIL_BELOW = 256   # copies


cdef bint _describe_fast(const uint64_t* src, const uint64_t* dst, const uint64_t* sizes,
                         Py_ssize_t n, void* descs, _Classifier* sides, bint merge,
                         unsigned long long* total, unsigned long long* tiles,
                         uint64_t* compact_size, Py_ssize_t* count,
                         kvcopy_sides* spans) noexcept nogil:
    """The common batch, inside one allocation per side, in one branch-free pass
    (describe_fast.h): True when it applied, with exactly what the general loop would
    have written (*count entries). Copies of one size longer than a tile take it too
    (each then counts that many tiles); copies that continue the one before, or
    multi-tile copies of several sizes, are then written again by one scalar pass
    that needs no classifying. *compact_size in: may compact entries be written (kvcopy_compact_desc);
    out: their copies' size, else 0. *spans: each side's continuing copies and the
    largest copy, or its bound (describe_fast.h; every copy here is non-empty)."""
    cdef _Range* rs
    cdef _Range* rd
    cdef uint64_t nbytes = 0, settled_tiles = 0
    cdef unsigned misfit
    cdef uint64_t per_copy
    cdef bint compact
    cdef uint64_t compact_size_in = compact_size[0]
    compact_size[0] = 0
    if not _fast_describe or sizes[0] == 0:
        return False
    if copy_problem(src[0], dst[0], sizes[0]) != COPY_OK:
        return False
    per_copy = (sizes[0] + KVCOPY_TILE_BYTES - 1) // KVCOPY_TILE_BYTES
    compact = compact_size_in != 0 and per_copy == 1 and sizes[n - 1] == sizes[0]
    # the first copy picks the range each side is checked against
    classify(&sides[0], src[0], sizes[0])
    classify(&sides[1], dst[0], sizes[0])
    if (sides[0].kinds | sides[1].kinds) & _KIND_STRADDLE:
        return False
    rs = &sides[0].cache[sides[0].last]
    rd = &sides[1].cache[sides[1].last]
    misfit = kvcopy_describe_in_ranges(src, dst, sizes, descs, compact, per_copy, n, rs.start,
                                       rs.end - rs.start, rs.delta, rd.start, rd.end - rd.start,
                                       rd.delta, &nbytes, spans)
    if misfit & KVCOPY_FAST_MISFIT:
        return False
    total[0] = nbytes
    if (merge and misfit & KVCOPY_FAST_MERGES) or (per_copy > 1 and misfit & KVCOPY_FAST_SIZES):
        # every copy is in range: only the merging and the tile count are left to do
        count[0] = kvcopy_describe_merging(src, dst, sizes, <kvcopy_desc*>descs, n, merge,
                                           rs.delta, rd.delta, &settled_tiles)
        tiles[0] = settled_tiles
        return True
    if compact and misfit & KVCOPY_FAST_SIZES:
        # sizes differ: compact entries cannot say so, descriptors can
        kvcopy_describe_in_ranges(src, dst, sizes, descs, False, 1, n, rs.start,
                                  rs.end - rs.start, rs.delta, rd.start, rd.end - rd.start,
                                  rd.delta, &nbytes, spans)
    elif compact:
        compact_size[0] = sizes[0]
    count[0] = n
    tiles[0] = n * per_copy
    return True


cdef void _describe_pass(const uint64_t* src, const uint64_t* dst, const uint64_t* sizes,
                         Py_ssize_t n, kvcopy_desc* descs, bint merge, _Classifier* sides,
                         PlanCursor* cursor, bint* fast, uint64_t* compact_size,
                         unsigned long long* total, unsigned long long* tiles,
                         Py_ssize_t* k, Described* out) noexcept nogil:
    """describe_raw's pass: the vectorised one where it applies, else the general loop
    (a bad copy stops it, in cursor.why); each side's spans, the largest copy and the
    empty ones into *out."""
    cdef kvcopy_sides found
    cdef uint64_t src_end = 0, dst_end = 0
    if fast[0]:
        fast[0] = _describe_fast(src, dst, sizes, n, descs, sides, merge, total, tiles,
                                 compact_size, k, &found)
    else:
        compact_size[0] = 0
    if fast[0]:
        out.src_spans, out.dst_spans = n - <Py_ssize_t>found.src_runs, n - <Py_ssize_t>found.dst_runs
        out.largest, out.empty = found.largest, 0
        return
    total[0] = 0
    out.src_spans = out.dst_spans = 0
    while next_copy(cursor, src, dst, sizes):
        _describe_one(&descs[k[0]], sides, cursor.src, cursor.dst, cursor.size, tiles)
        total[0] += cursor.size
        # (a copy merged into this one continued it on both sides: no span ends inside)
        out.src_spans += k[0] == 0 or cursor.src != src_end
        out.dst_spans += k[0] == 0 or cursor.dst != dst_end
        src_end, dst_end = cursor.src + cursor.size, cursor.dst + cursor.size
        k[0] += 1
    out.largest, out.empty = cursor.largest, cursor.empty


cdef int describe_raw(const uint64_t* src, const uint64_t* dst, const uint64_t* sizes,
                      Py_ssize_t n, void* descs_out, bint merge, _Classifier* sides,
                      Described* out) except -1:
    """describe_copies over the given classifiers and raw arrays of ``n`` copies
    (n > 0), its results in ``out``; out.fast in: may the vectorised pass run, out:
    did it apply; out.compact_size as _describe_fast's *compact_size. Raises ValueError
    for a bad copy, naming the caller's index."""
    cdef Py_ssize_t k = 0
    cdef kvcopy_desc* descs = <kvcopy_desc*>descs_out
    cdef unsigned long long tiles = 0, total = 0
    cdef PlanCursor cursor
    cdef bint fast = out.fast
    cdef uint64_t compact_size = out.compact_size
    if descs == NULL:
        raise ValueError("describe_copies: no descriptor buffer")
    plan_cursor_init(&cursor, n, merge)
    # (the GIL is kept for small batches: releasing it costs more than they take)
    if n < _KEEP_GIL_BELOW:
        _describe_pass(src, dst, sizes, n, descs, merge, sides, &cursor, &fast, &compact_size,
                       &total, &tiles, &k, out)
    else:
        with nogil:
            _describe_pass(src, dst, sizes, n, descs, merge, sides, &cursor, &fast,
                           &compact_size, &total, &tiles, &k, out)
    if cursor.why:
        raise bad_copy_error(cursor.why, cursor.bad, sizes[cursor.bad])
    out.count, out.total, out.tiles, out.fast, out.compact_size = k, total, tiles, fast, compact_size
    return 0


cdef class DescribedBatch:
    """What the describe pass found of a batch, all that a path needs to issue it.

    ``count`` planned copies (merged, empty ones dropped) of ``total_bytes`` in all,
    ``tiles`` tiles of the kernel; each side's memory kinds and device ordinal (as
    classify_pointers reports them); ``table``: where their entries were written,
    ``compact_size``: the copy size of kvcopy_compact_desc entries (16 bytes), 0 where
    kvcopy_desc entries (32 bytes) were written; ``src_spans`` and ``dst_spans``: each
    side's runs of copies that start where the one before ends (empty copies
    skipped; the staged path asks the host side's); ``largest_copy``: the caller's
    largest copy (where copies of several sizes took the vectorised pass, the whole
    number of tiles every one kept within: what is asked of it is whether copies fit a
    tile or a staging chunk); ``empty_copies``: the caller's empty copies; ``src``,
    ``dst``, ``sizes``: the caller's arrays, every copy in them validated.
    """

    def __init__(self, Py_ssize_t count, unsigned long long total_bytes, unsigned long long tiles,
                 int src_kinds, int src_device, int dst_kinds, int dst_device,
                 uint64_t compact_size=0, uintptr_t table=0, src=None, dst=None, sizes=None,
                 Py_ssize_t src_spans=-1, Py_ssize_t dst_spans=-1, uint64_t largest_copy=0,
                 Py_ssize_t empty_copies=0):
        # (the describe pass builds its answers without this; tests' fakes use it, and
        # spans of -1 there mean one per copy)
        self.count, self.total_bytes, self.tiles = count, total_bytes, tiles
        self.src_kinds, self.src_device = src_kinds, src_device
        self.dst_kinds, self.dst_device = dst_kinds, dst_device
        self.compact_size, self.table = compact_size, table
        self.src_spans = count if src_spans < 0 else src_spans
        self.dst_spans = count if dst_spans < 0 else dst_spans
        self.largest_copy, self.empty_copies = largest_copy, empty_copies
        self.src, self.dst, self.sizes = src, dst, sizes

    def __repr__(self) -> str:
        return (f"DescribedBatch(count={self.count}, total_bytes={self.total_bytes}, "
                f"tiles={self.tiles}, src_kinds={self.src_kinds}, src_device={self.src_device}, "
                f"dst_kinds={self.dst_kinds}, dst_device={self.dst_device}, "
                f"compact_size={self.compact_size}, src_spans={self.src_spans}, "
                f"dst_spans={self.dst_spans}, largest_copy={self.largest_copy}, "
                f"empty_copies={self.empty_copies})")


cdef DescribedBatch described(Described* out, _Classifier* sides, uintptr_t table, object src,
                              object dst, object sizes):
    """describe_raw's results (over ``sides``) as a DescribedBatch."""
    cdef DescribedBatch batch = DescribedBatch.__new__(DescribedBatch)
    batch.count, batch.total_bytes, batch.tiles = out.count, out.total, out.tiles
    batch.src_kinds, batch.src_device = sides[0].kinds, sides[0].ordinal
    batch.dst_kinds, batch.dst_device = sides[1].kinds, sides[1].ordinal
    batch.compact_size, batch.table = out.compact_size, table
    batch.src_spans, batch.dst_spans = out.src_spans, out.dst_spans
    batch.largest_copy, batch.empty_copies = out.largest, out.empty
    batch.src, batch.dst, batch.sizes = src, dst, sizes
    return batch


cdef DescribedBatch describe_with(object src_arr, object dst_arr, object sizes_arr,
                                  uintptr_t descs_out, bint merge, _Classifier* sides,
                                  bint* fast, bint compact):
    """describe_copies over the given classifiers; *fast in: may the vectorised pass
    run, out: did it apply; ``compact``: may kvcopy_compact_desc entries be written."""
    cdef const uint64_t[::1] src = src_arr
    cdef const uint64_t[::1] dst = dst_arr
    cdef const uint64_t[::1] sizes = sizes_arr
    cdef Py_ssize_t n = sizes.shape[0]
    cdef Described out
    if src.shape[0] != n or dst.shape[0] != n:
        raise length_error(src.shape[0], dst.shape[0], n)
    out.count, out.total, out.tiles, out.fast, out.compact_size = 0, 0, 0, fast[0], compact
    out.src_spans = out.dst_spans = out.empty = 0
    out.largest = 0
    if n == 0:
        out.compact_size = 0   # (classifier_init left each side with no memory)
    else:
        describe_raw(&src[0], &dst[0], &sizes[0], n, <void*>descs_out, merge, sides, &out)
    fast[0] = out.fast
    return described(&out, sides, descs_out, src_arr, dst_arr, sizes_arr)


def describe_copies(object src, object dst, object sizes, uintptr_t descs_out, bint merge=True):
    """Plan, classify and describe a batch in one pass over it.

    Validates every copy as plan_arrays.plan_arrays does (same checks, same
    messages), drops zero-size copies, merges a copy that continues the
    previous one on both sides (with ``merge``), classifies both sides and
    writes one kvcopy_desc per planned copy into ``descs_out`` (room for
    ``len(sizes)`` entries): the device's view of both pointers, the size and
    the first tile. Nothing is enqueued. A batch inside one allocation per
    side with no empty copy takes a vectorised pass (and, where copies merge or
    multi-tile sizes differ, a scalar one after it that classifies nothing).

    Returns a DescribedBatch (compact_size 0).

    Raises:
        ValueError: as plan_arrays, naming the caller's index.
    """
    return _describe(src, dst, sizes, descs_out, merge, False)


def describe_compact(object src, object dst, object sizes, uintptr_t descs_out,
                     bint merge=True):
    """describe_copies, writing a kvcopy_compact_desc per copy (half the bytes) where the
    vectorised pass applies and every copy has the same size; else what
    describe_copies writes. The DescribedBatch's compact_size says which: the compact entries'
    copy size, or 0 where kvcopy_desc entries were written."""
    return _describe(src, dst, sizes, descs_out, merge, True)


cdef DescribedBatch _describe(object src, object dst, object sizes, uintptr_t descs_out,
                              bint merge, bint compact):
    cdef _Classifier* sides = <_Classifier*>malloc(2 * sizeof(_Classifier))
    cdef bint fast = True
    if sides == NULL:
        raise MemoryError()
    classifier_init(&sides[0], len(sizes))
    classifier_init(&sides[1], len(sizes))
    try:
        return describe_with(src, dst, sizes, descs_out, merge, sides, &fast, compact)
    finally:
        free(sides)


def fast_describe_available() -> bool:
    """Whether this CPU runs the vectorised describe pass (AVX2 on x86-64)."""
    return _fast_describe
