"""Array-interface producers for CPU tests: objects that expose only a
``__cuda_array_interface__`` over an address they are given (no memory behind it
unless the test gives some)."""

from __future__ import annotations


class Interface:
    """A producer of ``shape`` bytes at ``ptr`` (C order), naming ``stream`` if given."""

    def __init__(self, ptr: int, shape: tuple = (8, 64), stream: int | None = None) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": stream,
        }
