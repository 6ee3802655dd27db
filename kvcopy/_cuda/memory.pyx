# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""Memory through the CUDA driver: device allocations, pinned and mapped host
memory, page-locking of host memory that exists already. driver.pyx's rules hold
(GIL-free, integer handles, every CUresult through ``check``)."""

from libc.stdint cimport uintptr_t

from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport CUresult, CUdeviceptr, CUstream

from kvcopy._cuda.driver cimport check
from kvcopy._cuda.driver import init


def mem_alloc(size_t nbytes) -> int:
    """Device memory in the current context (scratch for calibration and benchmarks)."""
    cdef CUdeviceptr ptr = 0
    check(cydriver.cuMemAlloc(&ptr, nbytes))
    return ptr


# Frees run with the calling thread's capture mode relaxed. A free may run where a
# CUDA graph is being captured (a finalizer of a pinned array runs wherever the
# collector does) or beside such a capture on another thread; in the default (global)
# mode the driver refuses it with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and
# invalidates that capture. Relaxed, the free succeeds and the capture goes on
# (H200, driver 580: experiments/capture_frees.py). kvcopy frees only memory that no
# pending work reads, so the one hazard relaxed mode admits cannot arise.

cdef CUresult _free_relaxed(uintptr_t ptr, bint host) except? cydriver.CUDA_ERROR_NOT_FOUND nogil:
    cdef cydriver.CUstreamCaptureMode mode = cydriver.CU_STREAM_CAPTURE_MODE_RELAXED
    cdef CUresult status
    cydriver.cuThreadExchangeStreamCaptureMode(&mode)
    if host:
        status = cydriver.cuMemFreeHost(<void*>ptr)
    else:
        status = cydriver.cuMemFree(<CUdeviceptr>ptr)
    cydriver.cuThreadExchangeStreamCaptureMode(&mode)   # back to the thread's own mode
    return status


def mem_free(uintptr_t ptr) -> None:
    """cuMemFree, with capture relaxed for the call (see above)."""
    cdef CUresult status
    with nogil:
        status = _free_relaxed(ptr, False)
    check(status)


def memset_d8_async(uintptr_t ptr, unsigned char value, size_t nbytes, uintptr_t stream) -> None:
    check(cydriver.cuMemsetD8Async(<CUdeviceptr>ptr, value, nbytes, <CUstream>stream))


def host_alloc(size_t nbytes) -> int:
    """Pinned host memory, portable and mapped into every device's address space."""
    init()
    cdef void* ptr = NULL
    with nogil:
        check(cydriver.cuMemHostAlloc(
            &ptr, nbytes, cydriver.CU_MEMHOSTALLOC_PORTABLE | cydriver.CU_MEMHOSTALLOC_DEVICEMAP))
    return <uintptr_t>ptr


def host_free(uintptr_t ptr) -> None:
    """cuMemFreeHost, with capture relaxed for the call (see mem_free)."""
    cdef CUresult status
    with nogil:
        status = _free_relaxed(ptr, True)
    check(status)


def host_register(uintptr_t ptr, size_t nbytes, bint read_only=False) -> None:
    """Page-lock and map existing host memory (portable, device-mapped)."""
    init()
    cdef unsigned int flags = cydriver.CU_MEMHOSTREGISTER_PORTABLE | cydriver.CU_MEMHOSTREGISTER_DEVICEMAP
    if read_only:
        flags |= cydriver.CU_MEMHOSTREGISTER_READ_ONLY
    with nogil:
        check(cydriver.cuMemHostRegister(<void*>ptr, nbytes, flags))


def host_unregister(uintptr_t ptr) -> None:
    with nogil:
        check(cydriver.cuMemHostUnregister(<void*>ptr))


def host_device_pointer(uintptr_t ptr) -> int:
    """The address at which the current context's device sees pinned host memory."""
    cdef CUdeviceptr dptr = 0
    check(cydriver.cuMemHostGetDevicePointer(&dptr, <void*>ptr, 0))
    return dptr
