from libc.stdint cimport uint64_t, uintptr_t

from kvcopy._cuda.classify cimport _Classifier


cdef struct Described:
    Py_ssize_t count             # planned copies (merged, empty ones dropped)
    unsigned long long total     # their bytes
    unsigned long long tiles     # their tiles
    bint fast                    # in: may the vectorised pass run; out: did it
    uint64_t compact_size           # in: may pairs be written; out: their size, else 0


cdef int describe_raw(const uint64_t* src, const uint64_t* dst, const uint64_t* sizes,
                      Py_ssize_t n, void* descs_out, bint merge, _Classifier* sides,
                      Described* out) except -1

cdef tuple describe_with(const uint64_t[::1] src, const uint64_t[::1] dst,
                         const uint64_t[::1] sizes, uintptr_t descs_out, bint merge,
                         _Classifier* sides, bint* fast, uint64_t* compact_size)
