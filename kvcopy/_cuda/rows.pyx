# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""The layout kernel (include/kvcopy/rows_kernel.cuh): its launches, each a job passed
by value (so a captured graph keeps it), and the module's out-of-range report."""

from libc.stdint cimport uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport (CUcontext, CUdeviceptr, CUevent, CUfunction, CUmodule,
                                     CUresult, CUstream)

from kvcopy._cuda.dma cimport memcpy_each
from kvcopy._cuda.driver cimport check, context_key
from kvcopy._cuda.launch cimport check_launch_shape, ctas_for
from kvcopy._cuda.descriptor cimport KVCOPY_TILE_BYTES

cdef extern from "kvcopy/rows.h":
    int KVCOPY_ROWS_PLANES
    ctypedef struct kvcopy_rows_side:
        unsigned long long indices
        unsigned long long slots
        unsigned long long page_size
        unsigned long long page_stride
        unsigned long long slot_stride
        unsigned long long piece_stride
    ctypedef struct kvcopy_rows_plane:
        unsigned long long src
        unsigned long long dst
    ctypedef struct kvcopy_rows_job:
        kvcopy_rows_side src
        kvcopy_rows_side dst
        kvcopy_rows_side only_skipped_by
        unsigned long long first_row
        unsigned long long rows
        unsigned long long pieces
        unsigned long long piece_bytes
        unsigned long long units_per_tile
        unsigned long long tiles_per_plane
        unsigned long long num_planes
        kvcopy_rows_plane planes[128]
    ctypedef struct kvcopy_rows_status:
        unsigned long long skipped
        unsigned long long first_row

PLANES_PER_LAUNCH = KVCOPY_ROWS_PLANES
NO_ROW = 0xFFFFFFFFFFFFFFFF   # the report's first row where none was skipped


cdef int _side(kvcopy_rows_side* side, tuple values) except -1:
    side.indices, side.slots, side.page_size, side.page_stride, side.slot_stride, \
        side.piece_stride = values
    if side.page_size == 0:
        raise ValueError("page_size must be positive")
    return 0


cdef inline unsigned long long _units_per_tile(unsigned long long piece_bytes) noexcept nogil:
    cdef unsigned long long units
    if piece_bytes == 0 or 2 * piece_bytes > KVCOPY_TILE_BYTES:
        return 0
    units = KVCOPY_TILE_BYTES // piece_bytes
    return 32 if units > 32 else units


cdef inline unsigned long long _tiles_per_plane(unsigned long long units,
                                                unsigned long long piece_bytes) noexcept nogil:
    cdef unsigned long long per = _units_per_tile(piece_bytes)
    if per:
        return (units + per - 1) // per
    return units * ((piece_bytes + KVCOPY_TILE_BYTES - 1) // KVCOPY_TILE_BYTES)


def units_per_tile(unsigned long long piece_bytes) -> int:
    """How many pieces one warp copies at once (up to 32, a tile's bytes at most);
    0 where a piece is longer than half a tile and is cut into tiles instead."""
    return _units_per_tile(piece_bytes)


def tiles_per_plane(unsigned long long units, unsigned long long piece_bytes) -> int:
    """Warps' units of work one plane of ``units`` pieces of ``piece_bytes`` takes."""
    return _tiles_per_plane(units, piece_bytes)


cdef class RowsLaunches:
    """The launches of ``kvcopy_rows`` that copy every plane, built once (one per
    PLANES_PER_LAUNCH planes): plane p copies ``rows`` rows of ``pieces`` pieces of
    ``piece_bytes`` from its source base ``src_bases[p]`` to ``dst_bases[p]``. A side is
    (indices, slots, page_size, page_stride, slot_stride, piece_stride), as
    kvcopy_rows_side (rows.h). Each job is a kernel parameter, so launch() may be
    captured, and what it names is read when the kernel runs (the indices' values
    included). ``context`` (0: whichever is current) is made current for each launch()
    and must still be the one the launches were built in. ``first_row``: the launches
    copy rows first_row .. first_row + rows - 1 (indices read there, a side without
    indices mapping row r to slot r, a skipped row reported by that number).
    ``only_skipped_by`` (indices, slots): copy only the rows that index array skips
    (negative or >= slots), reporting none (rows.h)."""

    cdef kvcopy_rows_job* jobs
    cdef unsigned int* grids
    cdef readonly int count
    cdef CUfunction function
    cdef unsigned int threads
    cdef CUstream stream
    cdef CUcontext context
    cdef unsigned long long context_key

    def __cinit__(self, uintptr_t function, tuple src_side, tuple dst_side,
                  const uint64_t[::1] src_bases, const uint64_t[::1] dst_bases,
                  unsigned long long rows, unsigned long long pieces,
                  unsigned long long piece_bytes, unsigned int max_ctas, unsigned int threads,
                  uintptr_t stream, uintptr_t context=0, tuple only_skipped_by=(0, 0),
                  unsigned long long first_row=0):
        cdef Py_ssize_t n = src_bases.shape[0], start = 0, i, k, count
        cdef kvcopy_rows_job job
        if dst_bases.shape[0] != n:
            raise ValueError("src_bases and dst_bases differ in length")
        check_launch_shape(max_ctas, threads)
        _side(&job.src, src_side)
        _side(&job.dst, dst_side)
        memset(&job.only_skipped_by, 0, sizeof(kvcopy_rows_side))
        job.only_skipped_by.indices, job.only_skipped_by.slots = only_skipped_by
        job.only_skipped_by.page_size = 1
        job.first_row = first_row
        job.rows = rows
        job.pieces = pieces
        job.piece_bytes = piece_bytes
        job.units_per_tile = _units_per_tile(piece_bytes)
        job.tiles_per_plane = _tiles_per_plane(rows * pieces, piece_bytes)
        self.function = <CUfunction>function
        self.threads = threads
        self.stream = <CUstream>stream
        self.context = <CUcontext>context
        self.context_key = context_key(self.context)
        if job.tiles_per_plane == 0 or n == 0:
            return   # nothing to copy: no launch
        self.count = <int>((n + KVCOPY_ROWS_PLANES - 1) // KVCOPY_ROWS_PLANES)
        self.jobs = <kvcopy_rows_job*>malloc(self.count * sizeof(kvcopy_rows_job))
        self.grids = <unsigned int*>malloc(self.count * sizeof(unsigned int))
        if self.jobs == NULL or self.grids == NULL:
            raise MemoryError()
        for k in range(self.count):
            count = n - start if n - start < KVCOPY_ROWS_PLANES else KVCOPY_ROWS_PLANES
            for i in range(count):
                job.planes[i].src = src_bases[start + i]
                job.planes[i].dst = dst_bases[start + i]
            job.num_planes = count
            # (a warp per unit of work)
            self.grids[k] = ctas_for(job.tiles_per_plane * count, threads, max_ctas, 1)
            memcpy(&self.jobs[k], &job, sizeof(kvcopy_rows_job))
            start += count

    def __dealloc__(self):
        free(self.jobs)
        free(self.grids)

    def usable(self) -> bool:
        """False where the context the launches were built in is gone (a reset makes
        another under the same handle, without their kernel): build them again."""
        return self.context == NULL or context_key(self.context) == self.context_key

    def launch(self) -> int:
        """Enqueue every launch, in order, on the stream; returns how many."""
        return self._launch(False, 0, 0)

    def launch_indexed(self, uint64_t src_indices, uint64_t dst_indices) -> int:
        """launch(), each side's indices read at ``src_indices`` and ``dst_indices``
        (0: rows by number) instead of where the launches were built to read them: a
        repeated call's launches, built once, its indices uploaded anew at each call.
        The jobs are copied for the launch, so threads may share the launches."""
        return self._launch(True, src_indices, dst_indices)

    cdef int _launch(self, bint indexed, uint64_t src_indices, uint64_t dst_indices) except -1:
        cdef void* params[1]
        cdef kvcopy_rows_job job
        cdef CUcontext current = NULL
        cdef bint pushed = False
        cdef int k
        cdef CUresult status = cydriver.CUDA_SUCCESS
        if self.count == 0:
            return 0
        with nogil:
            if self.context != NULL:
                check(cydriver.cuCtxGetCurrent(&current))
                if current != self.context:
                    check(cydriver.cuCtxPushCurrent(self.context))
                    pushed = True
                if context_key(self.context) != self.context_key:
                    status = cydriver.CUDA_ERROR_CONTEXT_IS_DESTROYED
            if status == cydriver.CUDA_SUCCESS:
                for k in range(self.count):
                    params[0] = &self.jobs[k]
                    if indexed:  # (the driver copies a launch's parameters as it enqueues)
                        memcpy(&job, &self.jobs[k], sizeof(kvcopy_rows_job))
                        job.src.indices = src_indices
                        job.dst.indices = dst_indices
                        params[0] = &job
                    status = cydriver.cuLaunchKernel(self.function, self.grids[k], 1, 1,
                                                     self.threads, 1, 1, 0, self.stream,
                                                     params, NULL)
                    if status != cydriver.CUDA_SUCCESS:
                        break
            if pushed:
                cydriver.cuCtxPopCurrent(&current)
            check(status)
        return self.count


cdef class StagedRowsSide:
    """One side of a staged layout pair (kvcopy._engine.rows_staged), issued a chunk per
    call. A load (``load``) copies chunk k's host spans into its staging buffer on
    ``copy_stream``, then the layout kernel scatters the staging rows to the GPU side
    on ``kernel_stream``. A store first copies into the staging rows the host rows its
    gather skips (``only_skipped_by``), then gathers the GPU side's rows there, both on
    ``kernel_stream``, then copies the spans out on ``copy_stream``. The first step
    waits for the buffer's ``free_event``, the second for ``filled_event`` (recorded
    behind the first), and ``free_event`` is recorded behind the second.

    Sides are kvcopy_rows_side tuples (rows.h): ``staging_side`` the buffer, ``gpu_side``
    the GPU side with its indices, ``host_side`` the host rows as a side without
    indices (a store's fill). ``gpu_bases`` and ``host_bases``: each plane's base on
    either side as the device sees it. Chunk k's rows (``first_rows[k]``,
    ``row_counts[k]``) and, per plane, its host span, place in the buffer, bytes and
    the buffer's base for row numbers from the transfer's first row (``host``,
    ``staged``, ``nbytes``, ``staging_bases``: (chunks, planes) uint64 arrays,
    kvcopy._plans.rows_staging.StagedChunks) are read at each issue(), so they are
    kept. Issuing a chunk from Python (five driver calls and one or two launches built
    each time) cost a staged pair more CPU than the pair takes on the GPU."""

    cdef kvcopy_rows_job first
    cdef kvcopy_rows_job second
    cdef bint load
    cdef CUfunction function
    cdef unsigned int threads
    cdef unsigned int max_ctas
    cdef CUstream copy_stream
    cdef CUstream kernel_stream
    cdef Py_ssize_t count
    cdef Py_ssize_t planes
    cdef object arrays
    cdef const uint64_t* first_rows
    cdef const uint64_t* row_counts
    cdef const uint64_t* host
    cdef const uint64_t* staged
    cdef const uint64_t* nbytes
    cdef const uint64_t* staging_bases

    def __cinit__(self, uintptr_t function, bint load, tuple staging_side, tuple gpu_side,
                  tuple host_side, const uint64_t[::1] gpu_bases,
                  const uint64_t[::1] host_bases, tuple only_skipped_by,
                  unsigned long long pieces, unsigned long long piece_bytes,
                  unsigned int max_ctas, unsigned int threads, uintptr_t copy_stream,
                  uintptr_t kernel_stream, const uint64_t[::1] first_rows,
                  const uint64_t[::1] row_counts, const uint64_t[:, ::1] host,
                  const uint64_t[:, ::1] staged, const uint64_t[:, ::1] nbytes,
                  const uint64_t[:, ::1] staging_bases):
        cdef Py_ssize_t p, planes = gpu_bases.shape[0], count = first_rows.shape[0]
        cdef int j
        check_launch_shape(max_ctas, threads)
        if planes == 0 or planes > KVCOPY_ROWS_PLANES or host_bases.shape[0] != planes:
            raise ValueError(f"a staged side takes 1..{KVCOPY_ROWS_PLANES} planes, as many "
                             "on each side")
        if (row_counts.shape[0] != count
                or host.shape[0] != count or host.shape[1] != planes
                or staged.shape[0] != count or staged.shape[1] != planes
                or nbytes.shape[0] != count or nbytes.shape[1] != planes
                or staging_bases.shape[0] != count or staging_bases.shape[1] != planes):
            raise ValueError("the chunk arrays differ in shape")
        self.load, self.function, self.threads, self.max_ctas = load, <CUfunction>function, \
            threads, max_ctas
        self.copy_stream, self.kernel_stream = <CUstream>copy_stream, <CUstream>kernel_stream
        self.count, self.planes = count, planes
        # (a load's scatter, or a store's fill; then a store's gather)
        cdef kvcopy_rows_job* jobs[2]
        jobs[0], jobs[1] = &self.first, &self.second
        for j in range(2):
            memset(jobs[j], 0, sizeof(kvcopy_rows_job))
            jobs[j].only_skipped_by.page_size = 1
            jobs[j].pieces = pieces
            jobs[j].piece_bytes = piece_bytes
            jobs[j].units_per_tile = _units_per_tile(piece_bytes)
            jobs[j].num_planes = planes
        if load:
            _side(&self.first.src, staging_side)
            _side(&self.first.dst, gpu_side)
            for p in range(planes):
                self.first.planes[p].dst = gpu_bases[p]
        else:
            _side(&self.first.src, host_side)
            _side(&self.first.dst, staging_side)
            self.first.only_skipped_by.indices, self.first.only_skipped_by.slots = only_skipped_by
            _side(&self.second.src, gpu_side)
            _side(&self.second.dst, staging_side)
            for p in range(planes):
                self.first.planes[p].src = host_bases[p]
                self.second.planes[p].src = gpu_bases[p]
        self.arrays = (first_rows.base, row_counts.base, host.base, staged.base, nbytes.base,
                       staging_bases.base)
        if count:
            self.first_rows, self.row_counts = &first_rows[0], &row_counts[0]
            self.host, self.staged = &host[0, 0], &staged[0, 0]
            self.nbytes, self.staging_bases = &nbytes[0, 0], &staging_bases[0, 0]

    def __len__(self) -> int:
        return self.count

    def set_indices(self, uintptr_t indices) -> None:
        """Read the GPU side's indices at ``indices`` in the chunks issued from now on
        (host indices uploaded anew for a repeated call; a launch already issued keeps
        the address it was issued with)."""
        if self.load:
            self.first.dst.indices = indices
        else:
            self.first.only_skipped_by.indices = indices
            self.second.src.indices = indices

    def issue(self, Py_ssize_t k, uintptr_t free_event, uintptr_t filled_event) -> None:
        """Chunk k, behind the last use of its buffer (``free_event``). Raises CudaError;
        a failed span copy carries the span's plane."""
        cdef Py_ssize_t p, at
        cdef kvcopy_rows_job* jobs[2]
        cdef int n_jobs, j
        cdef unsigned int grid
        cdef void* params[1]
        cdef CUstream first = self.copy_stream if self.load else self.kernel_stream
        cdef CUstream second = self.kernel_stream if self.load else self.copy_stream
        if not 0 <= k < self.count:
            raise IndexError(k)
        at = k * self.planes
        jobs[0], jobs[1] = &self.first, &self.second
        n_jobs = 1 if self.load else 2
        for j in range(n_jobs):
            jobs[j].first_row = self.first_rows[k]
            jobs[j].rows = self.row_counts[k]
            jobs[j].tiles_per_plane = _tiles_per_plane(self.row_counts[k] * jobs[j].pieces,
                                                       jobs[j].piece_bytes)
            for p in range(self.planes):
                if self.load:
                    jobs[j].planes[p].src = self.staging_bases[at + p]
                else:
                    jobs[j].planes[p].dst = self.staging_bases[at + p]
        grid = ctas_for(self.first.tiles_per_plane * <unsigned long long>self.planes,
                        self.threads, self.max_ctas, 1)
        with nogil:
            check(cydriver.cuStreamWaitEvent(first, <CUevent>free_event, 0))
            if self.load:
                memcpy_each(self.staged + at, self.host + at, self.nbytes + at, 0, self.planes,
                            self.copy_stream)
            else:
                for j in range(n_jobs):
                    params[0] = jobs[j]
                    check(cydriver.cuLaunchKernel(self.function, grid, 1, 1, self.threads, 1,
                                                   1, 0, self.kernel_stream, params, NULL))
            check(cydriver.cuEventRecord(<CUevent>filled_event, first))
            check(cydriver.cuStreamWaitEvent(second, <CUevent>filled_event, 0))
            if self.load:
                params[0] = &self.first
                check(cydriver.cuLaunchKernel(self.function, grid, 1, 1, self.threads, 1, 1, 0,
                                               self.kernel_stream, params, NULL))
            else:
                memcpy_each(self.host + at, self.staged + at, self.nbytes + at, 0, self.planes,
                            self.copy_stream)
            check(cydriver.cuEventRecord(<CUevent>free_event, second))


def report_address(uintptr_t module) -> int:
    """The device address of the module's kvcopy_rows_report."""
    cdef CUdeviceptr address = 0
    cdef size_t nbytes = 0
    check(cydriver.cuModuleGetGlobal(&address, &nbytes, <CUmodule>module, b"kvcopy_rows_report"))
    return <uintptr_t>address


def take_report(uintptr_t address, uintptr_t stream, bint whole_context) -> tuple:
    """Wait for ``stream`` (or, with ``whole_context``, all work in the current context),
    then return (row copies skipped for an out-of-range index, the lowest such row or
    NO_ROW) since the report was last taken, and clear it."""
    cdef kvcopy_rows_status status
    cdef kvcopy_rows_status empty
    empty.skipped = 0
    empty.first_row = NO_ROW
    with nogil:
        if whole_context:
            check(cydriver.cuCtxSynchronize())
        else:
            check(cydriver.cuStreamSynchronize(<CUstream>stream))
        check(cydriver.cuMemcpyDtoH(&status, <CUdeviceptr>address, sizeof(status)))
        if status.skipped:
            check(cydriver.cuMemcpyHtoD(<CUdeviceptr>address, &empty, sizeof(empty)))
    return status.skipped, status.first_row
