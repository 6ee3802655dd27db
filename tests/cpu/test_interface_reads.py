"""Array interfaces read once are known again by their fields
(kvcopy.interop.protocols.plain_face_key): CuPy and Numba build a new dict at every
access. What is read again is exactly what the fields say; a stream is resolved at
every call; a malformed interface is refused at every call."""

from __future__ import annotations

import pytest

from kvcopy.interop.protocols import plain_face_key, read_array_interface

CAI = "__cuda_array_interface__"


def face(**fields) -> dict:
    out = {"shape": (4, 16), "typestr": "<f2", "data": (0x7F00_0000_1000, False), "version": 3}
    out.update(fields)
    return out


def no_stream(value, where):  # (a stream_check that must not be asked)
    raise AssertionError(f"asked for a stream: {where}")


def test_a_face_read_again_gives_what_its_fields_say():
    first = read_array_interface(face(), CAI, "src", no_stream)
    again = read_array_interface(face(), CAI, "src", no_stream)
    assert again == first == (0x7F00_0000_1000, (4, 16), (32, 2), 2, False, None)
    moved = read_array_interface(face(data=(0x7F00_0000_2000, True)), CAI, "src", no_stream)
    assert (moved.ptr, moved.readonly) == (0x7F00_0000_2000, True)
    strided = read_array_interface(face(strides=(64, 2)), CAI, "src", no_stream)
    assert strided.strides == (64, 2)


def test_a_stream_is_resolved_at_every_read():
    asked = []

    def stream_check(value, where):
        asked.append((value, where))
        return value + 1

    for handle in (0x10, 0x20):
        assert read_array_interface(face(stream=handle), CAI, "dst", stream_check).stream == handle + 1
    assert asked == [(0x10, f"dst: {CAI}"), (0x20, f"dst: {CAI}")]


def test_a_malformed_face_is_refused_at_every_read():
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^src: __cuda_array_interface__ has data pointer 0 for 64"):
            read_array_interface(face(data=(0, False)), CAI, "src", no_stream)
        with pytest.raises(TypeError, match=r"has version 9; kvcopy reads versions 0, 1, 2, 3$"):
            read_array_interface(face(version=9), CAI, "src", no_stream)


def test_only_fields_of_the_protocols_own_types_make_a_key():
    assert plain_face_key(face(), CAI) is not None
    assert plain_face_key(face(version=3.0), CAI) is None
    assert plain_face_key(face(data=[0x1000, False]), CAI) is None
    assert plain_face_key(face(data=(0x1000, 0)), CAI) is None
    assert plain_face_key(face(mask=object()), CAI) is None
    assert plain_face_key(face(shape=[4, 16]), CAI) is None
    assert plain_face_key(face(), CAI) != plain_face_key(face(), "__array_interface__")
