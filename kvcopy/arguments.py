"""Checks of scalar arguments, shared by the public functions: a wrong type is a
TypeError, a wrong value a ValueError, and both name the argument."""

from __future__ import annotations

from typing import Any

import numpy as np


def require_bool(value: Any, name: str) -> bool:
    """``value`` as a bool; only True and False (and NumPy bools) are accepted: a
    string such as 'no' is truthy and would silently mean yes."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} ({value!r})")


def require_int(value: Any, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int within [minimum, maximum]; Python and NumPy integers only."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")
    return value


def require_same_length(src: Any, dst: Any, sizes: Any, prefix: str = "") -> None:
    """ValueError where a (src_ptrs, dst_ptrs, sizes) triple's arrays differ in length;
    ``prefix`` names the batch in the message (e.g. 'store: ')."""
    if not len(src) == len(dst) == len(sizes):
        raise ValueError(
            f"{prefix}src_ptrs, dst_ptrs and sizes differ in length: {len(src)}, {len(dst)} and {len(sizes)}"
        )


def require_triple(batch: Any, name: str, parts: str) -> None:
    """Raise TypeError unless ``batch`` is a tuple or list of three."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 3:
        what = (
            f"a {type(batch).__name__} of {len(batch)}"
            if isinstance(batch, (tuple, list))
            else type(batch).__name__
        )
        raise TypeError(f"{name} must be a ({parts}) triple; got {what}")
