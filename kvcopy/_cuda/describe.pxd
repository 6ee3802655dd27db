from libc.stdint cimport uint64_t, uintptr_t

from kvcopy._cuda.classify cimport _Classifier


cdef tuple describe_with(const uint64_t[::1] src, const uint64_t[::1] dst,
                         const uint64_t[::1] sizes, uintptr_t descs_out, bint merge,
                         _Classifier* sides, bint* fast, uint64_t* pair_size)
