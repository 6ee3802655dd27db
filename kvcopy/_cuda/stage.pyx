# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""The staged path's pass over a batch (kvcopy._engine.staged), one loop over the copies:
the chunks, host spans and kernel descriptors against the staging buffers (how the
host side lies was counted by the describe pass). A pass in NumPy cost 20-60 us per
array operation on 16,384 copies, and the planning took a dozen of them."""

from libc.stdint cimport uint64_t, uintptr_t, int64_t

from kvcopy._cuda.descriptor cimport kvcopy_desc, KVCOPY_TILE_BYTES


cdef Py_ssize_t _plan_chunk(const uint64_t* host, const uint64_t* gpu, const uint64_t* sizes,
                            Py_ssize_t n, Py_ssize_t start, bint load, uint64_t chunk_bytes,
                            uint64_t buffer, kvcopy_desc* d, int64_t* count_out,
                            uint64_t* tiles_out, int64_t* span_first, uint64_t* span_host,
                            uint64_t* span_staged, uint64_t* span_bytes, int64_t* spans_io,
                            Py_ssize_t* too_large) noexcept nogil:
    """One chunk from copy ``start`` on: its copies' descriptors from d[0] (tiles counted
    from 0), its spans appended from span *spans_io; returns the first copy it did not
    take (n at the end; a copy over a chunk sets *too_large and ends it)."""
    cdef Py_ssize_t i = start
    cdef int64_t count = 0, spans = spans_io[0]
    cdef uint64_t size, used = 0, tiles = 0, staged, next_host = 0
    while i < n:
        size = sizes[i]
        if size == 0:
            i += 1
            continue
        if size > chunk_bytes:
            too_large[0] = i
            break
        if count and used + size > chunk_bytes:
            break
        staged = buffer + used
        if count == 0 or host[i] != next_host:
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
        i += 1
    count_out[0] = count
    tiles_out[0] = tiles
    spans_io[0] = spans
    return i


cdef _check_room(str name, Py_ssize_t n, Py_ssize_t host_n, Py_ssize_t gpu_n, tuple outputs):
    if host_n != n or gpu_n != n:
        raise ValueError(f"{name}: {host_n} host and {gpu_n} GPU addresses for {n} sizes")
    for length in outputs:
        if length <= n:
            raise ValueError(f"{name}: every output needs room for {n + 1} entries")


def plan_next_chunk(const uint64_t[::1] host, const uint64_t[::1] gpu, const uint64_t[::1] sizes,
                    bint load, uint64_t chunk_bytes, uint64_t buffer, Py_ssize_t start,
                    uintptr_t table, int64_t[::1] span_first, uint64_t[::1] span_host,
                    uint64_t[::1] span_staged, uint64_t[::1] span_bytes, int64_t spans) -> tuple:
    """The next chunk of a side, from copy ``start`` on: whole copies, in order, filling
    ``buffer`` back to back as far as the next copy fits in ``chunk_bytes``. Writes
    each non-empty copy's descriptor (staging buffer to GPU for a ``load``, GPU to
    staging buffer for a store; tiles counted from 0, as the chunk is launched alone)
    from ``table`` (pinned) on, and the chunk's host spans (runs of host-adjacent
    copies, one cuMemcpyAsync each) from span ``spans`` on: span j starts at the
    caller's copy span_first[j], at host address span_host[j] and staged address
    span_staged[j], and has span_bytes[j] bytes. Every span array has room for
    len(sizes) + 1 entries. Returns (the first copy not taken, descriptors, tiles,
    spans in all): no descriptors where no copy is left. ValueError for a copy over
    a chunk."""
    cdef Py_ssize_t n = sizes.shape[0], too_large = -1
    _check_room("plan_next_chunk", n, host.shape[0], gpu.shape[0], (
        span_first.shape[0], span_host.shape[0], span_staged.shape[0], span_bytes.shape[0]))
    if not 0 <= start <= n or not 0 <= spans <= n:
        raise ValueError(f"plan_next_chunk: start {start} or spans {spans} outside 0..{n}")
    cdef int64_t taken = 0
    cdef uint64_t tiles = 0
    if start < n:
        with nogil:
            start = _plan_chunk(&host[0], &gpu[0], &sizes[0], n, start, load, chunk_bytes,
                                buffer, <kvcopy_desc*>table, &taken, &tiles, &span_first[0],
                                &span_host[0], &span_staged[0], &span_bytes[0], &spans,
                                &too_large)
    if too_large >= 0:
        raise ValueError(f"plan_next_chunk: copy {too_large} of {sizes[too_large]} bytes does "
                         f"not fit a chunk of {chunk_bytes}")
    return start, taken, tiles, spans
