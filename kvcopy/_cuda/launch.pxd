# The copy kernel's launch by value, shared with kvcopy._cuda.replay_records; a
# launch's CTAs and the check of its shape, shared with kvcopy._cuda.rows.
from libc.stdint cimport uintptr_t

from kvcopy._cuda.descriptor cimport kvcopy_desc


cdef int launch_inline(uintptr_t function, int per_launch, const kvcopy_desc* descs,
                       Py_ssize_t n, unsigned int max_ctas, unsigned int threads,
                       uintptr_t stream, int* launches) except -1 nogil


cdef unsigned int ctas_for(unsigned long long tiles, unsigned int threads, unsigned int max_ctas,
                           unsigned long long warps_per_tile=*) noexcept nogil
cdef int check_launch_shape(unsigned int max_ctas, unsigned int threads) except -1
