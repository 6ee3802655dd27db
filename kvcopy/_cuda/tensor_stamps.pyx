# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
# distutils: language = c++
"""The check behind kvcopy.interop.kept_reads, one C loop over a call's tensors: is
each the object kept, with the version counter and address it had?

A call's tensors are checked at every call (32 to 128 per-layer caches a side), so
this loop is the part of a repeated call that grows with the tensors: in Python it
cost twice as much, most of it the interpreter's. No driver calls; it only reads
the tensors' own attributes.
"""
import sys

from cpython.object cimport PyObject, PyTypeObject
from cpython.weakref cimport PyWeakref_GetObject

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


def stamps_hold(tuple refs, object tensors, tuple versions, tuple addresses) -> bool:
    """Whether ``tensors`` are, one by one, the live objects ``refs`` (weak references)
    point to, each with the version counter and ``data_ptr()`` recorded. Any error
    reading one (a tensor that lost its storage) is a no."""
    cdef Py_ssize_t i, n = len(refs)
    cdef object tensor, version, address
    if len(tensors) != n:
        return False
    if _plain is None:
        _find_readers()
    try:
        for i in range(n):
            tensor = tensors[i]
            if <object>PyWeakref_GetObject(refs[i]) is not tensor:
                return False
            if type(tensor) is _plain:
                version = _version_get.get(<PyObject*>tensor, _version_get.closure)
                address = _data_ptr_call.ml_meth(<PyObject*>tensor, NULL)
            else:
                version, address = getattr(tensor, _VERSION), tensor.data_ptr()
            if version != versions[i] or address != addresses[i]:
                return False
    except (RuntimeError, AttributeError):
        return False
    return True
