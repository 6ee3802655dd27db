"""Which framework an object comes from, by its type's module: the one place
kvcopy tells torch, CuPy, JAX, cuda.core and cuda.bindings objects apart. No
framework is imported here."""

from __future__ import annotations

from typing import Any

from kvcopy.kept import make_room

_PREFIXES = (
    ("torch", "torch"),
    ("cupy", "cupy"),
    ("cupy_backends", "cupy"),
    ("jax", "jax"),
    ("jaxlib", "jax"),
    ("cuda.core", "cuda.core"),
    ("cuda.bindings", "cuda.bindings"),
)


# Answers by type: a call asks of each of its arguments several times, and a NumPy
# array or a list would otherwise try every prefix each time. Bounded, because
# classes made at run time would otherwise stay alive here.
_by_type: dict[type, str | None] = {}
_TYPES_KEPT = 256


def framework_of(obj: Any) -> str | None:
    """'torch', 'cupy', 'jax', 'cuda.core', 'cuda.bindings', or None for anything else."""
    kind = type(obj)
    try:
        return _by_type[kind]
    except KeyError:
        pass
    except TypeError:  # (a metaclass that makes its classes unhashable)
        return _framework_of_module(kind.__module__ or "")
    found = _framework_of_module(kind.__module__ or "")
    make_room(_by_type, _TYPES_KEPT)
    _by_type[kind] = found
    return found


def _framework_of_module(module: str) -> str | None:
    for prefix, name in _PREFIXES:
        if module == prefix or module.startswith(prefix + "."):
            return name
    return None


def is_torch(obj: Any) -> bool:
    return framework_of(obj) == "torch"


def is_cupy(obj: Any) -> bool:
    return framework_of(obj) == "cupy"


def type_name(obj: Any) -> str:
    """``module.QualName`` of obj's type, for messages."""
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"
