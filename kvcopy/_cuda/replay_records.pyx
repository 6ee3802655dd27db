# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
# distutils: language = c++
"""Launches remembered for small batches, replayed in one call.

A decode step issues the same shape of batch again and again: tens of blocks,
the same stream, the same pools. For such a batch the policy's answer never
changes, yet copy_batch's Python (context, classification, the remembered
decision, the launch's arguments) cost about as much CPU as the launch itself.
kvcopy._engine.replay records here what a batch of at most MAX_COPIES copies was
launched with; replay describes the next batch (every copy checked and
classified, as always) and, where its context, stream, method, memory kinds,
planned copies and bytes all match one recorded under the same epoch, launches
it at once. Anything else, and any driver error before the launch, leaves the
batch to the full path (nothing enqueued here), with its description where one
was made. A batch the copy engines took one cuMemcpyAsync a copy (memory the
device reaches: nothing to merge inside allocations or to check against the
process's mappings) is recorded as such (record_copies), and replayed as the
caller's copies, one cuMemcpyAsync each.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from libc.stdint cimport uint64_t, uintptr_t

from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport CUcontext, CUstream, CUstreamCaptureStatus

from kvcopy._cuda.classify cimport _Classifier, classifier_init
from kvcopy._cuda.describe cimport Described, DescribedBatch, describe_raw, described
from kvcopy._cuda.descriptor cimport kvcopy_desc
from kvcopy._cuda.dma cimport memcpy_each
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
    uintptr_t function        # 0: the copy engines, one cuMemcpyAsync a copy
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


def record(unsigned long long ctx, uintptr_t stream, long long epoch, int method,
           DescribedBatch batch, tuple launched, object decision, object note) -> None:
    """Record that ``batch`` (as replay's describe pass would find it again) was
    just launched by value on ``stream`` in the context of key ``ctx``
    (current_context_key); ``launched``: (function, descriptors per launch, CTAs,
    threads), the function an entry point of the copy kernel loaded there (the caller
    checks); decided as ``decision``; ``note``: (callable, device, direction), called
    as callable(device, direction, stream, total_bytes) after each replay, or None.
    The oldest record gives way once KEPT are kept."""
    cdef uintptr_t function = launched[0]
    cdef int per_launch = launched[1]
    cdef unsigned int ctas = launched[2], threads = launched[3]
    if (ctx == 0 or batch.count < 1 or batch.count > KVCOPY_INLINE_MAX_SMALL or per_launch < 1
            or ctas == 0 or threads == 0 or threads % 32 or batch.compact_size):
        raise ValueError("record: not a launch by value of a small batch")
    _keep(ctx, stream, epoch, method, batch, function, per_launch, ctas, threads, decision, note)


def record_copies(unsigned long long ctx, uintptr_t stream, long long epoch, int method,
                  DescribedBatch batch, object decision, object note) -> None:
    """Record that ``batch`` was just issued as one cuMemcpyAsync a copy, as record()
    records a launch: a batch like it is replayed as the caller's copies, each
    non-empty one a cuMemcpyAsync. The caller has found the batch's memory reachable
    by the device (its kinds, part of the key, say so for a batch that matches)."""
    if ctx == 0 or batch.count < 1 or batch.count > KVCOPY_INLINE_MAX_SMALL:
        raise ValueError("record_copies: not a small batch")
    _keep(ctx, stream, epoch, method, batch, 0, 0, 0, 0, decision, note)


cdef int _keep(unsigned long long ctx, uintptr_t stream, long long epoch, int method,
               DescribedBatch batch, uintptr_t function, int per_launch, unsigned int ctas,
               unsigned int threads, object decision, object note) except -1:
    global _used, _next
    cdef _Key key = _Key(ctx, stream, epoch, method, batch.src_kinds, batch.src_device,
                         batch.dst_kinds, batch.dst_device, batch.count, batch.total_bytes)
    cdef int slot = _find(&key)
    if slot < 0:
        slot = _next
        _next = (_next + 1) % _KEPT
        if _used < _KEPT:
            _used += 1
    _kept[slot].key = key
    _kept[slot].function = function
    _kept[slot].per_launch = per_launch
    _kept[slot].ctas = ctas
    _kept[slot].threads = threads
    _extras[slot] = (decision, note)
    return 0


def forget() -> None:
    """Drop every record (a setting or a device fact changed; tests)."""
    global _used, _next
    _used = 0
    _next = 0
    for k in range(_KEPT):
        _extras[k] = None


def records() -> int:
    """How many launches are recorded."""
    return _used


def replays() -> int:
    """How many batches replay has issued in this process."""
    return _replayed


cdef int _find(const _Key* want) noexcept:
    cdef int k
    cdef _Key* key
    for k in range(_used):
        key = &_kept[k].key
        if (key.ctx == want.ctx and key.stream == want.stream and key.epoch == want.epoch
                and key.method == want.method and key.count == want.count
                and key.total_bytes == want.total_bytes and key.src_kinds == want.src_kinds
                and key.src_device == want.src_device and key.dst_kinds == want.dst_kinds
                and key.dst_device == want.dst_device):
            return k
    return -1


cdef bint _may_match(uintptr_t stream, long long epoch, int method, Py_ssize_t n) noexcept:
    """Whether a record could match a batch of ``n`` copies, before it is described:
    same stream, method and epoch, and no more planned copies than given. A batch on
    a stream with no record costs no driver call here, and one that is described
    and then matches none is issued from that description by the full path."""
    cdef int k
    cdef _Key* key
    for k in range(_used):
        key = &_kept[k].key
        if (key.stream == stream and key.epoch == epoch and key.method == method
                and key.count <= n):
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


def replay(object src, object dst, object sizes, uintptr_t stream, int method,
           long long epoch, uintptr_t descs_out):
    """Issue a batch that repeats a recorded one (its launch, or the caller's copies
    one cuMemcpyAsync each); return the recorded decision.

    ``src``, ``dst`` and ``sizes`` are C-contiguous uint64 arrays of equal length
    (kvcopy.interop.arrays.as_u64_array's), ``stream`` an effective handle (never
    0), ``descs_out`` host memory for MAX_COPIES descriptors. Where a record may
    match, the batch is described into ``descs_out`` first (every copy checked and
    classified, as the full path does: a bad copy raises the same ValueError);
    where none then matches, the DescribedBatch is returned, for the full path to
    issue without describing again. None: nothing described, nothing enqueued."""
    global _replayed
    cdef Py_buffer bs, bd, bz
    cdef Py_ssize_t n
    cdef CUcontext ctx = NULL
    cdef _Classifier sides[2]
    cdef Described out
    cdef int slot, launches = 0
    cdef _Launch chosen
    cdef _Key key
    if _used == 0 or not driver_ready() or descs_out == 0:
        return None
    PyObject_GetBuffer(src, &bs, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(dst, &bd, PyBUF_SIMPLE)
        try:
            PyObject_GetBuffer(sizes, &bz, PyBUF_SIMPLE)
            try:
                n = bz.len // 8
                if (bs.len != bz.len or bd.len != bz.len or n < 1 or n > KVCOPY_INLINE_MAX_SMALL
                        or not _may_match(stream, epoch, method, n)
                        or not _may_run_here(stream, &ctx)):
                    return None
                classifier_init(&sides[0], n)
                classifier_init(&sides[1], n)
                out.fast, out.compact_size = True, 0
                describe_raw(<const uint64_t*>bs.buf, <const uint64_t*>bd.buf,
                             <const uint64_t*>bz.buf, n, <void*>descs_out, True, sides, &out)
                key = _Key(context_key(ctx), stream, epoch, method, sides[0].kinds,
                           sides[0].ordinal, sides[1].kinds, sides[1].ordinal, out.count,
                           out.total)
                slot = -1 if out.count == 0 else _find(&key)
                if slot < 0:
                    return described(&out, sides, descs_out, src, dst, sizes)
                chosen = _kept[slot]
                decision, note = _extras[slot]
                if chosen.function == 0:  # (the copy engines: the caller's copies as given)
                    with nogil:
                        memcpy_each(<const uint64_t*>bd.buf, <const uint64_t*>bs.buf,
                                    <const uint64_t*>bz.buf, 0, n, <CUstream>stream)
            finally:
                PyBuffer_Release(&bz)
        finally:
            PyBuffer_Release(&bd)
    finally:
        PyBuffer_Release(&bs)
    if chosen.function != 0:
        with nogil:
            launch_inline(chosen.function, chosen.per_launch, <kvcopy_desc*>descs_out, out.count,
                          chosen.ctas, chosen.threads, stream, &launches)
    _replayed += 1
    if note is not None:
        note[0](note[1], note[2], stream, out.total)
    return decision
