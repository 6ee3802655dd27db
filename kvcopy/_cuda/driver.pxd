# The driver layer's error check, shared by every module of kvcopy._cuda.
from cuda.bindings.cydriver cimport CUcontext, CUresult


cdef int raise_cuda_error(CUresult status, Py_ssize_t index) except -1 nogil


cdef inline int check(CUresult status, Py_ssize_t index=-1) except -1 nogil:
    """Raise kvcopy.errors.CudaError for a failed CUresult (the GIL is taken only
    then); ``index`` is the failing copy's, where known (-1: none)."""
    if status != 0:   # CUDA_SUCCESS
        raise_cuda_error(status, index)
    return 0


cdef bint driver_ready() noexcept nogil   # init() succeeded: a real driver answers

# What kvcopy keys its per-context state by: never shared by two contexts of the
# process, even where a context destroyed and made again gets its old handle back
cdef unsigned long long context_key(CUcontext ctx) noexcept nogil
