# The per-copy DMA loop, shared by kvcopy._cuda.dma, the staged chunks of
# kvcopy._cuda.launch and .rows, and the replays of .replay_records.
from libc.stdint cimport uint64_t
from cuda.bindings.cydriver cimport CUstream


cdef int memcpy_each(const uint64_t* dst, const uint64_t* src, const uint64_t* sizes,
                     Py_ssize_t lo, Py_ssize_t hi, CUstream stream) except -1 nogil
