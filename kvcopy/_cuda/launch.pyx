# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""The copy kernel: module loading and launches over described batches (and the
staged path's chunks, each a kernel launch between copy-engine copies)."""

from libc.stdint cimport uint64_t, uintptr_t, int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport CUdeviceptr, CUstream, CUfunction, CUmodule, CUevent

from kvcopy._cuda.driver cimport check
from kvcopy._cuda.dma cimport memcpy_each
from kvcopy._cuda.descriptor cimport (kvcopy_desc, kvcopy_compact_desc, kvcopy_block_tensor,
                                      kvcopy_inline_batch, KVCOPY_TILE_BYTES, KVCOPY_INLINE_MAX,
                                      KVCOPY_INLINE_MAX_SMALL, KVCOPY_INLINE_MAX_TINY,
                                      KVCOPY_MAX_SPLIT, KVCOPY_BULK_THREADS)

TILE_BYTES = KVCOPY_TILE_BYTES
INLINE_MAX = KVCOPY_INLINE_MAX
INLINE_MAX_SMALL = KVCOPY_INLINE_MAX_SMALL
INLINE_MAX_TINY = KVCOPY_INLINE_MAX_TINY
BLOCK_TENSOR_BYTES = sizeof(kvcopy_block_tensor)
BULK_THREADS = KVCOPY_BULK_THREADS   # every CTA of the kvcopy_bulk_* kernels has this many


def module_load(bytes image) -> int:
    """Load a cubin into the current context."""
    cdef CUmodule module = NULL
    cdef const char* data = image
    check(cydriver.cuModuleLoadData(&module, <const void*>data))
    return <uintptr_t>module


def module_function(uintptr_t module, bytes name) -> int:
    cdef CUfunction function = NULL
    check(cydriver.cuModuleGetFunction(&function, <CUmodule>module, name))
    return <uintptr_t>function


cdef unsigned int ctas_for(unsigned long long tiles, unsigned int threads, unsigned int max_ctas,
                           unsigned long long warps_per_tile=KVCOPY_MAX_SPLIT) noexcept nogil:
    """CTAs for ``tiles`` tiles, at most max_ctas: by default up to KVCOPY_MAX_SPLIT
    warps per tile, so that a small batch spreads over the warps it may use (the
    scatter kernels split tiles; the block kernel does not)."""
    cdef unsigned long long warps = tiles * warps_per_tile
    cdef unsigned long long grid = (warps + threads // 32 - 1) // (threads // 32)
    return <unsigned int>(max_ctas if grid > max_ctas else grid)


cdef int check_launch_shape(unsigned int max_ctas, unsigned int threads) except -1:
    if max_ctas == 0 or threads == 0 or threads % 32 != 0:
        raise ValueError("max_ctas must be positive and threads a positive multiple of 32")
    return 0


cdef int _upload(CUdeviceptr device, uintptr_t host, size_t nbytes,
                 uintptr_t stream) except -1 nogil:
    """Copy ``nbytes`` of descriptors from ``host`` (pinned) to ``device`` on the stream."""
    return check(cydriver.cuMemcpyAsync(device, <CUdeviceptr>host, nbytes, <CUstream>stream))


cdef int _launch_after_upload(uintptr_t function, CUdeviceptr dev, uintptr_t upload_from,
                              size_t upload_bytes, unsigned int grid, unsigned int threads,
                              uintptr_t stream, void** params) except -1 nogil:
    """One launch of ``grid`` CTAs, after copying ``upload_bytes`` from ``upload_from``
    (pinned host memory) to ``dev`` on the stream where ``upload_from`` is set."""
    if upload_from:
        _upload(dev, upload_from, upload_bytes, stream)
    check(cydriver.cuLaunchKernel(<CUfunction>function, grid, 1, 1, threads, 1, 1, 0,
                                   <CUstream>stream, params, NULL))
    return 0


def upload(uintptr_t device, uintptr_t host, size_t nbytes, uintptr_t stream) -> None:
    """Copy ``nbytes`` of descriptors from ``host`` (pinned) to ``device`` on the stream:
    once for a table that several launches in a row read slices of, so that no copy
    sits between two of them on the stream."""
    with nogil:
        _upload(<CUdeviceptr>device, host, nbytes, stream)


cdef int launch_inline(uintptr_t function, int per_launch, const kvcopy_desc* descs,
                       Py_ssize_t n, unsigned int max_ctas, unsigned int threads,
                       uintptr_t stream, int* launches) except -1 nogil:
    """launch_descs_inline's launches, the arguments checked by the caller; adds the
    number of launches to ``*launches``."""
    cdef Py_ssize_t start = 0, j, count
    cdef unsigned long long first, tiles
    cdef void* params[1]
    cdef kvcopy_inline_batch* batch = <kvcopy_inline_batch*>malloc(sizeof(kvcopy_inline_batch))
    if batch == NULL:
        with gil:
            raise MemoryError()
    params[0] = <void*>batch
    try:
        while start < n:
            count = per_launch if n - start > per_launch else n - start
            first = descs[start].tile_start
            for j in range(count):
                batch.descs[j] = descs[start + j]
                batch.descs[j].tile_start -= first
            tiles = (batch.descs[count - 1].tile_start
                     + (batch.descs[count - 1].size + KVCOPY_TILE_BYTES - 1) // KVCOPY_TILE_BYTES)
            batch.count = count
            batch.total_tiles = tiles
            if tiles > 0:
                check(cydriver.cuLaunchKernel(<CUfunction>function,
                                               ctas_for(tiles, threads, max_ctas), 1, 1,
                                               threads, 1, 1, 0, <CUstream>stream, params, NULL))
                launches[0] += 1
            start += count
    finally:
        free(batch)
    return 0


def launch_descs_inline(uintptr_t function, int per_launch, uintptr_t host_descs, Py_ssize_t n,
                        unsigned int max_ctas, unsigned int threads, uintptr_t stream) -> int:
    """Launch the copy kernel with ``n`` descriptors (from describe_copies) passed by value.

    ``per_launch`` descriptors go into each launch (KVCOPY_INLINE_MAX,
    KVCOPY_INLINE_MAX_SMALL or KVCOPY_INLINE_MAX_TINY, matching ``function``). Parameters are copied into
    the launch, so ``host_descs`` may be reused as soon as this returns and
    the launch is safe to capture. Returns the number of launches.
    """
    cdef int launches = 0
    if per_launch <= 0 or per_launch > KVCOPY_INLINE_MAX:
        raise ValueError("launch_descs_inline: per_launch out of range")
    check_launch_shape(max_ctas, threads)
    with nogil:
        launch_inline(function, per_launch, <const kvcopy_desc*>host_descs, n, max_ctas,
                      threads, stream, &launches)
    return launches


def launch_descs(uintptr_t function, uintptr_t descs, Py_ssize_t n, unsigned long long tiles,
                 unsigned int max_ctas, unsigned int threads, uintptr_t stream,
                 uintptr_t upload_from=0) -> int:
    """Launch ``kvcopy_scatter`` once over ``n`` descriptors at ``descs``, a device-visible
    address: device memory, or pinned host memory mapped for the device, which the
    kernel then reads in place (one-tile copies only; see copy_kernel.cuh).

    With ``upload_from`` (pinned host memory), the descriptors are first copied
    from there to ``descs`` on the stream. ``tiles`` is the descriptors' total
    (describe_copies). Every buffer must stay untouched until the stream has
    passed this launch (the caller records an event). Not for stream capture:
    the graph would keep reading buffers that later calls overwrite. Returns
    the number of launches (0 or 1).
    """
    check_launch_shape(max_ctas, threads)
    if n <= 0 or tiles == 0:
        return 0
    return _launch_table(function, descs, n, tiles, sizeof(kvcopy_desc), tiles, max_ctas, threads,
                         stream, upload_from)


cdef int _launch_table(uintptr_t function, uintptr_t table, unsigned long long count,
                       unsigned long long third, size_t entry_bytes, unsigned long long tiles,
                       unsigned int max_ctas, unsigned int threads, uintptr_t stream,
                       uintptr_t upload_from) except -1:
    """One launch of a kernel taking (table, count, third) over ``count`` entries of
    ``entry_bytes``, uploaded first where ``upload_from`` is set. One warp per tile at
    most: a grid sized for splitting tiles would send each warp of a mid-sized batch
    (a few thousand copies inside one GPU) searching entries that may sit in pinned
    host memory, a PCIe round trip per step."""
    cdef CUdeviceptr dev = <CUdeviceptr>table
    cdef void* params[3]
    params[0] = &dev
    params[1] = &count
    params[2] = &third
    with nogil:
        _launch_after_upload(function, dev, upload_from, count * entry_bytes,
                             ctas_for(tiles, threads, max_ctas, 1), threads, stream, params)
    return 1


def issue_staged_chunk(bint load, uintptr_t copy_stream, uintptr_t kernel_stream,
                       uintptr_t free_event, uintptr_t filled_event, uintptr_t span_host,
                       uintptr_t span_staged, uintptr_t span_bytes, Py_ssize_t lo,
                       Py_ssize_t hi, uintptr_t function, uintptr_t descs, Py_ssize_t n,
                       unsigned long long tiles, unsigned int ctas, unsigned int threads) -> None:
    """One chunk of a staged side (kvcopy._engine.staged) in one call: spans [lo, hi) of the
    side's span arrays (``span_host``, ``span_staged``, ``span_bytes``: addresses of
    uint64 arrays), one cuMemcpyAsync each on ``copy_stream``, and the kernel over
    its ``n`` descriptors at ``descs`` (``tiles`` tiles) on ``kernel_stream``. A
    ``load`` copies the spans into the staging buffer, then scatters; a store
    gathers, then copies the spans out. The first step waits for ``free_event``
    (the buffer's last reader), the second for ``filled_event`` (recorded behind the
    first), and ``free_event`` is recorded behind the second. Where both streams are
    one, both steps still run, in that order. Issuing a chunk from Python (six
    driver calls, NumPy slices) made a staged call of 64 MiB each way CPU-bound on a
    slow host. Raises CudaError; a failed span copy carries the span's index."""
    cdef const uint64_t* host = <const uint64_t*>span_host
    cdef const uint64_t* staged = <const uint64_t*>span_staged
    cdef const uint64_t* nbytes = <const uint64_t*>span_bytes
    cdef CUstream copies = <CUstream>copy_stream
    cdef CUstream kernel = <CUstream>kernel_stream
    cdef CUstream first = copies if load else kernel
    cdef CUstream second = kernel if load else copies
    cdef CUdeviceptr dev = <CUdeviceptr>descs
    cdef unsigned long long count = <unsigned long long>n
    cdef unsigned int grid
    cdef void* params[3]
    check_launch_shape(ctas, threads)
    if (host == NULL or staged == NULL or nbytes == NULL) and hi > lo:
        raise ValueError("issue_staged_chunk: no span arrays")
    grid = ctas_for(tiles, threads, ctas, 1) if n > 0 else 0
    params[0] = &dev
    params[1] = &count
    params[2] = &tiles
    with nogil:
        check(cydriver.cuStreamWaitEvent(first, <CUevent>free_event, 0))
        if load:
            memcpy_each(staged, host, nbytes, lo, hi, copies)
        elif grid:
            check(cydriver.cuLaunchKernel(<CUfunction>function, grid, 1, 1, threads, 1, 1, 0,
                                           kernel, params, NULL))
        check(cydriver.cuEventRecord(<CUevent>filled_event, first))
        check(cydriver.cuStreamWaitEvent(second, <CUevent>filled_event, 0))
        if not load:
            memcpy_each(host, staged, nbytes, lo, hi, copies)
        elif grid:
            check(cydriver.cuLaunchKernel(<CUfunction>function, grid, 1, 1, threads, 1, 1, 0,
                                           kernel, params, NULL))
        check(cydriver.cuEventRecord(<CUevent>free_event, second))


def launch_compact(uintptr_t function, uintptr_t entries, Py_ssize_t n, unsigned long long size,
                 unsigned int max_ctas, unsigned int threads, uintptr_t stream,
                 uintptr_t upload_from=0) -> int:
    """Launch ``kvcopy_scatter_compact`` once over ``n`` kvcopy_compact_desc entries at ``entries``
    (from describe_compact: every copy ``size`` bytes, at most one tile), a
    device-visible address as for launch_descs, which the kernel reads in place;
    with ``upload_from``, the entries are first copied from there. Buffers as
    for launch_descs. Returns the number of launches (0 or 1)."""
    check_launch_shape(max_ctas, threads)
    if size == 0 or size > KVCOPY_TILE_BYTES:
        raise ValueError(f"launch_compact: size must be 1..{KVCOPY_TILE_BYTES} bytes, got {size}")
    if n <= 0:
        return 0
    return _launch_table(function, entries, n, size, sizeof(kvcopy_compact_desc), n, max_ctas, threads,
                         stream, upload_from)


def launch_both(uintptr_t function, uintptr_t descs, Py_ssize_t count_a,
                unsigned long long tiles_a, unsigned int ctas_a, Py_ssize_t count_b,
                unsigned long long tiles_b, unsigned int ctas_b, unsigned int threads,
                uintptr_t stream, uintptr_t upload_from=0, uintptr_t descs_b=0) -> int:
    """Launch ``kvcopy_scatter_both``: two described batches (each with tile_start
    counted from 0), the first at ``descs`` and the second at ``descs_b`` (0: right
    after the first), copied by ctas_a and ctas_b CTAs of one launch. With
    ``upload_from``, both are uploaded back to back first. Buffers as for
    launch_descs. Returns the number of launches (0 or 1)."""
    cdef CUdeviceptr dev = <CUdeviceptr>descs
    cdef CUdeviceptr dev_b = <CUdeviceptr>(descs_b or descs + count_a * sizeof(kvcopy_desc))
    cdef unsigned long long ca = <unsigned long long>count_a, cb = <unsigned long long>count_b
    cdef unsigned long long grid_a, grid_b
    cdef void* params[7]
    if upload_from and descs_b and dev_b != dev + count_a * sizeof(kvcopy_desc):
        raise ValueError("launch_both: an uploaded pair lies back to back")
    check_launch_shape(ctas_a or 1, threads)
    check_launch_shape(ctas_b or 1, threads)
    grid_a = ctas_for(tiles_a, threads, ctas_a) if tiles_a else 0
    grid_b = ctas_for(tiles_b, threads, ctas_b) if tiles_b else 0
    if grid_a + grid_b == 0:
        return 0
    params[0] = &dev
    params[1] = &ca
    params[2] = &tiles_a
    params[3] = &grid_a
    params[4] = &cb
    params[5] = &tiles_b
    params[6] = &dev_b
    with nogil:
        _launch_after_upload(function, dev, upload_from, (count_a + count_b) * sizeof(kvcopy_desc),
                             <unsigned int>(grid_a + grid_b), threads, stream, params)
    return 1


cdef unsigned long long _block_tiles(unsigned long long block_bytes) noexcept nogil:
    return (block_bytes + KVCOPY_TILE_BYTES - 1) // KVCOPY_TILE_BYTES


def launch_blocks_uploaded(uintptr_t function, uintptr_t host_buf, uintptr_t device_buf,
                         const uint64_t[:, ::1] tensors, const int64_t[:, ::1] mapping,
                         unsigned long long block_bytes, unsigned int max_ctas,
                         unsigned int threads, uintptr_t stream) -> int:
    """Launch the block kernel of swap_blocks: per-tensor bases and the id mapping only.

    ``tensors`` is (T, 6): src base, dst base, src stride, dst stride, src
    factor, dst factor (kvcopy_block_tensor); ``mapping`` is (n, 2) ids. Both
    are uploaded through ``host_buf`` (pinned) into ``device_buf``, which need
    room for blocks_upload_bytes(T, n) and must stay untouched until the
    stream has passed the launch. Returns the number of launches (0 or 1).
    """
    cdef Py_ssize_t num_tensors = tensors.shape[0], num_pairs = mapping.shape[0]
    cdef size_t table = num_tensors * sizeof(kvcopy_block_tensor)
    cdef size_t offset = (table + 15) & ~(<size_t>15)
    cdef size_t total = offset + num_pairs * 2 * sizeof(int64_t)
    cdef unsigned long long tiles_per_block, tiles
    cdef unsigned long long n_tensors = num_tensors, n_pairs = num_pairs, bb = block_bytes
    cdef CUdeviceptr dev_tensors = <CUdeviceptr>device_buf
    cdef CUdeviceptr dev_mapping = <CUdeviceptr>(device_buf + offset)
    cdef void* params[6]
    if tensors.shape[1] != 6 or mapping.shape[1] != 2:
        raise ValueError("launch_blocks_uploaded: tensors must be (T, 6) and mapping (n, 2)")
    check_launch_shape(max_ctas, threads)
    if num_tensors == 0 or num_pairs == 0 or block_bytes == 0:
        return 0
    tiles_per_block = _block_tiles(block_bytes)
    tiles = tiles_per_block * n_pairs * n_tensors
    params[0] = &dev_tensors
    params[1] = &n_tensors
    params[2] = &dev_mapping
    params[3] = &n_pairs
    params[4] = &bb
    params[5] = &tiles_per_block
    with nogil:
        memcpy(<void*>host_buf, &tensors[0, 0], table)
        memcpy(<void*>(host_buf + offset), &mapping[0, 0], num_pairs * 2 * sizeof(int64_t))
        _launch_after_upload(function, <CUdeviceptr>device_buf, host_buf, total,
                             ctas_for(tiles, threads, max_ctas, 1), threads, stream, params)
    return 1


def blocks_upload_bytes(Py_ssize_t num_tensors, Py_ssize_t num_pairs) -> int:
    """Bytes of upload space launch_blocks_uploaded needs for T tensors and n pairs."""
    return ((num_tensors * sizeof(kvcopy_block_tensor) + 15) & ~15) + num_pairs * 2 * sizeof(int64_t)


def launch_blocks_both_uploaded(uintptr_t function, uintptr_t host_buf, uintptr_t device_buf,
                              const uint64_t[:, ::1] tensors_a, const int64_t[:, ::1] mapping_a,
                              unsigned long long block_bytes_a, unsigned int ctas_a,
                              const uint64_t[:, ::1] tensors_b, const int64_t[:, ::1] mapping_b,
                              unsigned long long block_bytes_b, unsigned int ctas_b,
                              unsigned int threads, uintptr_t stream) -> int:
    """Launch ``kvcopy_blocks_both``: two swap_blocks (tensor table and id mapping
    each, as launch_blocks_uploaded takes them) copied by up to ctas_a and ctas_b CTAs
    of one launch. Staged as launch_blocks_uploaded stages one, into room for
    blocks_both_upload_bytes(Ta, na, Tb, nb). Each side needs tensors, pairs and
    bytes (the caller runs an empty side apart). Returns the number of launches (1)."""
    cdef Py_ssize_t ta = tensors_a.shape[0], tb = tensors_b.shape[0]
    cdef Py_ssize_t na = mapping_a.shape[0], nb = mapping_b.shape[0]
    cdef size_t table_a = ta * sizeof(kvcopy_block_tensor)
    cdef size_t table_b = tb * sizeof(kvcopy_block_tensor)
    cdef size_t offset = (table_a + table_b + 15) & ~(<size_t>15)
    cdef size_t ids_a = na * 2 * sizeof(int64_t), ids_b = nb * 2 * sizeof(int64_t)
    cdef unsigned long long n_ta = ta, n_na = na, n_tb = tb, n_nb = nb
    cdef unsigned long long bb_a = block_bytes_a, bb_b = block_bytes_b
    cdef unsigned long long grid_a, grid_b
    cdef CUdeviceptr dev_tensors = <CUdeviceptr>device_buf
    cdef CUdeviceptr dev_mapping = <CUdeviceptr>(device_buf + offset)
    cdef void* params[9]
    if tensors_a.shape[1] != 6 or tensors_b.shape[1] != 6 or mapping_a.shape[1] != 2 \
            or mapping_b.shape[1] != 2:
        raise ValueError("launch_blocks_both_uploaded: tensors must be (T, 6) and mappings (n, 2)")
    if ta == 0 or tb == 0 or na == 0 or nb == 0 or block_bytes_a == 0 or block_bytes_b == 0:
        raise ValueError("launch_blocks_both_uploaded: each side needs tensors, pairs and bytes")
    check_launch_shape(ctas_a, threads)
    check_launch_shape(ctas_b, threads)
    grid_a = ctas_for(_block_tiles(bb_a) * n_na * n_ta, threads, ctas_a, 1)
    grid_b = ctas_for(_block_tiles(bb_b) * n_nb * n_tb, threads, ctas_b, 1)
    params[0] = &dev_tensors
    params[1] = &dev_mapping
    params[2] = &n_ta
    params[3] = &n_na
    params[4] = &bb_a
    params[5] = &grid_a
    params[6] = &n_tb
    params[7] = &n_nb
    params[8] = &bb_b
    with nogil:
        memcpy(<void*>host_buf, &tensors_a[0, 0], table_a)
        memcpy(<void*>(host_buf + table_a), &tensors_b[0, 0], table_b)
        memcpy(<void*>(host_buf + offset), &mapping_a[0, 0], ids_a)
        memcpy(<void*>(host_buf + offset + ids_a), &mapping_b[0, 0], ids_b)
        _launch_after_upload(function, dev_tensors, host_buf, offset + ids_a + ids_b,
                             <unsigned int>(grid_a + grid_b), threads, stream, params)
    return 1


def blocks_both_upload_bytes(Py_ssize_t tensors_a, Py_ssize_t pairs_a, Py_ssize_t tensors_b,
                              Py_ssize_t pairs_b) -> int:
    """Bytes of upload space launch_blocks_both_uploaded needs."""
    return blocks_upload_bytes(tensors_a + tensors_b, pairs_a + pairs_b)
