# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""DMA paths: the DMA planner, batched DMA (cuMemcpyBatchAsync), per-copy DMA, and
one block copy issued again straight from its ids (BlockCopyAgain).

cuMemcpyBatchAsync, whose ABI differs between 12.8 and 13.0, is resolved with
cuGetProcAddress by the running driver's version and called through kvcopy's
own typedefs (include/kvcopy/batch_abi.h).
"""

from libc.stdint cimport uint64_t, uintptr_t, int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_RECORDS_RO

from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport CUresult, CUdeviceptr, CUstream

from kvcopy._cuda.driver cimport check
from kvcopy._cuda.classify cimport (_Range, _Classifier, _KIND_PAGEABLE, classifier_init, locate)
from kvcopy._cuda.copy_loop cimport PlanCursor, plan_cursor_init, next_copy


from kvcopy._cuda import driver
from kvcopy._cuda.plan_arrays import bad_copy_error, empty_plan, length_error
from kvcopy.errors import CudaError

cdef extern from "batch_abi.h":
    ctypedef struct kvcopy_mem_location:
        int type
        int id
    ctypedef struct kvcopy_memcpy_attributes:
        int src_access_order
        kvcopy_mem_location src_loc_hint
        kvcopy_mem_location dst_loc_hint
        unsigned int flags
    ctypedef int (*kvcopy_batch_v12080_fn)(
        unsigned long long*, unsigned long long*, size_t*, size_t,
        kvcopy_memcpy_attributes*, size_t*, size_t, size_t*, void*) noexcept nogil
    ctypedef int (*kvcopy_batch_v13000_fn)(
        unsigned long long*, unsigned long long*, size_t*, size_t,
        kvcopy_memcpy_attributes*, size_t*, size_t, void*) noexcept nogil
    int KVCOPY_SRC_ACCESS_ORDER_STREAM
    int KVCOPY_SRC_ACCESS_ORDER_ANY
    int KVCOPY_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    int KVCOPY_BATCH_ABI_NONE
    int KVCOPY_BATCH_ABI_12080
    int KVCOPY_BATCH_ABI_13000

cdef extern from "host_maps.h":
    unsigned KVCOPY_MAP_READ
    unsigned KVCOPY_MAP_WRITE
    ctypedef struct kvcopy_maps:
        int available
    int kvcopy_maps_load(kvcopy_maps* maps) nogil
    void kvcopy_maps_free(kvcopy_maps* maps) nogil
    int kvcopy_maps_allow(const kvcopy_maps* maps, uint64_t ptr, uint64_t size, unsigned need) nogil

_STREAM_LEGACY = 1


cdef inline bint _same_allocation(const _Range* a, const _Range* b, uint64_t end) noexcept nogil:
    """May a copy that started in a continue into b up to end? Pageable memory
    has no allocations the driver knows of: any mapped bytes may be joined."""
    if a.kind & _KIND_PAGEABLE:
        return (b.kind & _KIND_PAGEABLE) != 0
    return a.start == b.start and a.end == b.end and end <= a.end


cdef inline int _maps_ready(kvcopy_maps* maps, bint* loaded) except -1 nogil:
    if not loaded[0]:
        if kvcopy_maps_load(maps) != 0:
            with gil:
                raise MemoryError("kvcopy: no memory to read /proc/self/maps")
        loaded[0] = True
    return 0


def plan_dma(const uint64_t[::1] src, const uint64_t[::1] dst, const uint64_t[::1] sizes,
             bint merge=True):
    """plan_arrays for the DMA paths: validates as plan_arrays does, and also

    - merges a copy into the one before only while both stay inside one
      allocation on each side (the driver rejects a copy that spans two
      allocations, even back-to-back ones);
    - checks every pointer the driver does not know (pageable memory) against
      this process's mappings, readable for a source and writable for a
      destination: the driver would dereference a bad one and kill the process.

    Returns ``(src, dst, sizes, origin)`` as plan_arrays does.

    Raises:
        ValueError: as plan_arrays, or a pageable pointer that is not mapped,
            naming the caller's index.
    """
    cdef Py_ssize_t n = src.shape[0], k = 0
    cdef PlanCursor cursor
    cdef _Classifier* sides
    cdef _Range* rs
    cdef _Range* rd
    cdef kvcopy_maps maps
    cdef bint maps_loaded = False
    cdef int bad_side = 0
    cdef Py_ssize_t bad_index = -1
    cdef uint64_t bad_ptr = 0, bad_size = 0
    # (set before their first read, at the first copy; zeroed so that the compiler
    # sees it too)
    cdef _Range cur_s_copy = _Range(0, 0, 0, 0, 0)
    cdef _Range cur_d_copy = _Range(0, 0, 0, 0, 0)
    if dst.shape[0] != n or sizes.shape[0] != n:
        raise length_error(n, dst.shape[0], sizes.shape[0])
    out_src, out_dst, out_sizes, origin = empty_plan(n)
    cdef uint64_t[::1] os = out_src, od = out_dst, oz = out_sizes
    cdef int64_t[::1] oo = origin
    if n == 0:
        return out_src, out_dst, out_sizes, origin
    sides = <_Classifier*>malloc(2 * sizeof(_Classifier))
    if sides == NULL:
        raise MemoryError()
    classifier_init(&sides[0], n)
    classifier_init(&sides[1], n)
    maps.available = 0
    plan_cursor_init(&cursor, n, False)
    try:
        with nogil:
            while next_copy(&cursor, &src[0], &dst[0], &sizes[0]):
                rs = locate(&sides[0], cursor.src, cursor.size)
                rd = locate(&sides[1], cursor.dst, cursor.size)
                if (rs.kind | rd.kind) & _KIND_PAGEABLE:
                    _maps_ready(&maps, &maps_loaded)
                    if (rs.kind & _KIND_PAGEABLE and not kvcopy_maps_allow(
                            &maps, cursor.src, cursor.size, KVCOPY_MAP_READ)):
                        bad_side, bad_ptr = 1, cursor.src
                    elif (rd.kind & _KIND_PAGEABLE and not kvcopy_maps_allow(
                            &maps, cursor.dst, cursor.size, KVCOPY_MAP_WRITE)):
                        bad_side, bad_ptr = 2, cursor.dst
                    if bad_side:
                        bad_index, bad_size = cursor.origin, cursor.size
                        break
                if (merge and k > 0 and cursor.src == os[k - 1] + oz[k - 1]
                        and cursor.dst == od[k - 1] + oz[k - 1]
                        and _same_allocation(&cur_s_copy, rs, cursor.src + cursor.size)
                        and _same_allocation(&cur_d_copy, rd, cursor.dst + cursor.size)):
                    oz[k - 1] += cursor.size
                    continue
                cur_s_copy = rs[0]
                cur_d_copy = rd[0]
                os[k] = cursor.src
                od[k] = cursor.dst
                oz[k] = cursor.size
                oo[k] = cursor.origin
                k += 1
    finally:
        if maps_loaded:
            kvcopy_maps_free(&maps)
        free(sides)
    if bad_side:
        name = "src_ptrs" if bad_side == 1 else "dst_ptrs"
        access = "readable" if bad_side == 1 else "writable"
        raise ValueError(
            f"{name}[{bad_index}] = {bad_ptr:#x}: {bad_size} bytes there are not {access} host "
            "memory of this process (neither device memory nor pinned memory the driver knows, "
            "and not mapped for that access)")
    if cursor.why:
        raise bad_copy_error(cursor.why, cursor.bad, sizes[cursor.bad])
    return out_src[:k], out_dst[:k], out_sizes[:k], origin[:k]


def first_host_span_denied(const uint64_t[::1] ptrs, const uint64_t[::1] sizes,
                           bint write=False) -> int:
    """The index of the first span [ptrs[i], ptrs[i] + sizes[i]) not mapped readable (and
    writable, with ``write``) in this process, or -1 where every one is; /proc/self/maps
    is read once for them all (every span passes where it cannot be read)."""
    cdef kvcopy_maps maps
    cdef Py_ssize_t i, n = ptrs.shape[0], found = -1
    cdef unsigned need = KVCOPY_MAP_READ | (KVCOPY_MAP_WRITE if write else 0)
    if sizes.shape[0] != n:
        raise ValueError(f"first_host_span_denied: {n} addresses but {sizes.shape[0]} sizes")
    if n == 0:
        return -1
    if kvcopy_maps_load(&maps) != 0:
        raise MemoryError()
    with nogil:
        for i in range(n):
            if not kvcopy_maps_allow(&maps, ptrs[i], sizes[i], need):
                found = i
                break
    kvcopy_maps_free(&maps)
    return found


# ---------------------------------------------------------------- batched DMA

cdef void* _batch_fn = NULL
cdef int _batch_abi = -1


def batch_abi() -> int:
    """ABI of the driver's cuMemcpyBatchAsync: 13000, 12080, or 0 when it has none."""
    global _batch_fn, _batch_abi
    if _batch_abi >= 0:
        return _batch_abi
    cdef int _driver_version = driver.driver_version()
    cdef int want
    cdef void* fn = NULL
    cdef cydriver.CUdriverProcAddressQueryResult found
    if _driver_version >= 13000:
        want = KVCOPY_BATCH_ABI_13000
    elif _driver_version >= 12080:
        want = KVCOPY_BATCH_ABI_12080
    else:
        _batch_abi = KVCOPY_BATCH_ABI_NONE
        return _batch_abi
    status = cydriver.cuGetProcAddress(b"cuMemcpyBatchAsync", &fn, want,
                                       cydriver.CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found)
    if status != cydriver.CUDA_SUCCESS or fn == NULL or found != cydriver.CU_GET_PROC_ADDRESS_SUCCESS:
        _batch_abi = KVCOPY_BATCH_ABI_NONE
    else:
        _batch_fn = fn
        _batch_abi = want
    return _batch_abi


def memcpy_batch(const uint64_t[::1] dst, const uint64_t[::1] src, const uint64_t[::1] sizes,
                 uintptr_t stream, bint access_any, Py_ssize_t chunk, *, int order=0,
                 int flags=-1, tuple hints=(0, 0, 0, 0)) -> None:
    """cuMemcpyBatchAsync over the batch, ``chunk`` descriptors per driver call.

    The stream must not be 0 or CU_STREAM_LEGACY (the driver rejects them) and
    must not be capturing (the driver drops the copy from the graph); the caller
    routes those cases elsewhere.

    ``order`` (a CUmemcpySrcAccessOrder; 0: ANY with ``access_any``, else
    STREAM), ``flags`` (CUmemcpyFlags; -1: prefer overlap with compute) and
    ``hints`` (source location type and id, destination location type and id;
    0: none) override the attributes of every copy, for probes of the driver.
    """
    cdef int abi = batch_abi()
    if abi == KVCOPY_BATCH_ABI_NONE:
        raise CudaError(cydriver.CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED",
                        f"this driver ({driver.driver_version()}) has no cuMemcpyBatchAsync", None)
    if stream == 0 or stream == _STREAM_LEGACY:
        raise ValueError("memcpy_batch: the legacy default stream cannot take cuMemcpyBatchAsync")
    cdef kvcopy_memcpy_attributes attr
    _batch_attributes(&attr, access_any, order, flags)
    attr.src_loc_hint.type, attr.src_loc_hint.id, attr.dst_loc_hint.type, attr.dst_loc_hint.id = hints
    if chunk <= 0:
        raise ValueError("memcpy_batch: chunk must be positive")
    if dst.shape[0]:
        with nogil:
            _batch_each(&dst[0], &src[0], &sizes[0], dst.shape[0], stream, &attr, chunk, abi)


cdef void _batch_attributes(kvcopy_memcpy_attributes* attr, bint access_any, int order,
                            int flags) noexcept nogil:
    """The attributes every copy of a batch takes (see memcpy_batch), no location hints."""
    memset(attr, 0, sizeof(kvcopy_memcpy_attributes))
    attr.src_access_order = (order if order else KVCOPY_SRC_ACCESS_ORDER_ANY if access_any
                             else KVCOPY_SRC_ACCESS_ORDER_STREAM)
    attr.flags = KVCOPY_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE if flags < 0 else <unsigned>flags


cdef int _batch_each(const uint64_t* dst, const uint64_t* src, const uint64_t* sizes,
                     Py_ssize_t n, uintptr_t stream, kvcopy_memcpy_attributes* attr,
                     Py_ssize_t chunk, int abi) except -1 nogil:
    """cuMemcpyBatchAsync of the n copies, ``chunk`` a call, by the driver's ``abi``; a
    failure raises CudaError carrying the failing copy's index where the driver says."""
    cdef Py_ssize_t start = 0, count
    cdef size_t attr_index = 0
    cdef size_t fail = <size_t>-1
    cdef int status = 0
    while start < n:
        count = chunk if n - start > chunk else n - start
        if abi == KVCOPY_BATCH_ABI_13000:
            status = (<kvcopy_batch_v13000_fn>_batch_fn)(
                <unsigned long long*>&dst[start], <unsigned long long*>&src[start],
                <size_t*>&sizes[start], <size_t>count, attr, &attr_index, 1, <void*>stream)
        else:
            fail = <size_t>-1
            status = (<kvcopy_batch_v12080_fn>_batch_fn)(
                <unsigned long long*>&dst[start], <unsigned long long*>&src[start],
                <size_t*>&sizes[start], <size_t>count, attr, &attr_index, 1, &fail, <void*>stream)
        if status != 0:
            check(<CUresult>status, <Py_ssize_t>(start + fail) if fail < <size_t>count else -1)
        start += count
    return 0


# ---------------------------------------------------------------- per-copy DMA

cdef int memcpy_each(const uint64_t* dst, const uint64_t* src, const uint64_t* sizes,
                     Py_ssize_t lo, Py_ssize_t hi, CUstream stream) except -1 nogil:
    """Copies [lo, hi) of the three arrays, one cuMemcpyAsync each, empty ones skipped
    (a driver call that moves nothing); a failure raises CudaError carrying the copy's
    index in the arrays."""
    cdef Py_ssize_t i
    for i in range(lo, hi):
        if sizes[i]:
            check(cydriver.cuMemcpyAsync(<CUdeviceptr>dst[i], <CUdeviceptr>src[i],
                                          <size_t>sizes[i], stream), i)
    return 0


def memcpy_loop(const uint64_t[::1] dst, const uint64_t[::1] src, const uint64_t[::1] sizes,
                uintptr_t stream) -> None:
    """One cuMemcpyAsync per copy: works on every stream, in capture, on any driver."""
    cdef Py_ssize_t n = dst.shape[0]
    if n == 0:
        return
    with nogil:
        memcpy_each(&dst[0], &src[0], &sizes[0], 0, n, <CUstream>stream)


# ---------------------------------------------------------------- one block copy again

cdef inline bint _int64_format(const char* fmt) noexcept:
    """Whether a buffer's struct format is one signed 64-bit integer ('q' or 'l' on
    LP64, with an optional byte-order prefix of native or little order)."""
    if fmt == NULL:
        return False
    if fmt[0] == b'<' or fmt[0] == b'=' or fmt[0] == b'@':
        fmt += 1
    return (fmt[0] == b'q' or fmt[0] == b'l') and fmt[1] == 0


cdef class BlockCopyAgain:
    """A swap_blocks call of one block pair over one tensor a side, issued again from its
    ids in one call: the ids checked against each side's block count, the block's
    addresses worked out from the kept tensor table, the copy issued on ``stream``
    (cuMemcpyBatchAsync of one copy with ``batch``, else cuMemcpyAsync).

    The caller keeps the contract that makes skipping the rest safe: the tensors are
    those the table was read from, unchanged, their memory reached by the device, the
    two sides apart (no pair of them can race), the stream's context current and not
    capturing (driver.enter_for_repeat)."""

    cdef uint64_t src_base, dst_base, src_stride, dst_stride, src_factor, dst_factor
    cdef uint64_t block_bytes
    cdef int64_t src_limit, dst_limit
    cdef uintptr_t stream
    cdef int abi  # (cuMemcpyBatchAsync's; 0: cuMemcpyAsync)
    cdef kvcopy_memcpy_attributes attr

    def __init__(self, const uint64_t[:, ::1] table, uint64_t block_bytes, int64_t src_limit,
                 int64_t dst_limit, uintptr_t stream, bint batch=False, bint access_any=False):
        """``table``: one row of BlockPlan.tensor_table (src base, dst base, src stride,
        dst stride, src factor, dst factor); ``src_limit`` and ``dst_limit``: each side's
        ids (BlockGeometry.id_limits)."""
        if table.shape[0] != 1 or table.shape[1] != 6:
            raise ValueError("BlockCopyAgain: one tensor row of six columns")
        if table[0, 4] == 0 or table[0, 5] == 0 or block_bytes == 0:
            raise ValueError("BlockCopyAgain: factors and block_bytes must be positive")
        if batch and stream in (0, _STREAM_LEGACY):
            raise ValueError("BlockCopyAgain: the legacy default stream cannot take cuMemcpyBatchAsync")
        self.abi = batch_abi() if batch else KVCOPY_BATCH_ABI_NONE
        if batch and self.abi == KVCOPY_BATCH_ABI_NONE:
            raise ValueError("BlockCopyAgain: this driver has no cuMemcpyBatchAsync")
        self.src_base, self.dst_base = table[0, 0], table[0, 1]
        self.src_stride, self.dst_stride = table[0, 2], table[0, 3]
        self.src_factor, self.dst_factor = table[0, 4], table[0, 5]
        self.block_bytes, self.src_limit, self.dst_limit = block_bytes, src_limit, dst_limit
        self.stream = stream
        _batch_attributes(&self.attr, access_any, 0, -1)

    cdef bint _copy_of(self, object mapping, uint64_t* src, uint64_t* dst) except -1:
        """The block copy of ``mapping`` into src and dst; False where ``mapping`` is not
        one pair of int64 ids inside their sides."""
        cdef Py_buffer view
        cdef int64_t s, d
        try:
            PyObject_GetBuffer(mapping, &view, PyBUF_RECORDS_RO)
        except (TypeError, ValueError, BufferError):  # (not a buffer of numbers)
            return False
        try:
            if (view.ndim != 2 or view.shape[0] != 1 or view.shape[1] != 2 or view.itemsize != 8
                    or not _int64_format(view.format)):
                return False
            s = (<int64_t*>view.buf)[0]
            d = (<int64_t*>(<char*>view.buf + view.strides[1]))[0]
        finally:
            PyBuffer_Release(&view)
        if s < 0 or s >= self.src_limit or d < 0 or d >= self.dst_limit:
            return False
        src[0] = (self.src_base + (<uint64_t>s // self.src_factor) * self.src_stride
                  + (<uint64_t>s % self.src_factor) * self.block_bytes)
        dst[0] = (self.dst_base + (<uint64_t>d // self.dst_factor) * self.dst_stride
                  + (<uint64_t>d % self.dst_factor) * self.block_bytes)
        return True

    def addresses(self, object mapping) -> tuple | None:
        """(source address, destination address) of the copy a call with ``mapping``
        issues, or None where it issues none."""
        cdef uint64_t src = 0, dst = 0
        return (src, dst) if self._copy_of(mapping, &src, &dst) else None

    def __call__(self, object mapping) -> bool:
        """Copy block ``mapping[0, 0]`` of the source to block ``mapping[0, 1]`` of the
        destination (``mapping``: a (1, 2) int64 array or other buffer). Returns True
        once issued; False, having issued nothing, where ``mapping`` is not one pair or
        an id is outside its side (the whole call then says what is wrong).

        Raises:
            CudaError: the driver refused the copy (index 0).
        """
        cdef uint64_t src = 0, dst = 0, size = self.block_bytes
        if not self._copy_of(mapping, &src, &dst):
            return False
        with nogil:
            if self.abi != KVCOPY_BATCH_ABI_NONE:
                _batch_each(&dst, &src, &size, 1, self.stream, &self.attr, 1, self.abi)
            else:
                memcpy_each(&dst, &src, &size, 0, 1, <CUstream>self.stream)
        return True
