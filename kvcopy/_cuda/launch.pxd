# The copy kernel's launch by value, shared with kvcopy._cuda.replay_records.
from libc.stdint cimport uintptr_t

from kvcopy._cuda.descriptor cimport kvcopy_desc


cdef int launch_inline(uintptr_t function, int per_launch, const kvcopy_desc* descs,
                       Py_ssize_t n, unsigned int max_ctas, unsigned int threads,
                       uintptr_t stream, int* launches) except -1 nogil
