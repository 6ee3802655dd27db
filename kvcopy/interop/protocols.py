"""The array and stream protocols, read field by field as their specifications define them.

``__cuda_array_interface__`` (versions 0-3) and ``__array_interface__`` (version 3)
are dicts a producer fills in; ``__cuda_stream__`` returns ``(0, handle)``. Every
field kvcopy uses is checked for type and range, and what kvcopy cannot copy as
plain bytes (masked arrays, object dtypes, data that is not a pointer) is refused,
so a malformed producer gets a TypeError or ValueError naming the argument instead
of a wild copy or a stray KeyError.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from kvcopy.kept import make_room

_U64_LIMIT = 1 << 64
_CAI_VERSIONS = (0, 1, 2, 3)
_AI_VERSIONS = (3,)


class ArrayFields(NamedTuple):
    """What an array-interface dict says, checked."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # bytes
    itemsize: int
    readonly: bool
    stream: int | None  # __cuda_array_interface__ v3: pending writes' stream


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _ints(value: Any, what: str, name: str, *, minimum: int | None = None) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(_is_int(v) for v in value):
        raise TypeError(f"{name}: {what} is {value!r}; expected a tuple of ints")
    out = tuple(int(v) for v in value)
    if minimum is not None and any(v < minimum for v in out):
        raise ValueError(f"{name}: {what} {out} has an entry below {minimum}")
    return out


def plain_face_key(face: dict, attr: str) -> tuple | None:
    """The fields that decide how an array interface reads (all but a CAI stream),
    where each has exactly the type the protocol gives and nothing is masked, so that
    equal keys mean equal readings (a 0 is no False, a 3.0 no version 3); else None.
    An interface read and checked once is known again by them: CuPy and Numba build a
    new dict at every access, and reading one in full costs more than a launch."""
    shape, data, strides = face.get("shape"), face.get("data"), face.get("strides")
    if (
        type(shape) is not tuple
        or type(data) is not tuple
        or len(data) != 2
        or type(data[0]) is not int
        or type(data[1]) is not bool
        or type(face.get("version")) is not int
        or type(face.get("typestr")) is not str
        or face.get("mask") is not None
        or face.get("offset") not in (0, None)
        or not all(type(v) is int for v in shape)
        or not (strides is None or (type(strides) is tuple and all(type(v) is int for v in strides)))
    ):
        return None
    return attr, shape, face["typestr"], data, strides, face["version"]


def read_array_interface(face: dict, attr: str, name: str, stream_check: Any) -> ArrayFields:
    """The fields of ``obj.<attr>`` (``face``), checked; ``stream_check`` turns a CAI
    stream into a handle by kvcopy.resolve_stream's rules (or raises), at every call.
    A plain interface read before (plain_face_key) is known again by its fields.

    Raises:
        TypeError: a field of the wrong type, a missing one, a mask, or data
            kvcopy cannot address (None or a buffer object).
        ValueError: a field out of range: negative extents, strides not one per
            dimension, a null pointer with elements, memory past 2**64.
    """
    key = plain_face_key(face, attr)
    known = _read_faces.get(key) if key is not None else None
    if known is None:
        known = _read_in_full(face, attr, name)
        if key is not None:
            make_room(_read_faces, _READ_FACES_KEPT)
            _read_faces[key] = known
    if attr == "__cuda_array_interface__" and face.get("stream") is not None:
        return known._replace(stream=stream_check(face["stream"], f"{name}: {attr}"))
    return known


# Interfaces read before, by plain_face_key: enough for two sides of a 128-layer
# model's per-layer caches, and their index arrays.
_READ_FACES_KEPT = 1024
_read_faces: dict[tuple, ArrayFields] = {}


def _read_in_full(face: dict, attr: str, name: str) -> ArrayFields:
    """read_array_interface's checks of every field but the stream (stream None)."""
    where = f"{name}: {attr}"
    versions = _CAI_VERSIONS if attr == "__cuda_array_interface__" else _AI_VERSIONS
    for key in ("shape", "typestr", "data", "version"):
        if key not in face:
            raise TypeError(f"{where} has no {key!r} entry")
    version = face["version"]
    if not _is_int(version) or int(version) not in versions:
        raise TypeError(
            f"{where} has version {version!r}; kvcopy reads versions {', '.join(map(str, versions))}"
        )
    shape = _ints(face["shape"], "shape", where, minimum=0)
    typestr = face["typestr"]
    if not isinstance(typestr, str):
        raise TypeError(f"{where} has typestr {typestr!r}; expected a string")
    try:
        dtype = np.dtype(typestr)
    except TypeError:
        raise TypeError(f"{where} has typestr {typestr!r}, which is no dtype") from None
    if dtype.hasobject or dtype.itemsize == 0:
        raise TypeError(f"{where} has typestr {typestr!r}: not plain bytes")
    if face.get("mask") is not None:
        raise TypeError(
            f"{where} has a mask: a masked array's bytes are not its values; "
            "pass the data (and copy the mask) separately"
        )
    data = face["data"]
    if data is None or not isinstance(data, (tuple, list)):
        raise TypeError(
            f"{where} gives data as {type(data).__name__}; kvcopy needs a (pointer, read-only) pair"
        )
    if len(data) != 2 or not _is_int(data[0]) or not isinstance(data[1], (bool, np.bool_)):
        raise TypeError(f"{where} has data {data!r}; expected an (int pointer, bool read-only) pair")
    if face.get("offset", 0) not in (0, None):
        raise TypeError(f"{where} has an offset with pointer data, which the protocol does not define")
    ptr, readonly = int(data[0]), bool(data[1])
    if not 0 <= ptr < _U64_LIMIT:  # (even an empty array's pointer is an address)
        raise ValueError(f"{where} has data pointer {ptr}, which is no 64-bit address")
    strides_value = face.get("strides")
    if strides_value is None:
        strides = c_strides(shape, dtype.itemsize)
    else:
        strides = _ints(strides_value, "strides", where)
        if len(strides) != len(shape):
            raise ValueError(f"{where} has {len(strides)} strides for {len(shape)} dimensions")
    elements = 1
    for extent in shape:
        elements *= extent
    if elements:
        if ptr == 0:  # (a pointer outside 64 bits was refused above)
            raise ValueError(f"{where} has data pointer {ptr} for {elements} elements")
        start, end = byte_span(ptr, shape, strides, dtype.itemsize)
        if start < 0 or end > _U64_LIMIT:
            raise ValueError(
                f"{where}: {elements} elements from {ptr:#x} reach past the 64-bit address space"
            )
    return ArrayFields(ptr, shape, strides, dtype.itemsize, readonly, None)


def byte_span(ptr: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> tuple[int, int]:
    """The bytes a strided array at ``ptr`` reaches, as (start, end) (a negative stride
    reaches below ``ptr``); empty at ``ptr`` for no elements."""
    if 0 in shape:
        return ptr, ptr
    low = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
    return ptr + low, ptr + high + itemsize


def c_strides(shape: tuple, itemsize: int) -> tuple:
    """Byte strides of a C-contiguous array of ``shape``."""
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def cuda_stream_handle(value: Any, owner: str) -> Any:
    """The handle in a ``__cuda_stream__`` result: a (0, handle) pair (version 0 is the
    only one defined). Returns the handle, still to be checked as a handle."""
    if not (isinstance(value, tuple) and len(value) == 2):
        raise TypeError(
            f"stream: {owner}.__cuda_stream__ returned {value!r}, expected a (version, handle) tuple"
        )
    version = value[0]
    if not _is_int(version) or int(version) != 0:
        raise TypeError(
            f"stream: {owner}.__cuda_stream__ returned version {version!r}; kvcopy reads version 0"
        )
    return value[1]


__all__ = ["ArrayFields", "byte_span", "cuda_stream_handle", "plain_face_key", "read_array_interface"]
