# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""The staged path's passes over a batch (kvcopy.staged), one loop over the copies
each: how the host side lies, and the chunks, host spans and kernel descriptors
against the staging buffers. A pass in NumPy cost 20-60 us per array operation on
16,384 copies, and the planning took a dozen of them."""

from libc.stdint cimport uint64_t, uintptr_t, int64_t

from kvcopy._cuda.descriptor cimport kvcopy_desc, KVCOPY_TILE_BYTES


def host_spans(const uint64_t[::1] host, const uint64_t[::1] sizes) -> tuple:
    """(spans, largest copy, empty copies) of a batch's host side (``host``: each copy's
    host address). A span is a run of copies each of which starts where the one
    before ends; empty copies are skipped and break no span."""
    if host.shape[0] != sizes.shape[0]:
        raise ValueError(f"host_spans: {host.shape[0]} addresses for {sizes.shape[0]} sizes")
    cdef Py_ssize_t i, n = sizes.shape[0]
    cdef uint64_t size, largest = 0, next_start = 0
    cdef int64_t spans = 0, empty = 0
    with nogil:
        for i in range(n):
            size = sizes[i]
            if size == 0:
                empty += 1
                continue
            if spans == 0 or host[i] != next_start:
                spans += 1
            next_start = host[i] + size
            if size > largest:
                largest = size
    return spans, largest, empty


def plan_chunks(const uint64_t[::1] host, const uint64_t[::1] gpu, const uint64_t[::1] sizes,
                bint load, uint64_t chunk_bytes, uint64_t buffer_even, uint64_t buffer_odd,
                uintptr_t table, int64_t[::1] chunk_first, uint64_t[::1] chunk_tiles,
                int64_t[::1] span_bounds, int64_t[::1] span_first, uint64_t[::1] span_host,
                uint64_t[::1] span_staged, uint64_t[::1] span_bytes) -> tuple:
    """Cut a side into chunks of whole copies of at most ``chunk_bytes``, in order, each
    filled as far as the next copy fits; chunk k is staged in ``buffer_even`` (k even)
    or ``buffer_odd``, its copies back to back. Write each non-empty copy's descriptor
    (staging buffer to GPU for a ``load``, GPU to staging buffer for a store; tiles
    counted from 0 in each chunk, which is launched alone) into the pinned ``table``,
    and each chunk's host spans (cut where chunks start), one cuMemcpyAsync each.

    Every output array has room for len(sizes) + 1 entries. Returns (descriptors,
    chunks, spans): chunk k is descriptors [chunk_first[k], chunk_first[k + 1]) of
    chunk_tiles[k] tiles and spans [span_bounds[k], span_bounds[k + 1]); span j starts
    at the caller's copy span_first[j], at host address span_host[j] and staged address
    span_staged[j], and has span_bytes[j] bytes. ValueError for a copy over a chunk."""
    cdef Py_ssize_t i, n = sizes.shape[0]
    if host.shape[0] != n or gpu.shape[0] != n:
        raise ValueError(f"plan_chunks: {host.shape[0]} host and {gpu.shape[0]} GPU addresses "
                         f"for {n} sizes")
    if chunk_first.shape[0] <= n or chunk_tiles.shape[0] <= n or span_bounds.shape[0] <= n \
            or span_first.shape[0] <= n or span_host.shape[0] <= n \
            or span_staged.shape[0] <= n or span_bytes.shape[0] <= n:
        raise ValueError(f"plan_chunks: every output needs room for {n + 1} entries")
    cdef kvcopy_desc* d = <kvcopy_desc*>table
    cdef int64_t count = 0, chunks = 0, spans = 0, too_large = -1
    cdef uint64_t size, used = 0, tiles = 0, buffer = 0, staged, next_host = 0
    cdef bint new_span
    with nogil:
        for i in range(n):
            size = sizes[i]
            if size == 0:
                continue
            if size > chunk_bytes:
                too_large = i
                break
            if chunks == 0 or used + size > chunk_bytes:
                if chunks:
                    chunk_tiles[chunks - 1] = tiles
                chunk_first[chunks] = count
                span_bounds[chunks] = spans
                buffer = buffer_even if chunks % 2 == 0 else buffer_odd
                chunks += 1
                used = 0
                tiles = 0
                new_span = True
            else:
                new_span = host[i] != next_host
            staged = buffer + used
            if new_span:
                span_first[spans] = i
                span_host[spans] = host[i]
                span_staged[spans] = staged
                span_bytes[spans] = 0
                spans += 1
            span_bytes[spans - 1] += size
            next_host = host[i] + size
            if load:
                d[count].src = staged
                d[count].dst = gpu[i]
            else:
                d[count].src = gpu[i]
                d[count].dst = staged
            d[count].size = size
            d[count].tile_start = tiles
            tiles += (size + KVCOPY_TILE_BYTES - 1) // KVCOPY_TILE_BYTES
            used += size
            count += 1
        if chunks:
            chunk_tiles[chunks - 1] = tiles
        chunk_first[chunks] = count
        span_bounds[chunks] = spans
    if too_large >= 0:
        raise ValueError(f"plan_chunks: copy {too_large} of {sizes[too_large]} bytes does not "
                         f"fit a chunk of {chunk_bytes}")
    return count, chunks, spans
