# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""The only module of kvcopy that talks to the CUDA driver.

Everything here is a thin, GIL-free wrapper over cuda-python's ``cydriver``
declarations, using integer handles at the Python boundary. Every CUresult goes
through :func:`_check`, which takes the GIL only on failure and raises
:class:`kvcopy.errors.CudaError` with the error's name and, where known, the
index of the failing copy.

Only driver functions whose signatures are identical in cuda-bindings 12.9 and
13.x are cimported: Cython verifies a cimported function's signature at import,
so anything else would pin the build to one bindings major.
cuMemcpyBatchAsync, whose ABI differs between 12.8 and 13.0, is resolved with
cuGetProcAddress by the running driver's version and called through kvcopy's
own typedefs (include/kvcopy/batch_abi.h).
"""

from libc.stdint cimport uint64_t, uintptr_t, int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset, memcpy

from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport (
    CUresult, CUdeviceptr, CUstream, CUcontext, CUdevice, CUfunction, CUmodule,
    CUevent, CUpointer_attribute, CUstreamCaptureStatus, CUdevice_attribute,
)

from kvcopy._planning cimport (PlanCursor, plan_cursor_init, next_copy, copy_problem,
                               COPY_OK)

from kvcopy.errors import CudaError, NoDriverError
from kvcopy._plan import bad_copy_error, length_error
import numpy as np

cdef extern from "kvcopy/batch_abi.h":
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

cdef extern from "kvcopy/descriptor.h":
    unsigned long long KVCOPY_TILE_BYTES
    int KVCOPY_INLINE_MAX
    int KVCOPY_INLINE_MAX_SMALL
    ctypedef struct kvcopy_desc:
        unsigned long long src
        unsigned long long dst
        unsigned long long size
        unsigned long long tile_start
    ctypedef struct kvcopy_block_tensor:
        unsigned long long src_base
        unsigned long long dst_base
        unsigned long long src_stride
        unsigned long long dst_stride
        unsigned long long src_factor
        unsigned long long dst_factor
    ctypedef struct kvcopy_inline_batch:
        unsigned long long count
        unsigned long long total_tiles
        kvcopy_desc descs[1000]

cdef extern from "kvcopy/host_maps.h":
    unsigned KVCOPY_MAP_READ
    unsigned KVCOPY_MAP_WRITE
    ctypedef struct kvcopy_maps:
        int available
    int kvcopy_maps_load(kvcopy_maps* maps) nogil
    void kvcopy_maps_free(kvcopy_maps* maps) nogil
    int kvcopy_maps_allow(const kvcopy_maps* maps, uint64_t ptr, uint64_t size, unsigned need) nogil

cdef extern from "kvcopy/describe_fast.h":
    int kvcopy_fast_describe_available() nogil
    unsigned KVCOPY_FAST_MISFIT
    unsigned KVCOPY_FAST_MERGES
    unsigned kvcopy_describe_in_ranges(const uint64_t* src, const uint64_t* dst,
                                       const uint64_t* sizes, void* descs_out, int64_t n,
                                       uint64_t src_start, uint64_t src_span, int64_t src_delta,
                                       uint64_t dst_start, uint64_t dst_span, int64_t dst_delta,
                                       uint64_t* total_out) nogil

# Classification bits returned by classify_pointers.
cdef enum:
    _KIND_DEVICE = 1          # device memory of one device, not managed
    _KIND_HOST_MAPPED = 2     # pinned host memory the current context's device can dereference
    _KIND_HOST_UNMAPPED = 4   # pageable host memory, or pinned but not mapped: DMA only
    _KIND_MANAGED = 8         # managed (unified) memory: DMA only
    _KIND_STRADDLE = 16       # a copy runs past the end of its allocation: DMA decides
    _KIND_PAGEABLE = 32       # memory the driver does not know (always with _KIND_HOST_UNMAPPED)

KIND_DEVICE = _KIND_DEVICE
KIND_HOST_MAPPED = _KIND_HOST_MAPPED
KIND_HOST_UNMAPPED = _KIND_HOST_UNMAPPED
KIND_MANAGED = _KIND_MANAGED
KIND_STRADDLE = _KIND_STRADDLE
KIND_PAGEABLE = _KIND_PAGEABLE

TILE_BYTES = KVCOPY_TILE_BYTES
INLINE_MAX = KVCOPY_INLINE_MAX
INLINE_MAX_SMALL = KVCOPY_INLINE_MAX_SMALL
STREAM_LEGACY = 1
STREAM_PER_THREAD = 2


# ---------------------------------------------------------------- errors

cdef int _raise_cuda_error(CUresult status, Py_ssize_t index) except -1 with gil:
    cdef const char* name = NULL
    cdef const char* text = NULL
    try:
        cydriver.cuGetErrorName(status, &name)
        cydriver.cuGetErrorString(status, &text)
    except Exception:
        pass
    py_name = name.decode() if name != NULL else f"CUresult({<int>status})"
    py_text = text.decode() if text != NULL else "unknown CUDA error"
    raise CudaError(<int>status, py_name, py_text, None if index < 0 else index)


cdef inline int _check(CUresult status, Py_ssize_t index=-1) except -1 nogil:
    if status != cydriver.CUDA_SUCCESS:
        _raise_cuda_error(status, index)
    return 0


def error_name(int status) -> str:
    """The driver's name for a CUresult value, e.g. ``CUDA_ERROR_INVALID_VALUE``."""
    cdef const char* name = NULL
    if cydriver.cuGetErrorName(<CUresult>status, &name) != cydriver.CUDA_SUCCESS or name == NULL:
        return f"CUresult({status})"
    return name.decode()


# ---------------------------------------------------------------- init

cdef bint _initialized = False
cdef int _driver_version = 0


def init() -> None:
    """Initialise the driver once; raise NoDriverError when libcuda is absent."""
    global _initialized, _driver_version
    if _initialized:
        return
    cdef CUresult status
    cdef int version = 0
    try:
        with nogil:
            status = cydriver.cuInit(0)
    except CudaError:
        raise
    except Exception as exc:  # cydriver raises when libcuda cannot be loaded
        raise NoDriverError(
            "no CUDA driver was found: libcuda could not be loaded "
            f"({type(exc).__name__}: {exc}). kvcopy needs an NVIDIA GPU and its driver."
        ) from exc
    _check(status)
    _check(cydriver.cuDriverGetVersion(&version))
    _driver_version = version
    _initialized = True


def driver_version() -> int:
    """The driver's CUDA version as an integer (13000 for 13.0)."""
    init()
    return _driver_version


# ---------------------------------------------------------------- devices and contexts

def device_count() -> int:
    init()
    cdef int count = 0
    _check(cydriver.cuDeviceGetCount(&count))
    return count


def device_attributes(int ordinal) -> dict:
    """The device facts kvcopy's policy needs, as a plain dict."""
    init()
    cdef CUdevice dev
    cdef char name[256]
    cdef int value = 0
    _check(cydriver.cuDeviceGet(&dev, ordinal))
    _check(cydriver.cuDeviceGetName(name, 256, dev))
    wanted = {
        "sm_count": cydriver.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        "cc_major": cydriver.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        "cc_minor": cydriver.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        "unified_addressing": cydriver.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
        "can_map_host_memory": cydriver.CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY,
        "host_pointer_for_registered_mem": cydriver.CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
        "host_register_supported": cydriver.CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED,
    }
    out = {"ordinal": ordinal, "name": name.decode(errors="replace"),
           "driver_version": _driver_version}
    for key, attr in wanted.items():
        _check(cydriver.cuDeviceGetAttribute(&value, <CUdevice_attribute>attr, dev))
        out[key] = int(value)
    return out


def current_context() -> int:
    """The calling thread's current context handle, 0 when there is none."""
    init()
    cdef CUcontext ctx = NULL
    _check(cydriver.cuCtxGetCurrent(&ctx))
    return <uintptr_t>ctx


def context_device() -> int:
    """Ordinal of the current context's device."""
    cdef CUdevice dev
    _check(cydriver.cuCtxGetDevice(&dev))
    return <int>dev


def primary_context(int ordinal) -> int:
    """Retain (once per process, never released) and return a device's primary context."""
    init()
    cdef CUdevice dev
    cdef CUcontext ctx = NULL
    _check(cydriver.cuDeviceGet(&dev, ordinal))
    _check(cydriver.cuDevicePrimaryCtxRetain(&ctx, dev))
    return <uintptr_t>ctx


def push_context(uintptr_t ctx) -> None:
    _check(cydriver.cuCtxPushCurrent(<CUcontext>ctx))


def pop_context() -> None:
    cdef CUcontext ctx = NULL
    _check(cydriver.cuCtxPopCurrent(&ctx))


def stream_context(uintptr_t stream) -> int:
    """Context that a created stream belongs to."""
    cdef CUcontext ctx = NULL
    _check(cydriver.cuStreamGetCtx(<CUstream>stream, &ctx))
    return <uintptr_t>ctx


def stream_capture_status(uintptr_t stream) -> int:
    """0: not capturing, 1: capturing, 2: capture invalidated."""
    cdef CUstreamCaptureStatus status
    _check(cydriver.cuStreamIsCapturing(<CUstream>stream, &status))
    if status == cydriver.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        return 1
    if status == cydriver.CU_STREAM_CAPTURE_STATUS_INVALIDATED:
        return 2
    return 0


def stream_create(bint non_blocking=True) -> int:
    cdef CUstream stream = NULL
    _check(cydriver.cuStreamCreate(&stream, cydriver.CU_STREAM_NON_BLOCKING if non_blocking else 0))
    return <uintptr_t>stream


def stream_destroy(uintptr_t stream) -> None:
    _check(cydriver.cuStreamDestroy(<CUstream>stream))


def stream_synchronize(uintptr_t stream) -> None:
    with nogil:
        _check(cydriver.cuStreamSynchronize(<CUstream>stream))


def stream_wait_event(uintptr_t stream, uintptr_t event) -> None:
    _check(cydriver.cuStreamWaitEvent(<CUstream>stream, <CUevent>event, 0))


def stream_wait_stream(uintptr_t consumer, uintptr_t producer) -> None:
    """Make ``consumer`` wait (on the GPU) for the work queued on ``producer`` so far.

    The event is recorded and waited for in the calling thread's current context,
    then destroyed (the driver keeps it alive until the wait has resolved)."""
    cdef CUevent event = NULL
    if consumer == producer:
        return
    _check(cydriver.cuEventCreate(&event, cydriver.CU_EVENT_DISABLE_TIMING))
    try:
        _check(cydriver.cuEventRecord(event, <CUstream>producer))
        _check(cydriver.cuStreamWaitEvent(<CUstream>consumer, event, 0))
    finally:
        cydriver.cuEventDestroy(event)


def event_create(bint timing=False) -> int:
    cdef CUevent event = NULL
    _check(cydriver.cuEventCreate(&event, 0 if timing else cydriver.CU_EVENT_DISABLE_TIMING))
    return <uintptr_t>event


def event_record(uintptr_t event, uintptr_t stream) -> None:
    _check(cydriver.cuEventRecord(<CUevent>event, <CUstream>stream))


def event_query(uintptr_t event) -> bool:
    """True when the event has completed, False while it is pending."""
    cdef CUresult status = cydriver.cuEventQuery(<CUevent>event)
    if status == cydriver.CUDA_ERROR_NOT_READY:
        return False
    _check(status)
    return True


def event_synchronize(uintptr_t event) -> None:
    with nogil:
        _check(cydriver.cuEventSynchronize(<CUevent>event))


def event_elapsed_ms(uintptr_t start, uintptr_t end) -> float:
    cdef float ms = 0
    _check(cydriver.cuEventElapsedTime(&ms, <CUevent>start, <CUevent>end))
    return ms


def event_destroy(uintptr_t event) -> None:
    _check(cydriver.cuEventDestroy(<CUevent>event))


# ---------------------------------------------------------------- memory

def mem_alloc(size_t nbytes) -> int:
    """Device memory in the current context (scratch for calibration and benchmarks)."""
    cdef CUdeviceptr ptr = 0
    _check(cydriver.cuMemAlloc(&ptr, nbytes))
    return ptr


def mem_free(uintptr_t ptr) -> None:
    _check(cydriver.cuMemFree(<CUdeviceptr>ptr))


def memset_d8_async(uintptr_t ptr, unsigned char value, size_t nbytes, uintptr_t stream) -> None:
    _check(cydriver.cuMemsetD8Async(<CUdeviceptr>ptr, value, nbytes, <CUstream>stream))


def host_alloc(size_t nbytes) -> int:
    """Pinned host memory, portable and mapped into every device's address space."""
    init()
    cdef void* ptr = NULL
    with nogil:
        _check(cydriver.cuMemHostAlloc(&ptr, nbytes,
                                       cydriver.CU_MEMHOSTALLOC_PORTABLE | cydriver.CU_MEMHOSTALLOC_DEVICEMAP))
    return <uintptr_t>ptr


def host_free(uintptr_t ptr) -> None:
    with nogil:
        _check(cydriver.cuMemFreeHost(<void*>ptr))


def host_register(uintptr_t ptr, size_t nbytes, bint read_only=False) -> None:
    """Page-lock and map existing host memory (portable, device-mapped)."""
    init()
    cdef unsigned int flags = cydriver.CU_MEMHOSTREGISTER_PORTABLE | cydriver.CU_MEMHOSTREGISTER_DEVICEMAP
    if read_only:
        flags |= cydriver.CU_MEMHOSTREGISTER_READ_ONLY
    with nogil:
        _check(cydriver.cuMemHostRegister(<void*>ptr, nbytes, flags))


def host_unregister(uintptr_t ptr) -> None:
    with nogil:
        _check(cydriver.cuMemHostUnregister(<void*>ptr))


def host_device_pointer(uintptr_t ptr) -> int:
    """The address at which the current context's device sees pinned host memory."""
    cdef CUdeviceptr dptr = 0
    _check(cydriver.cuMemHostGetDevicePointer(&dptr, <void*>ptr, 0))
    return dptr


# ---------------------------------------------------------------- pointer classification

cdef struct _Range:
    uint64_t start
    uint64_t end
    int kind
    int ordinal
    int64_t delta    # device view = host pointer + delta


cdef enum:
    _RANGE_CACHE = 64


cdef int _query_range(uint64_t ptr, uint64_t size, _Range* out) noexcept nogil:
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
        out.kind = _KIND_DEVICE
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


cdef bint _extend_range(_Range* r, uint64_t end) noexcept nogil:
    """Grow r over the ranges that follow it while they are the same kind of memory,
    seen by the device at the same offset: memory registered in chunks, or
    back-to-back device allocations, is one range for the kernel."""
    cdef _Range nxt
    if r.kind != _KIND_DEVICE and r.kind != _KIND_HOST_MAPPED:
        return False
    while end > r.end:
        _query_range(r.end, end - r.end, &nxt)
        if (nxt.kind != r.kind or nxt.start != r.end or nxt.end <= r.end
                or nxt.delta != r.delta or nxt.ordinal != r.ordinal):
            return False
        r.end = nxt.end
    return True


cdef struct _Classifier:
    # Driver answers kept as address ranges, for one call only: the driver is
    # asked once per allocation, not once per pointer.
    _Range cache[_RANGE_CACHE]
    int cached
    int last
    int kinds        # OR of _KIND_* over every pointer seen
    int ordinal      # device of the device memory seen (-1: none, -2: several)


cdef inline void _classifier_init(_Classifier* c) noexcept nogil:
    c.cached = 0
    c.last = 0
    c.kinds = 0
    c.ordinal = -1
    c.cache[0].start = 1   # an empty range: the first lookup goes the slow way
    c.cache[0].end = 0


cdef int _classifier_seed(_Classifier* c, const int64_t[:, ::1] ranges) except -1:
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
    return 0


cdef uint64_t _classify_slow(_Classifier* c, uint64_t p, uint64_t size) noexcept nogil:
    """_classify for a copy outside the last range used: look it up, or ask the driver."""
    cdef int hit = -1, j
    cdef _Range* r
    for j in range(c.cached):
        if c.cache[j].start <= p < c.cache[j].end:
            hit = j
            break
    if hit < 0:
        hit = c.cached if c.cached < _RANGE_CACHE else _RANGE_CACHE - 1
        _query_range(p, size, &c.cache[hit])
        if c.cached < _RANGE_CACHE:
            c.cached += 1
    c.last = hit
    r = &c.cache[hit]
    c.kinds |= r.kind
    if p + size > r.end and not _extend_range(r, p + size):
        c.kinds |= _KIND_STRADDLE
    if r.kind == _KIND_DEVICE:
        if c.ordinal == -1:
            c.ordinal = r.ordinal
        elif c.ordinal != r.ordinal:
            c.ordinal = -2
    return <uint64_t>(<int64_t>p + r.delta)


cdef inline uint64_t _classify(_Classifier* c, uint64_t p, uint64_t size) noexcept nogil:
    """Classify the copy [p, p + size) and return the address the device uses for p.

    Batches mostly stay in one allocation per side: a copy inside the last
    range used needs two comparisons (its kind and device were recorded when
    that range was first used)."""
    cdef _Range* r = &c.cache[c.last]
    if r.start <= p and p + size <= r.end:
        return <uint64_t>(<int64_t>p + r.delta)
    return _classify_slow(c, p, size)


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
    _classifier_init(c)
    with nogil:
        for i in range(n):
            device_view[i] = _classify(c, ptrs[i], sizes[i])
    kinds, ordinal = c.kinds, c.ordinal
    free(c)
    return kinds, ordinal


# ---------------------------------------------------------------- DMA planning

cdef _Range* _locate(_Classifier* c, uint64_t p, uint64_t size) noexcept nogil:
    """The driver's range (one allocation, never joined with its neighbours) that
    holds p: the DMA engines refuse a copy that leaves its allocation, so DMA
    copies are merged only inside one."""
    cdef int j, hit = -1
    cdef _Range* r = &c.cache[c.last]
    if r.start <= p < r.end:
        return r
    for j in range(c.cached):
        if c.cache[j].start <= p < c.cache[j].end:
            hit = j
            break
    if hit < 0:
        hit = c.cached if c.cached < _RANGE_CACHE else _RANGE_CACHE - 1
        _query_range(p, size, &c.cache[hit])
        if c.cached < _RANGE_CACHE:
            c.cached += 1
    c.last = hit
    return &c.cache[hit]


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
    cdef _Range* cur_s = NULL
    cdef _Range* cur_d = NULL
    cdef kvcopy_maps maps
    cdef bint maps_loaded = False
    cdef int bad_side = 0
    cdef Py_ssize_t bad_index = -1
    cdef uint64_t bad_ptr = 0, bad_size = 0
    cdef _Range cur_s_copy, cur_d_copy
    if dst.shape[0] != n or sizes.shape[0] != n:
        raise length_error(n, dst.shape[0], sizes.shape[0])
    out_src = np.empty(n, dtype=np.uint64)
    out_dst = np.empty(n, dtype=np.uint64)
    out_sizes = np.empty(n, dtype=np.uint64)
    origin = np.empty(n, dtype=np.int64)
    cdef uint64_t[::1] os = out_src, od = out_dst, oz = out_sizes
    cdef int64_t[::1] oo = origin
    if n == 0:
        return out_src, out_dst, out_sizes, origin
    sides = <_Classifier*>malloc(2 * sizeof(_Classifier))
    if sides == NULL:
        raise MemoryError()
    _classifier_init(&sides[0])
    _classifier_init(&sides[1])
    maps.available = 0
    plan_cursor_init(&cursor, n, False)
    try:
        with nogil:
            while next_copy(&cursor, &src[0], &dst[0], &sizes[0]):
                rs = _locate(&sides[0], cursor.src, cursor.size)
                rd = _locate(&sides[1], cursor.dst, cursor.size)
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


def host_access_allowed(uint64_t ptr, uint64_t size, bint write=False) -> bool:
    """Whether [ptr, ptr + size) is mapped readable (and writable, with ``write``)
    in this process, by /proc/self/maps (True where that cannot be read)."""
    cdef kvcopy_maps maps
    cdef int allowed
    if kvcopy_maps_load(&maps) != 0:
        raise MemoryError()
    allowed = kvcopy_maps_allow(&maps, ptr, size,
                                KVCOPY_MAP_READ | (KVCOPY_MAP_WRITE if write else 0))
    kvcopy_maps_free(&maps)
    return bool(allowed)


cdef inline void _describe_one(kvcopy_desc* d, _Classifier* sides, uint64_t a, uint64_t b,
                               uint64_t size, unsigned long long* tiles) noexcept nogil:
    d.src = _classify(&sides[0], a, size)
    d.dst = _classify(&sides[1], b, size)
    d.size = size
    d.tile_start = tiles[0]
    tiles[0] += (size + KVCOPY_TILE_BYTES - 1) // KVCOPY_TILE_BYTES


cdef bint _fast_describe = kvcopy_fast_describe_available()


cdef bint _describe_fast(const uint64_t* src, const uint64_t* dst, const uint64_t* sizes,
                         Py_ssize_t n, kvcopy_desc* descs, _Classifier* sides, bint merge,
                         unsigned long long* total) noexcept nogil:
    """The common batch in one branch-free pass (describe_fast.h): True when it
    applied, with exactly what the general loop would have written."""
    cdef _Range* rs
    cdef _Range* rd
    cdef uint64_t nbytes = 0
    cdef unsigned misfit
    if not _fast_describe or sizes[0] == 0 or sizes[0] > KVCOPY_TILE_BYTES:
        return False
    if copy_problem(src[0], dst[0], sizes[0]) != COPY_OK:
        return False
    # the first copy picks the range each side is checked against
    _classify(&sides[0], src[0], sizes[0])
    _classify(&sides[1], dst[0], sizes[0])
    if (sides[0].kinds | sides[1].kinds) & _KIND_STRADDLE:
        return False
    rs = &sides[0].cache[sides[0].last]
    rd = &sides[1].cache[sides[1].last]
    misfit = kvcopy_describe_in_ranges(src, dst, sizes, descs, n, rs.start, rs.end - rs.start,
                                       rs.delta, rd.start, rd.end - rd.start, rd.delta, &nbytes)
    if misfit & KVCOPY_FAST_MISFIT or (merge and misfit & KVCOPY_FAST_MERGES):
        return False
    total[0] = nbytes
    return True


cdef tuple _describe(const uint64_t[::1] src, const uint64_t[::1] dst, const uint64_t[::1] sizes,
                     uintptr_t descs_out, bint merge, _Classifier* sides, bint* fast):
    """describe_copies over the given classifiers; *fast in: may the vectorised pass
    run, out: did it apply."""
    cdef Py_ssize_t n = sizes.shape[0], k = 0
    cdef kvcopy_desc* descs = <kvcopy_desc*>descs_out
    cdef unsigned long long tiles = 0, total = 0
    cdef PlanCursor cursor
    if src.shape[0] != n or dst.shape[0] != n:
        raise length_error(src.shape[0], dst.shape[0], n)
    if n == 0:
        return 0, 0, 0, -1, 0, -1, 0
    if descs == NULL:
        raise ValueError("describe_copies: no descriptor buffer")
    plan_cursor_init(&cursor, n, merge)
    with nogil:
        fast[0] = fast[0] and _describe_fast(&src[0], &dst[0], &sizes[0], n, descs, sides, merge,
                                             &total)
        if fast[0]:
            k = tiles = n
        else:
            total = 0
            while next_copy(&cursor, &src[0], &dst[0], &sizes[0]):
                _describe_one(&descs[k], sides, cursor.src, cursor.dst, cursor.size, &tiles)
                total += cursor.size
                k += 1
    if cursor.why:
        raise bad_copy_error(cursor.why, cursor.bad, sizes[cursor.bad])
    return k, total, sides[0].kinds, sides[0].ordinal, sides[1].kinds, sides[1].ordinal, tiles


def describe_copies(const uint64_t[::1] src, const uint64_t[::1] dst, const uint64_t[::1] sizes,
                    uintptr_t descs_out, bint merge=True):
    """Plan, classify and describe a batch in one pass over it.

    Validates every copy as _plan.plan_arrays does (same checks, same
    messages), drops zero-size copies, merges a copy that continues the
    previous one on both sides (with ``merge``), classifies both sides and
    writes one kvcopy_desc per planned copy into ``descs_out`` (room for
    ``len(sizes)`` entries): the device's view of both pointers, the size and
    the first tile. Nothing is enqueued. A batch inside one allocation per
    side, of one-tile copies that need no merging, takes a vectorised pass.

    Returns ``(count, total_bytes, src_kinds, src_ordinal, dst_kinds,
    dst_ordinal, total_tiles)``; kinds and ordinals as for classify_pointers.

    Raises:
        ValueError: as plan_arrays, naming the caller's index.
    """
    cdef _Classifier* sides = <_Classifier*>malloc(2 * sizeof(_Classifier))
    cdef bint fast = True
    if sides == NULL:
        raise MemoryError()
    _classifier_init(&sides[0])
    _classifier_init(&sides[1])
    try:
        return _describe(src, dst, sizes, descs_out, merge, sides, &fast)
    finally:
        free(sides)


def describe_copies_in(const int64_t[:, ::1] known_ranges, const uint64_t[::1] src,
                       const uint64_t[::1] dst, const uint64_t[::1] sizes, uintptr_t descs_out,
                       bint merge=True, bint fast=True):
    """describe_copies with memory ranges known in advance, for tests and for timing
    the pass itself: rows of (start, end, kind, ordinal, delta), as the driver's
    answers would be; pointers outside them are still asked of the driver.
    ``fast=False`` keeps to the general loop. Returns describe_copies' tuple
    and whether the vectorised pass applied."""
    cdef _Classifier* sides = <_Classifier*>malloc(2 * sizeof(_Classifier))
    cdef bint used = fast
    if sides == NULL:
        raise MemoryError()
    try:
        _classifier_init(&sides[0])
        _classifier_init(&sides[1])
        _classifier_seed(&sides[0], known_ranges)
        _classifier_seed(&sides[1], known_ranges)
        return _describe(src, dst, sizes, descs_out, merge, sides, &used), used
    finally:
        free(sides)


def fast_describe_available() -> bool:
    """Whether this CPU runs the vectorised describe pass (AVX2 on x86-64)."""
    return _fast_describe


# ---------------------------------------------------------------- batched DMA

cdef void* _batch_fn = NULL
cdef int _batch_abi = -1
cdef bint _batch_disabled = False


def set_batch_disabled(bint disabled) -> None:
    """Pretend the driver has no cuMemcpyBatchAsync (tests of the old-driver path)."""
    global _batch_disabled
    _batch_disabled = disabled


def batch_abi() -> int:
    """ABI of the driver's cuMemcpyBatchAsync: 13000, 12080, or 0 when it has none."""
    global _batch_fn, _batch_abi
    if _batch_disabled:
        return KVCOPY_BATCH_ABI_NONE
    if _batch_abi >= 0:
        return _batch_abi
    init()
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
                 uintptr_t stream, bint access_any, Py_ssize_t chunk) -> None:
    """cuMemcpyBatchAsync over the batch, ``chunk`` descriptors per driver call.

    The stream must not be 0 or CU_STREAM_LEGACY (the driver rejects them) and
    must not be capturing (the driver drops the copy from the graph); the caller
    routes those cases elsewhere.
    """
    cdef int abi = batch_abi()
    if abi == KVCOPY_BATCH_ABI_NONE:
        raise CudaError(cydriver.CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED",
                        f"this driver ({_driver_version}) has no cuMemcpyBatchAsync", None)
    if stream == 0 or stream == STREAM_LEGACY:
        raise ValueError("memcpy_batch: the legacy default stream cannot take cuMemcpyBatchAsync")
    cdef Py_ssize_t n = dst.shape[0], start, count
    cdef kvcopy_memcpy_attributes attr
    cdef size_t attr_index = 0
    cdef size_t fail = <size_t>-1
    cdef int status = 0
    memset(&attr, 0, sizeof(attr))
    attr.src_access_order = KVCOPY_SRC_ACCESS_ORDER_ANY if access_any else KVCOPY_SRC_ACCESS_ORDER_STREAM
    attr.flags = KVCOPY_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    if chunk <= 0:
        raise ValueError("memcpy_batch: chunk must be positive")
    with nogil:
        start = 0
        while start < n:
            count = chunk if n - start > chunk else n - start
            if abi == KVCOPY_BATCH_ABI_13000:
                status = (<kvcopy_batch_v13000_fn>_batch_fn)(
                    <unsigned long long*>&dst[start], <unsigned long long*>&src[start],
                    <size_t*>&sizes[start], <size_t>count, &attr, &attr_index, 1, <void*>stream)
            else:
                fail = <size_t>-1
                status = (<kvcopy_batch_v12080_fn>_batch_fn)(
                    <unsigned long long*>&dst[start], <unsigned long long*>&src[start],
                    <size_t*>&sizes[start], <size_t>count, &attr, &attr_index, 1, &fail, <void*>stream)
            if status != 0:
                _check(<CUresult>status, <Py_ssize_t>(start + fail) if fail < <size_t>count else -1)
            start += count


# ---------------------------------------------------------------- per-copy DMA

def memcpy_loop(const uint64_t[::1] dst, const uint64_t[::1] src, const uint64_t[::1] sizes,
                uintptr_t stream) -> None:
    """One cuMemcpyAsync per copy: works on every stream, in capture, on any driver."""
    cdef Py_ssize_t n = dst.shape[0], i
    with nogil:
        for i in range(n):
            _check(cydriver.cuMemcpyAsync(<CUdeviceptr>dst[i], <CUdeviceptr>src[i],
                                          <size_t>sizes[i], <CUstream>stream), i)


# ---------------------------------------------------------------- copy kernel

def module_load(bytes image) -> int:
    """Load a cubin into the current context."""
    cdef CUmodule module = NULL
    cdef const char* data = image
    _check(cydriver.cuModuleLoadData(&module, <const void*>data))
    return <uintptr_t>module


def module_function(uintptr_t module, bytes name) -> int:
    cdef CUfunction function = NULL
    _check(cydriver.cuModuleGetFunction(&function, <CUmodule>module, name))
    return <uintptr_t>function


cdef unsigned int _grid(unsigned long long tiles, unsigned int threads,
                        unsigned int max_ctas) noexcept nogil:
    """CTAs for ``tiles`` warp-sized units of work: one warp per tile, at most max_ctas."""
    cdef unsigned long long grid = (tiles + threads // 32 - 1) // (threads // 32)
    return <unsigned int>(max_ctas if grid > max_ctas else grid)


cdef int _check_launch_shape(unsigned int max_ctas, unsigned int threads) except -1:
    if max_ctas == 0 or threads == 0 or threads % 32 != 0:
        raise ValueError("max_ctas must be positive and threads a positive multiple of 32")
    return 0


def launch_descs_inline(uintptr_t function, int per_launch, uintptr_t host_descs, Py_ssize_t n,
                        unsigned int max_ctas, unsigned int threads, uintptr_t stream) -> int:
    """Launch the copy kernel with ``n`` descriptors (from describe_copies) passed by value.

    ``per_launch`` descriptors go into each launch (KVCOPY_INLINE_MAX or
    KVCOPY_INLINE_MAX_SMALL, matching ``function``). Parameters are copied into
    the launch, so ``host_descs`` may be reused as soon as this returns and
    the launch is safe to capture. Returns the number of launches.
    """
    cdef kvcopy_desc* descs = <kvcopy_desc*>host_descs
    cdef Py_ssize_t start, j, count
    cdef kvcopy_inline_batch* batch
    cdef unsigned long long first, tiles
    cdef void* params[1]
    cdef int launches = 0
    if per_launch <= 0 or per_launch > KVCOPY_INLINE_MAX:
        raise ValueError("launch_descs_inline: per_launch out of range")
    _check_launch_shape(max_ctas, threads)
    batch = <kvcopy_inline_batch*>malloc(sizeof(kvcopy_inline_batch))
    if batch == NULL:
        raise MemoryError()
    params[0] = <void*>batch
    try:
        with nogil:
            start = 0
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
                    _check(cydriver.cuLaunchKernel(<CUfunction>function, _grid(tiles, threads, max_ctas),
                                                   1, 1, threads, 1, 1, 0, <CUstream>stream, params, NULL))
                    launches += 1
                start += count
    finally:
        free(batch)
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
    cdef CUdeviceptr dev = <CUdeviceptr>descs
    cdef unsigned long long count = <unsigned long long>n
    cdef void* params[3]
    _check_launch_shape(max_ctas, threads)
    if n <= 0 or tiles == 0:
        return 0
    params[0] = &dev
    params[1] = &count
    params[2] = &tiles
    with nogil:
        if upload_from:
            _check(cydriver.cuMemcpyAsync(dev, <CUdeviceptr>upload_from, n * sizeof(kvcopy_desc),
                                          <CUstream>stream))
        _check(cydriver.cuLaunchKernel(<CUfunction>function, _grid(tiles, threads, max_ctas), 1, 1,
                                       threads, 1, 1, 0, <CUstream>stream, params, NULL))
    return 1


DESCRIPTOR_BYTES = sizeof(kvcopy_desc)
BLOCK_TENSOR_BYTES = sizeof(kvcopy_block_tensor)


def launch_blocks_staged(uintptr_t function, uintptr_t host_buf, uintptr_t device_buf,
                         const uint64_t[:, ::1] tensors, const int64_t[:, ::1] mapping,
                         unsigned long long block_bytes, unsigned int max_ctas,
                         unsigned int threads, uintptr_t stream) -> int:
    """Launch the block kernel of swap_blocks: per-tensor bases and the id mapping only.

    ``tensors`` is (T, 6): src base, dst base, src stride, dst stride, src
    factor, dst factor (kvcopy_block_tensor); ``mapping`` is (n, 2) ids. Both
    are staged through ``host_buf`` (pinned) into ``device_buf``, which need
    room for blocks_staging_bytes(T, n) and must stay untouched until the
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
        raise ValueError("launch_blocks_staged: tensors must be (T, 6) and mapping (n, 2)")
    _check_launch_shape(max_ctas, threads)
    if num_tensors == 0 or num_pairs == 0 or block_bytes == 0:
        return 0
    tiles_per_block = (block_bytes + KVCOPY_TILE_BYTES - 1) // KVCOPY_TILE_BYTES
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
        _check(cydriver.cuMemcpyAsync(<CUdeviceptr>device_buf, <CUdeviceptr>host_buf, total,
                                      <CUstream>stream))
        _check(cydriver.cuLaunchKernel(<CUfunction>function, _grid(tiles, threads, max_ctas), 1, 1,
                                       threads, 1, 1, 0, <CUstream>stream, params, NULL))
    return 1


def blocks_staging_bytes(Py_ssize_t num_tensors, Py_ssize_t num_pairs) -> int:
    """Bytes of staging launch_blocks_staged needs for T tensors and n pairs."""
    return ((num_tensors * sizeof(kvcopy_block_tensor) + 15) & ~15) + num_pairs * 2 * sizeof(int64_t)
