# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
# distutils: language = c++
"""The check behind kvcopy.interop.kept_reads, one C loop over a call's tensors: is
each the object kept, with the version counter and address it had?

A call's tensors are checked at every call (32 to 128 per-layer caches a side), so
this loop is the part of a repeated call that grows with the tensors: in Python it
cost twice as much, most of it the interpreter's. No driver calls; it only reads
the tensors' own attributes.
"""
from cpython.object cimport PyObject
from cpython.weakref cimport PyWeakref_GetObject

cdef object _VERSION = "_version"
cdef object _DATA_PTR = "data_ptr"


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
    cdef object tensor
    if len(tensors) != n:
        return False
    try:
        for i in range(n):
            tensor = tensors[i]
            if <object>PyWeakref_GetObject(refs[i]) is not tensor:
                return False
            if getattr(tensor, _VERSION) != versions[i]:
                return False
            if tensor.data_ptr() != addresses[i]:
                return False
    except (RuntimeError, AttributeError):
        return False
    return True
