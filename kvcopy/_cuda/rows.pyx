# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""The layout kernel (include/kvcopy/rows_kernel.cuh): its launches, each a job passed
by value (so a captured graph keeps it), and the module's out-of-range report."""

from libc.stdint cimport uint64_t, uintptr_t

from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport CUdeviceptr, CUfunction, CUmodule, CUstream

from kvcopy._cuda.driver cimport check
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


def launch_rows(uintptr_t function, tuple src_side, tuple dst_side,
                const uint64_t[::1] src_bases, const uint64_t[::1] dst_bases,
                unsigned long long rows, unsigned long long pieces,
                unsigned long long piece_bytes, unsigned int max_ctas, unsigned int threads,
                uintptr_t stream) -> int:
    """Launch ``kvcopy_rows`` over every plane (one launch per PLANES_PER_LAUNCH planes,
    in order on the stream): plane p copies ``rows`` rows of ``pieces`` pieces of
    ``piece_bytes`` from its source base ``src_bases[p]`` to ``dst_bases[p]``. A side is
    (indices, slots, page_size, page_stride, slot_stride, piece_stride), as
    kvcopy_rows_side (rows.h). The job is a kernel parameter: nothing here outlives the
    call but the index arrays and memory it names, and the launches may be captured.
    Returns the number of launches."""
    cdef kvcopy_rows_job job
    cdef void* params[1]
    cdef Py_ssize_t n = src_bases.shape[0], start = 0, i, count
    cdef unsigned long long tiles
    cdef unsigned int grid, warps_per_cta = threads // 32
    cdef int launches = 0
    if dst_bases.shape[0] != n:
        raise ValueError("src_bases and dst_bases differ in length")
    if max_ctas == 0 or warps_per_cta == 0 or threads % 32:
        raise ValueError("max_ctas must be positive and threads a positive multiple of 32")
    _side(&job.src, src_side)
    _side(&job.dst, dst_side)
    job.rows = rows
    job.pieces = pieces
    job.piece_bytes = piece_bytes
    job.units_per_tile = units_per_tile(piece_bytes)
    job.tiles_per_plane = tiles_per_plane(rows * pieces, piece_bytes)
    if job.tiles_per_plane == 0 or n == 0:
        return 0
    params[0] = &job
    while start < n:
        count = n - start if n - start < KVCOPY_ROWS_PLANES else KVCOPY_ROWS_PLANES
        for i in range(count):
            job.planes[i].src = src_bases[start + i]
            job.planes[i].dst = dst_bases[start + i]
        job.num_planes = count
        tiles = job.tiles_per_plane * count
        grid = <unsigned int>min((tiles + warps_per_cta - 1) // warps_per_cta, max_ctas)
        with nogil:
            check(cydriver.cuLaunchKernel(<CUfunction>function, grid, 1, 1, threads, 1, 1, 0,
                                           <CUstream>stream, params, NULL))
        launches += 1
        start += count
    return launches


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
