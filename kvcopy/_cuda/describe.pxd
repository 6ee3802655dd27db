from libc.stdint cimport uint64_t, uintptr_t

from kvcopy._cuda.classify cimport _Classifier


cdef struct Described:
    Py_ssize_t count             # planned copies (merged, empty ones dropped)
    unsigned long long total     # their bytes
    unsigned long long tiles     # their tiles
    bint fast                    # in: may the vectorised pass run; out: did it
    uint64_t compact_size        # in: may pairs be written; out: their size, else 0
    Py_ssize_t src_spans         # runs of copies each starting where the one before ends
    Py_ssize_t dst_spans         # (empty copies skipped), on each side
    uint64_t largest             # the caller's largest copy (or its bound: DescribedBatch)
    Py_ssize_t empty             # the caller's empty copies


cdef int describe_raw(const uint64_t* src, const uint64_t* dst, const uint64_t* sizes,
                      Py_ssize_t n, void* descs_out, bint merge, _Classifier* sides,
                      Described* out) except -1

cdef class DescribedBatch:
    cdef readonly Py_ssize_t count
    cdef readonly unsigned long long total_bytes
    cdef readonly unsigned long long tiles
    cdef readonly int src_kinds
    cdef readonly int src_device
    cdef readonly int dst_kinds
    cdef readonly int dst_device
    cdef readonly uint64_t compact_size
    cdef readonly Py_ssize_t src_spans
    cdef readonly Py_ssize_t dst_spans
    cdef readonly uint64_t largest_copy
    cdef readonly Py_ssize_t empty_copies
    cdef readonly uintptr_t table
    cdef readonly object src
    cdef readonly object dst
    cdef readonly object sizes


cdef DescribedBatch described(Described* out, _Classifier* sides, uintptr_t table, object src,
                              object dst, object sizes)

cdef DescribedBatch describe_with(object src, object dst, object sizes, uintptr_t descs_out,
                                  bint merge, _Classifier* sides, bint* fast, bint compact)
