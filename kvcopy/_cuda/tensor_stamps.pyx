# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
# distutils: language = c++
"""The check behind kvcopy.interop.kept_reads, one C loop over a call's tensors and
arrays: is each the object kept, unchanged?

- a torch tensor: the same version counter and address (torch bumps the counter at
  every in-place change of its metadata or data);
- a NumPy array (a subclass too, where it keeps NumPy's buffer), which has no
  counter: the same address, shape, strides, item size,
  format and writability, read through the buffer protocol;
- a ``__cuda_array_interface__`` producer that names no stream: the same interface
  (address, writability, shape, strides, type), read again from the object.

A call's tensors are checked at every call (32 to 128 per-layer caches a side), so
this loop is the part of a repeated call that grows with the tensors: in Python it
cost twice as much, most of it the interpreter's. No driver calls; it only reads
the objects' own attributes.
"""
import sys

import numpy as np

from cpython.buffer cimport PyBUF_RECORDS_RO, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.long cimport PyLong_CheckExact
from cpython.object cimport PyObject, PyTypeObject
from cpython.weakref cimport PyWeakref_GetObject
from libc.string cimport memcmp, memcpy, strlen

cdef extern from "Python.h":
    # (returning object: a new reference, owned by the caller; NULL raises)
    ctypedef object (*_getter)(PyObject*, void*)
    ctypedef object (*_noargs)(PyObject*, PyObject*)
    ctypedef struct PyGetSetDef:
        _getter get
        void* closure
    ctypedef struct PyGetSetDescrObject:
        PyGetSetDef* d_getset
    ctypedef struct PyMethodDef:
        _noargs ml_meth
        int ml_flags
    ctypedef struct PyMethodDescrObject:
        PyMethodDef* d_method
    int METH_NOARGS
    PyTypeObject PyGetSetDescr_Type
    PyTypeObject PyMethodDescr_Type

cdef object _VERSION = "_version"
cdef object _DATA_PTR = "data_ptr"

# torch.Tensor's own readers of the version counter and the address, called as C
# functions: the attribute lookups around them cost as much as the reads (each reader
# still does what it does for the tensor, torch-function overrides included). Only for
# torch.Tensor itself: a subclass may override either.
cdef object _plain = None          # torch.Tensor, once torch is imported
cdef PyGetSetDef* _version_get = NULL
cdef PyMethodDef* _data_ptr_call = NULL


cdef int _find_readers() except -1:
    """Find torch.Tensor's C readers once torch is imported (else leave them unknown)."""
    global _plain, _version_get, _data_ptr_call
    torch = sys.modules.get("torch")
    if torch is None or _plain is not None:
        return 0
    base = getattr(getattr(torch, "_C", None), "TensorBase", None)
    if base is None:
        return 0
    version, data_ptr = base.__dict__.get("_version"), base.__dict__.get("data_ptr")
    if (type(version) is not <object>&PyGetSetDescr_Type or type(data_ptr) is not <object>&PyMethodDescr_Type
            or not ((<PyMethodDescrObject*>data_ptr).d_method.ml_flags & METH_NOARGS)):
        _plain = ()  # (another torch: the attributes are read as any object's)
        return 0
    _version_get = (<PyGetSetDescrObject*>version).d_getset
    _data_ptr_call = (<PyMethodDescrObject*>data_ptr).d_method
    _plain = torch.Tensor
    return 0


def identity_hash(object tensors) -> int:
    """A hash of the tensors' identities, in order, without making an int of each (a
    key; the identities themselves are checked by stamps_hold)."""
    cdef Py_ssize_t i, n = len(tensors)
    cdef size_t h = <size_t>n * 0x9E3779B97F4A7C15ULL
    cdef object tensor
    for i in range(n):
        tensor = tensors[i]
        h ^= <size_t><PyObject*>tensor + 0x9E3779B97F4A7C15ULL + (h << 6) + (h >> 2)
    return <Py_ssize_t>h


cdef object _ndarray = np.ndarray
cdef object _CAI = "__cuda_array_interface__"
cdef object _BUFFER = "__buffer__"
cdef object _ndarray_buffer = getattr(np.ndarray, _BUFFER, None)


cdef bint _numpy_array(object array):
    """Whether ``array`` is a NumPy array whose buffer is NumPy's own: numpy.ndarray or
    a subclass (numpy.memmap) that does not define its own ``__buffer__``."""
    if type(array) is _ndarray:
        return True
    return isinstance(array, _ndarray) and getattr(type(array), _BUFFER, None) is _ndarray_buffer


cdef Py_ssize_t _pack_view(Py_buffer* view, char* out) noexcept:
    """Write a buffer view's geometry (ndim, item size, writability, shape, strides,
    then its format's characters) to ``out`` where not NULL; its length in bytes."""
    cdef Py_ssize_t n = view.ndim, words = 3 + 2 * n, i
    cdef const char* fmt = view.format
    if fmt == NULL:
        fmt = "B"  # (unsigned bytes, as the protocol says of a buffer that names none)
    cdef Py_ssize_t length = words * sizeof(Py_ssize_t) + <Py_ssize_t>strlen(fmt)
    cdef Py_ssize_t* w = <Py_ssize_t*>out
    if out == NULL:
        return length
    w[0], w[1], w[2] = n, view.itemsize, view.readonly
    for i in range(n):
        w[3 + i] = view.shape[i]
        w[3 + n + i] = view.strides[i]
    memcpy(out + words * sizeof(Py_ssize_t), fmt, strlen(fmt))
    return length


cdef object _buffer_stamp(object array):
    """(geometry bytes, address) of a NumPy array through the buffer protocol; None where
    it exports no buffer of records (a dtype the protocol cannot name)."""
    cdef Py_buffer view
    if PyObject_GetBuffer(array, &view, PyBUF_RECORDS_RO) < 0:
        return None
    try:
        meta = PyBytes_FromStringAndSize(NULL, _pack_view(&view, NULL))
        _pack_view(&view, PyBytes_AS_STRING(meta))
        return meta, <size_t>view.buf
    finally:
        PyBuffer_Release(&view)


cdef bint _buffer_holds(object array, bytes meta, object address) except -1:
    """Whether a NumPy array's buffer is still at ``address`` with the geometry packed
    in ``meta`` (_pack_view), compared in place."""
    cdef Py_buffer view
    cdef char packed[512]
    cdef Py_ssize_t length
    if PyObject_GetBuffer(array, &view, PyBUF_RECORDS_RO) < 0:
        return False
    try:
        length = _pack_view(&view, NULL)
        if length != PyBytes_GET_SIZE(meta) or length > 512 or <size_t>view.buf != <size_t>address:
            return False
        _pack_view(&view, packed)
        return memcmp(packed, PyBytes_AS_STRING(meta), length) == 0
    finally:
        PyBuffer_Release(&view)


cdef object _interface_stamp(object producer):
    """((data, shape, strides, typestr), address) of a ``__cuda_array_interface__`` that
    names no stream and no mask; None for anything else (a stream is to be waited
    for at each call, so what was read with it is never kept)."""
    interface = getattr(producer, _CAI, None)
    if type(interface) is not dict:
        return None
    if interface.get("stream") is not None or interface.get("mask") is not None:
        return None
    data = interface.get("data")
    if type(data) is not tuple or len(data) != 2 or not PyLong_CheckExact(data[0]):
        return None
    return (data, interface.get("shape"), interface.get("strides"), interface.get("typestr")), data[0]


def array_stamp(object array):
    """What stamps_hold checks of an object that is not a torch tensor, as
    ``(stamp, address)``: a NumPy array's geometry (bytes), or a
    ``__cuda_array_interface__`` producer's interface (a tuple) where it names no
    stream; None for anything else, which is read at every call."""
    if _numpy_array(array):
        try:
            return _buffer_stamp(array)
        except (ValueError, TypeError, BufferError):
            return None
    try:
        return _interface_stamp(array)
    except Exception:  # (a producer whose interface raises: read, and named, at the call)
        return None


def stamps_hold(tuple refs, object tensors, tuple versions, tuple addresses) -> bool:
    """Whether ``tensors`` are, one by one, the live objects ``refs`` (weak references)
    point to, each unchanged: a torch tensor (its stamp an int) with the version
    counter and ``data_ptr()`` recorded; any other object with the stamp and address
    array_stamp gave (bytes: a NumPy array's buffer; a tuple: an array interface).
    Any error reading one (a tensor that lost its storage) is a no."""
    cdef Py_ssize_t i, n = len(refs)
    cdef object tensor, version, address, stamp
    if len(tensors) != n:
        return False
    if _plain is None:
        _find_readers()
    try:
        for i in range(n):
            tensor = tensors[i]
            if <object>PyWeakref_GetObject(refs[i]) is not tensor:
                return False
            stamp = versions[i]
            if type(tensor) is _plain:  # (torch.Tensor first: the engines' caches)
                version = _version_get.get(<PyObject*>tensor, _version_get.closure)
                address = _data_ptr_call.ml_meth(<PyObject*>tensor, NULL)
                if version != stamp or address != addresses[i]:
                    return False
                continue
            if type(stamp) is bytes:
                if not _numpy_array(tensor) or not _buffer_holds(tensor, <bytes>stamp, addresses[i]):
                    return False
                continue
            if type(stamp) is tuple:
                if _interface_stamp(tensor) != (stamp, addresses[i]):
                    return False
                continue
            version, address = getattr(tensor, _VERSION), tensor.data_ptr()  # (a subclass's own)
            if version != stamp or address != addresses[i]:
                return False
    except (RuntimeError, AttributeError, ValueError, TypeError, BufferError):
        return False
    return True
