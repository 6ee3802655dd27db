# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""Thin wrappers over the CUDA driver (cuda-python's ``cydriver``): errors,
initialisation, devices and contexts, streams and events (memory: memory.pyx).

The rules, said once: everything is GIL-free and takes integer handles at the Python
boundary; every CUresult goes through :func:`check` (driver.pxd), which takes the GIL
only on failure and raises :class:`kvcopy.errors.CudaError` with the error's name and,
where known, the failing copy's index; only driver functions whose signatures are the
same in cuda-bindings 12.9 and 13.x are cimported (Cython checks them at import).
"""

from libc.stdint cimport uintptr_t

from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport (
    CUresult, CUdeviceptr, CUstream, CUcontext, CUdevice, CUevent, CUstreamCaptureStatus,
    CUdevice_attribute,
)

from kvcopy.errors import CudaError, NoDriverError


# ---------------------------------------------------------------- errors

cdef int raise_cuda_error(CUresult status, Py_ssize_t index) except -1 nogil:
    cdef const char* name = NULL
    cdef const char* text = NULL
    with gil:
        try:
            cydriver.cuGetErrorName(status, &name)
            cydriver.cuGetErrorString(status, &text)
        except Exception:
            pass
        py_name = name.decode() if name != NULL else f"CUresult({<int>status})"
        py_text = text.decode() if text != NULL else "unknown CUDA error"
        raise CudaError(<int>status, py_name, py_text, None if index < 0 else index)


def error_name(int status) -> str:
    """The driver's name for a CUresult value, e.g. ``CUDA_ERROR_INVALID_VALUE``."""
    cdef const char* name = NULL
    if cydriver.cuGetErrorName(<CUresult>status, &name) != cydriver.CUDA_SUCCESS or name == NULL:
        return f"CUresult({status})"
    return name.decode()


# ---------------------------------------------------------------- init

cdef bint _initialized = False
cdef int _driver_version = 0


cdef bint driver_ready() noexcept nogil:
    return _initialized


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
        # (from None: the loader's traceback runs to thirty lines that say what the one
        # line below says; it stays on __context__ for whoever wants it)
        raise NoDriverError(
            "no CUDA driver was found: libcuda could not be loaded "
            f"({type(exc).__name__}: {exc}). kvcopy needs an NVIDIA GPU and its driver."
        ) from None
    check(status)
    check(cydriver.cuDriverGetVersion(&version))
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
    check(cydriver.cuDeviceGetCount(&count))
    return count


def device_attributes(int ordinal) -> dict:
    """The device facts kvcopy's policy needs, and what tells this GPU from another
    (its UUID, its PCI address), as a plain dict."""
    init()
    cdef CUdevice dev
    cdef char name[256]
    cdef int value = 0
    cdef cydriver.CUuuid uuid
    check(cydriver.cuDeviceGet(&dev, ordinal))
    check(cydriver.cuDeviceGetName(name, 256, dev))
    wanted = {
        "sm_count": cydriver.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        "cc_major": cydriver.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        "cc_minor": cydriver.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        "unified_addressing": cydriver.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
        "can_map_host_memory": cydriver.CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY,
        "host_pointer_for_registered_mem":
            cydriver.CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
        "host_register_supported": cydriver.CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED,
        # where the GPU sits on PCI: its NUMA node (host pools), its link (calibration)
        "pci_domain": cydriver.CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID,
        "pci_bus": cydriver.CU_DEVICE_ATTRIBUTE_PCI_BUS_ID,
        "pci_device": cydriver.CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID,
    }
    check(cydriver.cuDeviceGetUuid(&uuid, dev))
    out = {"ordinal": ordinal, "name": name.decode(errors="replace"),
           "driver_version": _driver_version, "uuid": uuid.bytes[:16].hex()}
    for key, attr in wanted.items():
        check(cydriver.cuDeviceGetAttribute(&value, <CUdevice_attribute>attr, dev))
        out[key] = int(value)
    return out


def current_context() -> int:
    """The calling thread's current context handle, 0 when there is none."""
    init()
    cdef CUcontext ctx = NULL
    check(cydriver.cuCtxGetCurrent(&ctx))
    return <uintptr_t>ctx


cdef unsigned long long context_key(CUcontext ctx) noexcept nogil:
    # After a primary context reset the next one comes back under the same handle:
    # only its id (cuCtxGetId, unique for the process's life) tells it from the old
    # one, whose modules and memory are gone. Id + 1: 0 stays "no context".
    cdef unsigned long long ident = 0
    if ctx == NULL:
        return 0
    if cydriver.cuCtxGetId(ctx, &ident) != cydriver.CUDA_SUCCESS:
        return <uintptr_t>ctx   # (no ids before CUDA 12.0: the handle is all there is)
    return ident + 1


def current_context_key() -> int:
    """A key of the calling thread's current context that no other context of the
    process ever has, even one made again under the same handle after a reset;
    0 when there is none. Per-context state (loaded kernels, rings, peer access,
    recorded launches) is kept under it."""
    init()
    cdef CUcontext ctx = NULL
    check(cydriver.cuCtxGetCurrent(&ctx))
    return context_key(ctx)


def context_device() -> int:
    """Ordinal of the current context's device."""
    cdef CUdevice dev
    check(cydriver.cuCtxGetDevice(&dev))
    return <int>dev


# primary contexts retained, per ordinal (a race retains twice at worst: same handle)
cdef enum:
    _PRIMARY_KEPT = 64
cdef CUcontext _primary[_PRIMARY_KEPT]


cdef CUcontext _primary_context(int ordinal) except? NULL:
    """A device's primary context, retained once per process and never released."""
    cdef CUdevice dev
    cdef CUcontext ctx = NULL
    cdef bint kept = 0 <= ordinal < _PRIMARY_KEPT
    if kept and _primary[ordinal] != NULL:
        return _primary[ordinal]
    check(cydriver.cuDeviceGet(&dev, ordinal))
    check(cydriver.cuDevicePrimaryCtxRetain(&ctx, dev))
    if kept:
        _primary[ordinal] = ctx
    return ctx


def primary_context(int ordinal) -> int:
    """A device's primary context (retained once per process, never released)."""
    init()
    return <uintptr_t>_primary_context(ordinal)


def push_context(uintptr_t ctx) -> None:
    check(cydriver.cuCtxPushCurrent(<CUcontext>ctx))


def pop_context() -> None:
    cdef CUcontext ctx = NULL
    check(cydriver.cuCtxPopCurrent(&ctx))


def stream_context(uintptr_t stream) -> int:
    """Context that a created stream belongs to."""
    cdef CUcontext ctx = NULL
    check(cydriver.cuStreamGetCtx(<CUstream>stream, &ctx))
    return <uintptr_t>ctx


def enter_for_repeat(uintptr_t stream, int owner, unsigned long long key) -> int:
    """Make current the context a call on ``stream`` runs in, by ContextScope's rule (a
    created stream's own; on the default streams the current one where it is on
    device ``owner``, else ``owner``'s primary context, device 0's where none is
    current and ``owner`` is -1), where that context's key is ``key`` and ``stream``
    is not capturing a graph: what a repeated call asks before it issues, in one
    call. Returns 1 where a context was pushed (pop_context after issuing), 0 where
    the current one serves, -1 where the call is not to repeat (nothing pushed)."""
    init()
    cdef CUcontext current = NULL, ctx = NULL
    cdef CUdevice dev
    cdef CUstreamCaptureStatus status
    cdef CUresult failed
    check(cydriver.cuCtxGetCurrent(&current))
    if stream == 1 or stream == 2:   # CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
        ctx = current
        if current != NULL and owner >= 0:
            check(cydriver.cuCtxGetDevice(&dev))
            if <int>dev != owner:
                ctx = NULL
        if ctx == NULL:
            ctx = _primary_context(owner if owner >= 0 else 0)
    else:
        check(cydriver.cuStreamGetCtx(<CUstream>stream, &ctx))
    if context_key(ctx) != key:
        return -1
    if ctx != current:
        check(cydriver.cuCtxPushCurrent(ctx))
    failed = cydriver.cuStreamIsCapturing(<CUstream>stream, &status)
    if failed != cydriver.CUDA_SUCCESS or status != cydriver.CU_STREAM_CAPTURE_STATUS_NONE:
        if ctx != current:
            cydriver.cuCtxPopCurrent(&ctx)
        check(failed)
        return -1
    return 1 if ctx != current else 0


def can_access_peer(int device, int peer) -> bool:
    """Whether kernels on ``device`` can read and write ``peer``'s memory (NVLink or
    PCIe peer-to-peer), once peer access is enabled."""
    init()
    cdef int can = 0
    cdef CUdevice a, b
    if device == peer:
        return True
    check(cydriver.cuDeviceGet(&a, device))
    check(cydriver.cuDeviceGet(&b, peer))
    check(cydriver.cuDeviceCanAccessPeer(&can, a, b))
    return can != 0


def enable_peer_access(int peer) -> bool:
    """Let the current context's kernels access memory of ``peer``'s primary context
    (every cuMemAlloc allocation there, present and future). Returns False when it
    was already enabled, True when this call enabled it."""
    cdef CUresult status
    # The peer's primary context stays retained (once per process): access needs it.
    cdef CUcontext ctx = _primary_context(peer)
    status = cydriver.cuCtxEnablePeerAccess(ctx, 0)
    if status == cydriver.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
        return False
    check(status)
    return True


def pointer_access_flags(uintptr_t ptr) -> int:
    """CU_POINTER_ATTRIBUTE_ACCESS_FLAGS of ``ptr`` for the current context's device:
    0 none, 1 read, 3 read and write; -1 where the driver does not say."""
    cdef unsigned int flags = 0
    if cydriver.cuPointerGetAttribute(&flags, cydriver.CU_POINTER_ATTRIBUTE_ACCESS_FLAGS,
                                      <CUdeviceptr>ptr) != cydriver.CUDA_SUCCESS:
        return -1
    return <int>flags


def stream_capture_status(uintptr_t stream) -> int:
    """0: not capturing, 1: capturing, 2: capture invalidated."""
    cdef CUstreamCaptureStatus status
    check(cydriver.cuStreamIsCapturing(<CUstream>stream, &status))
    if status == cydriver.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        return 1
    if status == cydriver.CU_STREAM_CAPTURE_STATUS_INVALIDATED:
        return 2
    return 0


CAPTURE_MODE_RELAXED = cydriver.CU_STREAM_CAPTURE_MODE_RELAXED


def exchange_capture_mode(int mode) -> int:
    """Set the calling thread's stream-capture mode (a CUstreamCaptureMode, such as
    CAPTURE_MODE_RELAXED: another thread's capture forbids none of its calls) and
    return the mode it had."""
    init()
    cdef cydriver.CUstreamCaptureMode value = <cydriver.CUstreamCaptureMode>mode
    check(cydriver.cuThreadExchangeStreamCaptureMode(&value))
    return <int>value


def stream_create(bint non_blocking=True) -> int:
    cdef CUstream stream = NULL
    check(cydriver.cuStreamCreate(&stream, cydriver.CU_STREAM_NON_BLOCKING if non_blocking else 0))
    return <uintptr_t>stream


def stream_destroy(uintptr_t stream) -> None:
    check(cydriver.cuStreamDestroy(<CUstream>stream))


def stream_synchronize(uintptr_t stream) -> None:
    with nogil:
        check(cydriver.cuStreamSynchronize(<CUstream>stream))


def stream_wait_event(uintptr_t stream, uintptr_t event) -> None:
    check(cydriver.cuStreamWaitEvent(<CUstream>stream, <CUevent>event, 0))


cdef CUcontext _stream_home(uintptr_t stream, int device, CUcontext here) except? NULL:
    """The context a stream handle refers to: a created stream's own; for the
    default-stream handles (0x1, 0x2) the primary context of ``device``, or the
    current context ``here`` when device is -1."""
    cdef CUcontext ctx = NULL
    if stream > 2:
        check(cydriver.cuStreamGetCtx(<CUstream>stream, &ctx))
        return ctx
    if device < 0:
        return here
    return _primary_context(device)


def stream_wait_stream(uintptr_t consumer, uintptr_t producer, int producer_device=-1,
                       int consumer_device=-1) -> None:
    """Make ``consumer`` wait (on the GPU) for the work queued on ``producer`` so far.
    Either may be on another device: the event is recorded in the producer's context
    (_stream_home) and waited for in the consumer's, and destroyed at once (the driver
    keeps it until the wait resolves)."""
    cdef CUevent event = NULL
    cdef CUcontext here = NULL
    cdef CUcontext popped = NULL
    check(cydriver.cuCtxGetCurrent(&here))
    cdef CUcontext source = _stream_home(producer, producer_device, here)
    cdef CUcontext target = _stream_home(consumer, consumer_device, here)
    if consumer == producer and source == target:
        return
    if source != here:
        check(cydriver.cuCtxPushCurrent(source))
    try:
        check(cydriver.cuEventCreate(&event, cydriver.CU_EVENT_DISABLE_TIMING))
        check(cydriver.cuEventRecord(event, <CUstream>producer))
    finally:
        if source != here:
            cydriver.cuCtxPopCurrent(&popped)
    if target != here:
        check(cydriver.cuCtxPushCurrent(target))
    try:
        check(cydriver.cuStreamWaitEvent(<CUstream>consumer, event, 0))
    finally:
        if target != here:
            cydriver.cuCtxPopCurrent(&popped)
        cydriver.cuEventDestroy(event)


def event_create(bint timing=False) -> int:
    cdef CUevent event = NULL
    check(cydriver.cuEventCreate(&event, 0 if timing else cydriver.CU_EVENT_DISABLE_TIMING))
    return <uintptr_t>event


def event_record(uintptr_t event, uintptr_t stream) -> None:
    check(cydriver.cuEventRecord(<CUevent>event, <CUstream>stream))


def event_query(uintptr_t event) -> bool:
    """True when the event has completed, False while it is pending."""
    cdef CUresult status = cydriver.cuEventQuery(<CUevent>event)
    if status == cydriver.CUDA_ERROR_NOT_READY:
        return False
    check(status)
    return True


def event_synchronize(uintptr_t event) -> None:
    with nogil:
        check(cydriver.cuEventSynchronize(<CUevent>event))


def event_elapsed_ms(uintptr_t start, uintptr_t end) -> float:
    cdef float ms = 0
    check(cydriver.cuEventElapsedTime(&ms, <CUevent>start, <CUevent>end))
    return ms


def event_destroy(uintptr_t event) -> None:
    check(cydriver.cuEventDestroy(<CUevent>event))
