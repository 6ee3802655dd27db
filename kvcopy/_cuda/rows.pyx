# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""The layout kernel (include/kvcopy/rows_kernel.cuh): its launches, each a job passed
by value (so a captured graph keeps it), and the module's out-of-range report."""

from libc.stdint cimport uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport (CUcontext, CUdeviceptr, CUfunction, CUmodule, CUresult,
                                     CUstream)

from kvcopy._cuda.driver cimport check, context_key
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


def units_per_tile(unsigned long long piece_bytes) -> int:
    """How many pieces one warp copies at once (up to 32, a tile's bytes at most);
    0 where a piece is longer than half a tile and is cut into tiles instead."""
    if piece_bytes == 0 or 2 * piece_bytes > KVCOPY_TILE_BYTES:
        return 0
    cdef unsigned long long units = KVCOPY_TILE_BYTES // piece_bytes
    return 32 if units > 32 else units


def tiles_per_plane(unsigned long long units, unsigned long long piece_bytes) -> int:
    """Warps' units of work one plane of ``units`` pieces of ``piece_bytes`` takes."""
    cdef unsigned long long per = units_per_tile(piece_bytes)
    if per:
        return (units + per - 1) // per
    return units * ((piece_bytes + KVCOPY_TILE_BYTES - 1) // KVCOPY_TILE_BYTES)


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
        cdef unsigned long long tiles
        cdef unsigned int warps_per_cta = threads // 32
        if dst_bases.shape[0] != n:
            raise ValueError("src_bases and dst_bases differ in length")
        if max_ctas == 0 or warps_per_cta == 0 or threads % 32:
            raise ValueError("max_ctas must be positive and threads a positive multiple of 32")
        _side(&job.src, src_side)
        _side(&job.dst, dst_side)
        memset(&job.only_skipped_by, 0, sizeof(kvcopy_rows_side))
        job.only_skipped_by.indices, job.only_skipped_by.slots = only_skipped_by
        job.only_skipped_by.page_size = 1
        job.first_row = first_row
        job.rows = rows
        job.pieces = pieces
        job.piece_bytes = piece_bytes
        job.units_per_tile = units_per_tile(piece_bytes)
        job.tiles_per_plane = tiles_per_plane(rows * pieces, piece_bytes)
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
            tiles = job.tiles_per_plane * count
            self.grids[k] = <unsigned int>min((tiles + warps_per_cta - 1) // warps_per_cta,
                                              max_ctas)
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
        cdef void* params[1]
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
                    status = cydriver.cuLaunchKernel(self.function, self.grids[k], 1, 1,
                                                     self.threads, 1, 1, 0, self.stream,
                                                     params, NULL)
                    if status != cydriver.CUDA_SUCCESS:
                        break
            if pushed:
                cydriver.cuCtxPopCurrent(&current)
            check(status)
        return self.count


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
