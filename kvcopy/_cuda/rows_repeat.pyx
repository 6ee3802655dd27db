# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
# distutils: language = c++
"""A copy_rows call with its indices on the GPU, repeated from one C call.

An engine moves the same two layouts step after step by index tensors on the GPU:
the launches of the first call (kvcopy._cuda.rows.RowsLaunches) read the indices
where they are when they run, so the same call again needs no plan, only proof that
it is the same call. GpuRowsRepeat holds that call's launches and what they depend
on, and ``repeat_gpu_rows`` checks a new call against it in C: the same layout
objects, none of whose torch tensors moved nor arrays changed; each side's indices a plain int64,
one-dimensional, contiguous GPU array (an exact torch.Tensor, or a
``__cuda_array_interface__`` with no pending stream) at the same address with the
same length; the same ``rows``, ``method`` and stream; no setting, device fact or
kept memory changed since (the counters ``epoch_sources`` names). Then it launches and notes the decision
and traffic, as the first call did. Anything else returns None having issued
nothing, and the caller plans the call, which also names what is wrong with it.

No driver call of its own: the launches make theirs (the context checks and
cuLaunchKernel).
"""

import sys

from kvcopy._cuda.tensor_stamps import array_stamp

from cpython.object cimport Py_TYPE
from cpython.weakref cimport PyWeakref_GetObject, PyWeakref_NewRef
from libc.stdint cimport uint64_t

cdef object _KERNEL = "kernel"
cdef object _CAI = "__cuda_array_interface__"
cdef tuple _INT64_TYPESTRS = ("<i8", "i8", "=i8")
cdef uint64_t _MIN_HANDLE = 4096   # (streams.py: no stream lives in the first page)

# torch's objects, found once torch is imported (never imported here)
cdef object _tensor = None         # torch.Tensor; () where torch lacks what is read
cdef object _int64 = None
cdef object _strided = None
cdef object _raw_stream = None     # torch._C._cuda_getCurrentRawStream
# torch.Tensor's own C descriptors of what a site reads, called directly: looking each
# attribute up on the tensor costs as much again (about 1.5 µs for the nine on a GPU
# host). Only used where torch.Tensor's attribute is that very descriptor.
cdef object _dtype, _layout, _is_cuda                            # getset descriptors
cdef object _is_neg, _dim, _is_contiguous, _numel, _data_ptr, _get_device  # methods
_READ = ("dtype", "layout", "is_cuda", "is_neg", "dim", "is_contiguous", "numel", "data_ptr",
         "get_device")


cdef extern from "Python.h":
    object PyObject_CallOneArg(object callable, object arg)
    ctypedef object (*descrgetfunc)(object, object, object)
    ctypedef struct TypeSlots "PyTypeObject":
        descrgetfunc tp_descr_get


cdef inline object _get(object descriptor, object tensor):
    return (<TypeSlots*>Py_TYPE(descriptor)).tp_descr_get(descriptor, tensor, _tensor)


cdef int _find_torch() except -1:
    global _tensor, _int64, _strided, _raw_stream
    global _dtype, _layout, _is_cuda, _is_neg, _dim, _is_contiguous, _numel, _data_ptr, _get_device
    torch = sys.modules.get("torch")
    if torch is None or _tensor is not None:
        return 0
    # (a torch without CUDA has no current stream to read: its tensors are on the host)
    _raw_stream = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
    base = getattr(getattr(torch, "_C", None), "TensorBase", None)
    found = [] if base is None else [base.__dict__.get(name) for name in _READ]
    if not found or any(d is None or getattr(torch.Tensor, name, None) is not d
                        for d, name in zip(found, _READ)):
        _tensor = ()  # (another torch: its index tensors go the whole way)
        return 0
    _dtype, _layout, _is_cuda, _is_neg, _dim, _is_contiguous, _numel, _data_ptr, _get_device = found
    _tensor, _int64, _strided = torch.Tensor, torch.int64, torch.strided
    return 0


cdef struct Site:
    # one side's indices as the launches read them
    bint given        # False: no indices (slot = row)
    uint64_t address  # 0 where there are none of them
    Py_ssize_t count
    int device        # the CUDA ordinal of a torch tensor; -1 for an interface
    bint torch


cdef bint _torch_site(object obj, Site* site) except -1:
    """Read a plain int64 CUDA torch tensor of one contiguous dimension (the engines'
    index tensors; a nested tensor has more); False for any other tensor."""
    if (_get(_dtype, obj) is not _int64 or _get(_layout, obj) is not _strided
            or _get(_is_cuda, obj) is not True or PyObject_CallOneArg(_is_neg, obj) is not False
            or PyObject_CallOneArg(_dim, obj) != 1
            or PyObject_CallOneArg(_is_contiguous, obj) is not True):
        return False
    site.count = PyObject_CallOneArg(_numel, obj)
    site.address = PyObject_CallOneArg(_data_ptr, obj) if site.count else 0
    site.device = PyObject_CallOneArg(_get_device, obj)
    site.torch = True
    return True


cdef bint _interface_site(dict face, Site* site) except -1:
    """Read a __cuda_array_interface__ of int64 in one contiguous dimension whose every
    field has exactly the type the protocol gives, nothing masked and no stream
    pending (interop.protocols.plain_face_key's rule); False for any other."""
    shape, data, strides = face.get("shape"), face.get("data"), face.get("strides")
    if (type(shape) is not tuple or len(<tuple>shape) != 1 or type((<tuple>shape)[0]) is not int
            or type(data) is not tuple or len(<tuple>data) != 2 or type((<tuple>data)[0]) is not int
            or type((<tuple>data)[1]) is not bool or type(face.get("version")) is not int
            or face.get("typestr") not in _INT64_TYPESTRS or face.get("mask") is not None
            or face.get("offset") not in (0, None) or face.get("stream") is not None):
        return False
    count = (<tuple>shape)[0]
    if count < 0 or (count > 1 and strides is not None and strides != (8,)):
        return False
    address = (<tuple>data)[0]
    if address < 0 or address >> 64:
        return False
    site.count = count
    site.address = address if count else 0
    site.device = -1
    site.torch = False
    return True


cdef bint _read_site(object obj, Site* site) except -1:
    """Read one side's indices as a repeat may take them; False where the call must go
    the whole way to be read (host indices, another dtype or shape, any other object)."""
    site.given = obj is not None
    site.address, site.count, site.device, site.torch = 0, 0, -1, False
    if obj is None:
        return True
    if _tensor is None:
        _find_torch()
    if _tensor is not () and type(obj) is _tensor:
        return _torch_site(obj, site)
    face = getattr(obj, _CAI, None)
    if type(face) is dict:
        return _interface_site(<dict>face, site)
    return False


cdef inline bint _same_site(const Site* a, const Site* b) noexcept:
    return a.given == b.given and a.address == b.address and a.count == b.count


def index_site(obj) -> tuple | None:
    """(given, address, count, device) of indices as a repeat reads them, or None where
    it does not read such an object (tests)."""
    cdef Site site
    if not _read_site(obj, &site):
        return None
    return site.given, site.address, site.count, site.device


cdef bint _moved(object layout) except -1:
    """Whether one of the layout's torch tensors is no longer where it was when the
    layout was made, or one of its arrays changed since (kvcopy.Layout.moved, in C)."""
    seen = layout.seen
    if not seen:
        return False
    keep = layout.keep
    for k in range(len(<tuple>seen)):
        fact = (<tuple>seen)[k]
        if fact is not None:
            kept = (<tuple>keep)[k]
            if type((<tuple>fact)[0]) is not int:  # (an array: its stamp whole)
                if array_stamp(kept) != fact:
                    return True
            elif kept.data_ptr() != (<tuple>fact)[0] or kept.shape != (<tuple>fact)[1]:
                return True
    return False


cdef class GpuRowsRepeat:
    """A copy_rows call with indices on the GPU, built: ``launches`` (RowsLaunches, or
    anything with ``launch()`` and ``usable()``), the decision noted at each call by
    ``note_decision(decision)`` and, where ``traffic`` is not None, the traffic noted by
    ``note_again((traffic,))``. Calling it issues the call again (the indices, where
    they were, are read when the launches run). expect() then names the call it
    repeats, for repeat_gpu_rows."""

    cdef readonly object launches
    cdef readonly object decision
    cdef readonly object traffic
    cdef object note_decision
    cdef object note_again
    # the call it repeats (expect()); fast is False until then, or where its indices
    # are of a kind read only the whole way
    cdef bint fast
    cdef Site src
    cdef Site dst
    cdef object rows
    cdef object method
    cdef uint64_t handle      # the stream as the call named it, not yet made effective
    cdef object stream_ref    # a weak reference to the stream object, None if not one
    cdef tuple epoch
    cdef tuple epoch_sources
    cdef object resolve_stream
    cdef object rows_stream

    def __init__(self, launches, decision, traffic, note_decision, note_again):
        self.launches, self.decision, self.traffic = launches, decision, traffic
        self.note_decision, self.note_again = note_decision, note_again
        self.fast = False

    def usable(self) -> bool:
        """False where the context the launches were built in is gone."""
        return bool(self.launches.usable())

    def __call__(self, src_indices=None, dst_indices=None) -> str:
        """Enqueue the launches again and note what the first call noted (the arguments
        are the call's indices, already found to be where the launches read them)."""
        return self._issue()

    cdef object _issue(self):
        self.launches.launch()
        self.note_decision(self.decision)
        if self.traffic is not None:
            self.note_again((self.traffic,))
        return _KERNEL

    def expect(self, src_indices, dst_indices, rows, stream, method, uint64_t handle,
               tuple epoch, tuple epoch_sources, resolve_stream, rows_stream) -> bool:
        """Name the call repeated: its index objects (read here: they must be where the
        launches read them), ``rows``, ``method``, the ``stream`` as given and the raw
        ``handle`` it named, and ``epoch``: the values at the call of the counters that
        ``epoch_sources`` names ((module, attribute) each; a later call repeats only
        while every one holds its value). The stream of a later call is found by
        ``resolve_stream(stream)`` or, where None and its indices are not torch
        tensors, ``rows_stream(None, layouts, indices)``, as copy_rows finds it.
        Returns whether repeat_gpu_rows may take later calls."""
        cdef Site src, dst
        self.fast = False
        if not (_read_site(src_indices, &src) and _read_site(dst_indices, &dst)):
            return False
        self.src, self.dst = src, dst
        self.rows, self.method, self.handle = rows, method, handle
        if len(epoch) != len(epoch_sources):
            raise ValueError("epoch and epoch_sources differ in length")
        self.epoch, self.epoch_sources = epoch, epoch_sources
        self.resolve_stream, self.rows_stream = resolve_stream, rows_stream
        self.stream_ref = None
        if stream is not None and type(stream) is not int:
            try:
                self.stream_ref = PyWeakref_NewRef(stream, None)
            except TypeError:
                pass  # (not weakly referable: resolved at every call)
        self.fast = True
        return True

    cdef object _stream_of(self, object layouts, object a, object b, object stream,
                           const Site* src, const Site* dst):
        """The raw handle the call names, as copy_rows' rows_stream finds it."""
        cdef uint64_t value
        if stream is None:
            if ((src.torch or not src.given) and (dst.torch or not dst.given) and (src.given or dst.given)
                    and _raw_stream is not None):
                # (torch's current stream of the first index tensor's device; 0, its
                # default, means the legacy stream)
                value = _raw_stream(src.device if src.given else dst.device)
                return 1 if value == 0 else value
            return self.rows_stream(None, layouts, (a, b))
        if type(stream) is int:
            if 0 <= stream <= 2 or _MIN_HANDLE <= stream < (1 << 64):
                return stream
            return self.resolve_stream(stream)  # (which refuses it)
        if self.stream_ref is not None and <object>PyWeakref_GetObject(self.stream_ref) is stream:
            return self.handle  # (a stream object names one stream for its life)
        return self.resolve_stream(stream)

    cdef object _repeat(self, object src_layout, object dst_layout, object a, object b,
                        object rows, object stream, object method):
        cdef Site src, dst
        if not self.fast:
            return None
        if method is not self.method and method != self.method:
            return None
        if rows is not self.rows and rows != self.rows:
            return None
        if not _read_site(a, &src):
            return None
        if b is a:
            dst = src
        elif not _read_site(b, &dst):
            return None
        if not (_same_site(&src, &self.src) and _same_site(&dst, &self.dst)):
            return None
        if self._stream_of((src_layout, dst_layout), a, b, stream, &src, &dst) != self.handle:
            return None
        for k in range(len(self.epoch)):
            module, name = <tuple>self.epoch_sources[k]
            if getattr(module, name) != self.epoch[k]:
                return None
        if not self.launches.usable():
            return None
        return self._issue()


def repeat_gpu_rows(dict memo, src, dst, a, b, rows, stream, method):
    """copy_rows(src, dst, a, b, rows=rows, stream=stream, method=method) issued by the
    GpuRowsRepeat remembered in ``memo`` (kvcopy._engine.rows_memo's: entries with
    ``layouts``, weak references, and ``repeat``) for these layouts where the call is
    the one it repeats: returns 'kernel'. None, with nothing issued, otherwise."""
    found = memo.get((id(src), id(dst)))
    if found is None:
        return None
    again = found.repeat
    if type(again) is not GpuRowsRepeat:
        return None
    refs = found.layouts
    if (len(<tuple>refs) != 2 or <object>PyWeakref_GetObject((<tuple>refs)[0]) is not src
            or <object>PyWeakref_GetObject((<tuple>refs)[1]) is not dst):
        return None
    if _moved(src) or _moved(dst):
        return None
    return (<GpuRowsRepeat>again)._repeat(src, dst, a, b, rows, stream, method)
