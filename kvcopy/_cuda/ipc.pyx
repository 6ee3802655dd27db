# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""CUDA IPC through the driver: device memory and events one process shares and another
opens (kvcopy.nixl.same_host). The rules of driver.pyx hold: integer handles at the
boundary, every CUresult through check(); a handle crosses the boundary as the 64
bytes the driver wrote.

Only memory from cuMemAlloc (cudaMalloc, torch's and CuPy's default allocators) can be
shared this way; the driver refuses virtual-memory and pool allocations, and host
memory, with an error that is raised as it comes.
"""

from libc.stdint cimport uintptr_t
from libc.string cimport memcpy

from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport CUdeviceptr, CUevent, CUdevice, CUipcMemHandle, CUipcEventHandle

from kvcopy._cuda.driver cimport check

HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE


cdef bytes _handle_bytes(const char* reserved):
    return reserved[:64]


cdef int _read_handle(bytes handle, char* reserved) except -1:
    if len(handle) != 64:
        raise ValueError(f"a CUDA IPC handle is 64 bytes, got {len(handle)}")
    memcpy(reserved, <const char*>handle, 64)
    return 0


def allocation_of(uintptr_t ptr) -> tuple:
    """(base, size) of the device allocation holding ``ptr`` (cuMemGetAddressRange)."""
    cdef CUdeviceptr base = 0
    cdef size_t size = 0
    check(cydriver.cuMemGetAddressRange(&base, &size, <CUdeviceptr>ptr))
    return <uintptr_t>base, size


def mem_handle(uintptr_t base) -> bytes:
    """The IPC handle of the allocation starting at ``base`` (cuIpcGetMemHandle)."""
    cdef CUipcMemHandle handle
    check(cydriver.cuIpcGetMemHandle(&handle, <CUdeviceptr>base))
    return _handle_bytes(handle.reserved)


def open_mem_handle(bytes handle) -> int:
    """Map another process's allocation into the current context, peer access enabled
    as needed; returns its base here (cuIpcOpenMemHandle)."""
    cdef CUipcMemHandle found
    cdef CUdeviceptr ptr = 0
    _read_handle(handle, found.reserved)
    check(cydriver.cuIpcOpenMemHandle(&ptr, found, cydriver.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
    return <uintptr_t>ptr


def close_mem_handle(uintptr_t ptr) -> None:
    """Unmap what open_mem_handle mapped (cuIpcCloseMemHandle)."""
    check(cydriver.cuIpcCloseMemHandle(<CUdeviceptr>ptr))


def event_create_shared() -> int:
    """An event other processes can open and wait for (no timing, as IPC requires)."""
    cdef CUevent event = NULL
    check(cydriver.cuEventCreate(&event, cydriver.CU_EVENT_INTERPROCESS | cydriver.CU_EVENT_DISABLE_TIMING))
    return <uintptr_t>event


def event_handle(uintptr_t event) -> bytes:
    """The IPC handle of an event made by event_create_shared (cuIpcGetEventHandle)."""
    cdef CUipcEventHandle handle
    check(cydriver.cuIpcGetEventHandle(&handle, <CUevent>event))
    return _handle_bytes(handle.reserved)


def open_event_handle(bytes handle) -> int:
    """Another process's shared event, in the current context (cuIpcOpenEventHandle);
    destroyed with driver.event_destroy."""
    cdef CUipcEventHandle found
    cdef CUevent event = NULL
    _read_handle(handle, found.reserved)
    check(cydriver.cuIpcOpenEventHandle(&event, found))
    return <uintptr_t>event


def device_ordinal(uintptr_t ptr) -> int:
    """The ordinal of the device whose memory (cuMemAlloc or IPC-mapped, not managed)
    holds ``ptr``; -1 for any other memory (host, managed, unknown to the driver)."""
    cdef unsigned int memtype = 0
    cdef unsigned int managed = 0
    cdef int ordinal = -1
    if cydriver.cuPointerGetAttribute(&memtype, cydriver.CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                      <CUdeviceptr>ptr) != cydriver.CUDA_SUCCESS:
        return -1
    if memtype != cydriver.CU_MEMORYTYPE_DEVICE:
        return -1
    check(cydriver.cuPointerGetAttribute(&managed, cydriver.CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                         <CUdeviceptr>ptr))
    if managed:
        return -1
    check(cydriver.cuPointerGetAttribute(&ordinal, cydriver.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                         <CUdeviceptr>ptr))
    return ordinal


def pci_bus_id(int ordinal) -> str:
    """Device ``ordinal``'s PCI bus id, e.g. '0000:00:06.0' (cuDeviceGetPCIBusId)."""
    cdef char text[32]
    check(cydriver.cuDeviceGetPCIBusId(text, 32, <CUdevice>ordinal))
    return text.decode()


def device_of_bus_id(str bus_id) -> int:
    """The ordinal of the device at PCI bus id ``bus_id`` in this process."""
    cdef CUdevice device = 0
    encoded = bus_id.encode()
    check(cydriver.cuDeviceGetByPCIBusId(&device, encoded))
    return <int>device
