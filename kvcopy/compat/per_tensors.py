"""Values kept per set of tensor objects, used again only for those very objects
unchanged.

The drop-ins keep what they read from an engine's tensors (a table's addresses, the
layout of a cache) keyed by the identity of the tensors and the arguments that shaped
the value. A kept value is used again only while those tensor objects are alive with
the same address, shape, strides and dtype, and with ``contents`` (tables of
addresses) on the same device with the same torch version counter, which every
in-place write through torch bumps. An inference tensor (made under
torch.inference_mode, as engines often make their tables) has no version counter: its
contents count as fixed for the object, so a table that changes must be a new tensor,
as the engines' own tables are. Only weak references to the tensors are held: a freed
tensor is never kept alive, and a new tensor at a freed one's address is read anew.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence

from kvcopy.kept import dropper, make_room


def version_of(tensor: Any) -> int:
    """torch's version counter of ``tensor``; -1 for an inference tensor, which has none."""
    return -1 if tensor.is_inference() else tensor._version


def _facts(tensors: Sequence[Any], contents: bool) -> list:
    """What a value kept for tensor objects rests on (about 0.35 µs a tensor)."""
    if contents:
        return [(t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, version_of(t)) for t in tensors]
    return [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors]


class _Entry:
    __slots__ = ("tensors", "facts", "value")

    def __init__(
        self, tensors: Sequence[Any], facts: list, value: Any, gone: Callable[[object], None]
    ) -> None:
        self.tensors = tuple(weakref.ref(t, gone) for t in tensors)
        self.facts, self.value = facts, value

    def holds(self, tensors: Sequence[Any], facts: list) -> bool:
        return self.facts == facts and all(ref() is t for ref, t in zip(self.tensors, tensors))

    def alive(self) -> bool:
        return all(ref() is not None for ref in self.tensors)


class PerTensors:
    """At most ``limit`` values, each kept for a set of torch tensors and arguments: a
    value leaves when one of its tensors is freed, and a full store drops its oldest."""

    def __init__(self, limit: int) -> None:
        self._kept: dict[tuple, _Entry] = {}
        self._limit = limit
        self._changing = threading.Lock()  # (lookups read the dict as it stands)

    def get(
        self, tensors: Sequence[Any], args: tuple, build: Callable[[], Any], *, contents: bool = False
    ) -> Any:
        """The value kept for these tensor objects (torch tensors) and ``args``
        (hashable) where none of them has changed, else ``build()``'s, kept."""
        key = (tuple(map(id, tensors)), args)
        facts = _facts(tensors, contents)
        found = self._kept.get(key)
        if found is not None and found.holds(tensors, facts):
            return found.value
        value = build()
        with self._changing:
            if key not in self._kept:
                make_room(self._kept, self._limit)  # (entries of freed tensors are gone)
            self._kept[key] = _Entry(tensors, facts, value, dropper(self._kept, key))
        return value

    def __len__(self) -> int:
        return len(self._kept)
