# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""Launches remembered for small batches, replayed in one call.

A decode step issues the same shape of batch again and again: tens of blocks,
the same stream, the same pools. For such a batch the policy's answer never
changes, yet copy_batch's Python (context, classification, the remembered
decision, the launch's arguments) cost about as much CPU as the launch itself.
kvcopy._engine.replay records here what a batch of at most MAX_COPIES copies was
launched with; launch_again describes the next batch (every copy checked and
classified, as always) and, where its context, stream, method, memory kinds,
planned copies and bytes all match one recorded under the same epoch, launches
it at once. Anything else, and any driver error before the launch, leaves the
batch to the full path (nothing enqueued here).
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from libc.stdint cimport uint64_t, uintptr_t

from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport CUcontext, CUstream, CUstreamCaptureStatus

from kvcopy._cuda.classify cimport _Classifier, classifier_init
from kvcopy._cuda.describe cimport Described, describe_raw
from kvcopy._cuda.descriptor cimport kvcopy_desc
from kvcopy._cuda.driver cimport context_key, driver_ready
from kvcopy._cuda.launch cimport launch_inline

cdef extern from "kvcopy/descriptor.h":
    enum: KVCOPY_INLINE_MAX_SMALL   # (as an enum: it sizes an array below)

cdef enum:
    _KEPT = 32   # a step's distinct small batches (stores, loads, per stream) fit

MAX_COPIES = KVCOPY_INLINE_MAX_SMALL
KEPT = _KEPT


cdef struct _Key:
    unsigned long long ctx   # driver.context_key: a reset context's old handle never matches
    uintptr_t stream
    long long epoch          # kvcopy._engine.replay.epoch(): config and device facts
    int method               # kvcopy._engine.replay.METHODS
    int src_kinds
    int src_device
    int dst_kinds
    int dst_device
    Py_ssize_t count         # planned copies
    unsigned long long total_bytes


cdef struct _Launch:
    _Key key
    uintptr_t function
    int per_launch
    unsigned int ctas
    unsigned int threads


cdef _Launch _kept[_KEPT]
cdef int _used = 0
cdef int _next = 0
cdef unsigned long long _replayed = 0
# per entry: (decision, note) where note is (callable, device, direction) or None
cdef list _extras = [None] * _KEPT


def current_context_key() -> int:
    """The calling thread's current context's key (driver.current_context_key); 0
    where there is none, or where no real driver was initialised
    (kvcopy._cuda.driver.init)."""
    cdef CUcontext ctx = NULL
    if not driver_ready() or cydriver.cuCtxGetCurrent(&ctx) != cydriver.CUDA_SUCCESS:
        return 0
    return context_key(ctx)


def remember(unsigned long long ctx, uintptr_t stream, long long epoch, int method, int src_kinds,
             int src_device, int dst_kinds, int dst_device, Py_ssize_t count,
             unsigned long long total_bytes, uintptr_t function, int per_launch,
             unsigned int ctas, unsigned int threads, object decision, object note) -> None:
    """Record that a batch of this key was just launched by value in the context of
    key ``ctx`` (current_context_key) with ``function`` (an entry point of the copy
    kernel loaded there: the caller checks) over ``ctas`` x ``threads``,
    ``per_launch`` descriptors a launch, decided as ``decision``; ``note``:
    (callable, device, direction), called as
    callable(device, direction, stream, total_bytes) after each replay, or None.
    The oldest record gives way once KEPT are kept."""
    global _used, _next
    cdef int slot
    if (ctx == 0 or count < 1 or count > KVCOPY_INLINE_MAX_SMALL or per_launch < 1
            or ctas == 0 or threads == 0 or threads % 32):
        raise ValueError("remember: not a launch by value of a small batch")
    slot = _find(ctx, stream, epoch, method, src_kinds, src_device, dst_kinds,
                 dst_device, count, total_bytes)
    if slot < 0:
        slot = _next
        _next = (_next + 1) % _KEPT
        if _used < _KEPT:
            _used += 1
    _kept[slot].key = _Key(ctx, stream, epoch, method, src_kinds, src_device,
                           dst_kinds, dst_device, count, total_bytes)
    _kept[slot].function = function
    _kept[slot].per_launch = per_launch
    _kept[slot].ctas = ctas
    _kept[slot].threads = threads
    _extras[slot] = (decision, note)


def forget() -> None:
    """Drop every record (a setting or a device fact changed; tests)."""
    global _used, _next
    _used = 0
    _next = 0
    for k in range(_KEPT):
        _extras[k] = None


def remembered() -> int:
    """How many launches are recorded."""
    return _used


def replayed() -> int:
    """How many batches launch_again has launched in this process."""
    return _replayed


cdef int _find(unsigned long long ctx, uintptr_t stream, long long epoch, int method, int src_kinds,
               int src_device, int dst_kinds, int dst_device, Py_ssize_t count,
               unsigned long long total_bytes) noexcept:
    cdef int k
    cdef _Key* key
    for k in range(_used):
        key = &_kept[k].key
        if (key.ctx == ctx and key.stream == stream and key.epoch == epoch
                and key.method == method and key.count == count
                and key.total_bytes == total_bytes and key.src_kinds == src_kinds
                and key.src_device == src_device and key.dst_kinds == dst_kinds
                and key.dst_device == dst_device):
            return k
    return -1


cdef bint _may_match(uintptr_t stream, long long epoch, int method,
                     const uint64_t* sizes, Py_ssize_t n) noexcept:
    """Whether a record could match a batch of these ``n`` sizes, before it is
    described: same stream, method and epoch, the same bytes (merging and dropping
    empty copies keep them) and no more planned copies than given. A batch of a
    shape not seen before then costs no driver call and no describe pass here."""
    cdef unsigned long long total = 0
    cdef Py_ssize_t i
    cdef int k
    cdef _Key* key
    for i in range(n):
        total += sizes[i]
    for k in range(_used):
        key = &_kept[k].key
        if (key.stream == stream and key.epoch == epoch and key.method == method
                and key.total_bytes == total and key.count <= n):
            return True
    return False


cdef bint _may_run_here(uintptr_t stream, CUcontext* ctx) noexcept:
    """The current context, where the batch would run in it (a created stream of
    that context, or a default stream), and the stream is not capturing."""
    cdef CUcontext own = NULL
    cdef CUstreamCaptureStatus status
    if cydriver.cuCtxGetCurrent(ctx) != cydriver.CUDA_SUCCESS or ctx[0] == NULL:
        return False
    if stream > 2:   # 1, 2: the default streams run in the current context
        if cydriver.cuStreamGetCtx(<CUstream>stream, &own) != cydriver.CUDA_SUCCESS \
                or own != ctx[0]:
            return False
    if cydriver.cuStreamIsCapturing(<CUstream>stream, &status) != cydriver.CUDA_SUCCESS:
        return False
    return status == cydriver.CU_STREAM_CAPTURE_STATUS_NONE


def launch_again(object src, object dst, object sizes, uintptr_t stream, int method,
                 long long epoch):
    """Launch a batch that repeats a recorded one; return the recorded decision, or
    None where nothing was enqueued (no match: run the full path).

    ``src``, ``dst`` and ``sizes`` are C-contiguous uint64 arrays of equal length
    (kvcopy.interop.arrays.as_u64_array's), ``stream`` an effective handle (never
    0). Every copy is checked and classified first, as the full path does: a bad
    copy raises the same ValueError."""
    global _replayed
    cdef Py_buffer bs, bd, bz
    cdef Py_ssize_t n
    cdef CUcontext ctx = NULL
    cdef _Classifier sides[2]
    cdef kvcopy_desc descs[KVCOPY_INLINE_MAX_SMALL]
    cdef Described out
    cdef int slot, launches = 0
    cdef _Launch chosen
    if _used == 0 or not driver_ready():
        return None
    PyObject_GetBuffer(src, &bs, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(dst, &bd, PyBUF_SIMPLE)
        try:
            PyObject_GetBuffer(sizes, &bz, PyBUF_SIMPLE)
            try:
                n = bz.len // 8
                if (bs.len != bz.len or bd.len != bz.len or n < 1 or n > KVCOPY_INLINE_MAX_SMALL
                        or not _may_match(stream, epoch, method, <const uint64_t*>bz.buf, n)
                        or not _may_run_here(stream, &ctx)):
                    return None
                classifier_init(&sides[0], n)
                classifier_init(&sides[1], n)
                out.fast, out.compact_size = True, 0
                describe_raw(<const uint64_t*>bs.buf, <const uint64_t*>bd.buf,
                             <const uint64_t*>bz.buf, n, <void*>descs, True, sides, &out)
            finally:
                PyBuffer_Release(&bz)
        finally:
            PyBuffer_Release(&bd)
    finally:
        PyBuffer_Release(&bs)
    if out.count == 0:
        return None
    slot = _find(context_key(ctx), stream, epoch, method, sides[0].kinds, sides[0].ordinal,
                 sides[1].kinds, sides[1].ordinal, out.count, out.total)
    if slot < 0:
        return None
    chosen = _kept[slot]
    decision, note = _extras[slot]
    with nogil:
        launch_inline(chosen.function, chosen.per_launch, descs, out.count, chosen.ctas,
                      chosen.threads, stream, &launches)
    _replayed += 1
    if note is not None:
        note[0](note[1], note[2], stream, out.total)
    return decision
