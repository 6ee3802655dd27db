# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
# distutils: language = c++
"""Words of memory shared between processes (kvcopy.nixl.doorbell): an aligned 8-byte
word loaded and stored whole, the load with acquire order and the store with release
order, so that what a process wrote before its store is what a process that saw the
store reads after its load, on CPUs that reorder memory operations (Arm) as on x86."""

from libc.stdint cimport uint64_t, uintptr_t

cdef extern from *:
    """
    static inline uint64_t kvcopy_load_acquire(uintptr_t at) {
        return __atomic_load_n((const uint64_t*)at, __ATOMIC_ACQUIRE);
    }
    static inline void kvcopy_store_release(uintptr_t at, uint64_t value) {
        __atomic_store_n((uint64_t*)at, value, __ATOMIC_RELEASE);
    }
    """
    uint64_t kvcopy_load_acquire(uintptr_t at) noexcept nogil
    void kvcopy_store_release(uintptr_t at, uint64_t value) noexcept nogil


cdef inline int _aligned(uintptr_t address) except -1:
    if address == 0 or address & 7:
        raise ValueError(f"address must be a non-null multiple of 8, got {address:#x}")
    return 0


def load_acquire(uintptr_t address) -> int:
    """The word at ``address`` (8-byte aligned), loaded whole with acquire order."""
    _aligned(address)
    return kvcopy_load_acquire(address)


def store_release(uintptr_t address, uint64_t value) -> None:
    """Store ``value`` at ``address`` (8-byte aligned) whole, with release order."""
    _aligned(address)
    kvcopy_store_release(address, value)
