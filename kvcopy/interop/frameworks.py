"""Which framework an object comes from, by its type's module: the one place
kvcopy tells torch, CuPy, JAX, cuda.core and cuda.bindings objects apart. No
framework is imported here."""
from __future__ import annotations

from typing import Any

_PREFIXES = (("torch", "torch"), ("cupy", "cupy"), ("cupy_backends", "cupy"), ("jax", "jax"),
             ("jaxlib", "jax"), ("cuda.core", "cuda.core"), ("cuda.bindings", "cuda.bindings"))


def framework_of(obj: Any) -> str | None:
    """'torch', 'cupy', 'jax', 'cuda.core', 'cuda.bindings', or None for anything else."""
    module = type(obj).__module__ or ""
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
