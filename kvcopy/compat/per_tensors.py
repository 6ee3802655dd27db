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

from kvcopy._cuda.tensor_stamps import identity_hash, stamps_hold
from kvcopy.kept import dropper, make_room


def version_of(tensor: Any) -> int:
    """torch's version counter of ``tensor``; -1 for an inference tensor, which has none."""
    return -1 if tensor.is_inference() else tensor._version


def _facts(tensors: Sequence[Any], contents: bool) -> list:
    """What a value kept for tensor objects rests on (about 0.35 µs a tensor)."""
    if contents:
        return [(t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, version_of(t)) for t in tensors]
    return [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors]


def _stamps(tensors: Sequence[Any]) -> tuple[tuple, tuple] | None:
    """Each tensor's version counter, then each one's address; None where one has no
    counter (an inference tensor)."""
    if any(t.is_inference() for t in tensors):
        return None
    versions = tuple(t._version for t in tensors)
    return versions, tuple(t.data_ptr() for t in tensors)


class _Entry:
    """A kept value, the tensors' weak references and the facts it rests on; where every
    tensor has a version counter, also the counters and addresses the facts were last
    found to hold at (``versions``: None otherwise): while those stand, so do the facts
    (every in-place change of a tensor's metadata bumps its counter, and a tensor given
    other memory has another address). The counters are renewed by replacing the
    attribute: a reader sees the old or the new, each of which held."""

    __slots__ = ("tensors", "facts", "versions", "addresses", "value")

    def __init__(
        self,
        tensors: Sequence[Any],
        facts: list,
        stamps: tuple[tuple, tuple] | None,
        value: Any,
        gone: Callable[[object], None],
    ) -> None:
        self.tensors = tuple(weakref.ref(t, gone) for t in tensors)
        self.facts, self.value = facts, value
        self.versions: tuple | None = stamps[0] if stamps is not None else None
        self.addresses: tuple = stamps[1] if stamps is not None else ()

    def stamps_hold(self, tensors: Sequence[Any]) -> bool:
        """Whether every tensor is the one kept at the counter and address noted."""
        return self.versions is not None and stamps_hold(self.tensors, tensors, self.versions, self.addresses)

    def holds(self, tensors: Sequence[Any], facts: list) -> bool:
        return self.facts == facts and all(ref() is t for ref, t in zip(self.tensors, tensors))

    def alive(self) -> bool:
        return all(ref() is not None for ref in self.tensors)


class PerTensors:
    """At most ``limit`` values, each kept for a set of torch tensors and arguments: a
    value leaves when one of its tensors is freed, and a full store drops its oldest.

    A lookup first checks each tensor's identity, version counter and address in one C
    loop (kvcopy._cuda.tensor_stamps); only where a counter moved (a write to the data,
    as attention makes to a KV cache every step) or a tensor has none are the facts
    read and compared."""

    def __init__(self, limit: int) -> None:
        self._kept: dict[tuple, _Entry] = {}
        self._limit = limit
        self._changing = threading.Lock()  # (lookups read the dict as it stands)

    def held(self, tensors: Sequence[Any], args: tuple) -> Any:
        """The value kept for these tensor objects and ``args`` where every tensor is the
        one kept at the version counter and address noted (no fact read), else None
        (values are never None)."""
        found = self._kept.get((identity_hash(tensors), args))
        if found is not None and found.stamps_hold(tensors):
            return found.value
        return None

    def get(
        self, tensors: Sequence[Any], args: tuple, build: Callable[[], Any], *, contents: bool = False
    ) -> Any:
        """The value kept for these tensor objects (torch tensors) and ``args``
        (hashable) where none of them has changed, else ``build()``'s, kept."""
        value = self.held(tensors, args)
        if value is not None:
            return value
        return self.renewed(tensors, args, build, contents=contents)

    def renewed(
        self, tensors: Sequence[Any], args: tuple, build: Callable[[], Any], *, contents: bool = False
    ) -> Any:
        """get() where held() found nothing: the value kept for these tensor objects and
        ``args`` whose facts still stand (its counters and addresses noted again), else
        ``build()``'s, kept."""
        key = (identity_hash(tensors), args)  # (identities checked by the entry)
        found = self._kept.get(key)
        # (stamped before the facts are read: a change between the two moves a counter
        # past the one noted, so the next call reads the facts again)
        stamps = _stamps(tensors)
        facts = _facts(tensors, contents)
        if found is not None and found.holds(tensors, facts):
            if stamps is not None:  # (the counters moved, the facts stand: noted again;
                # a reader between the two stores sees a pair of which each held)
                found.addresses, found.versions = stamps[1], stamps[0]
            return found.value
        value = build()
        with self._changing:
            if key not in self._kept:
                make_room(self._kept, self._limit)  # (entries of freed tensors are gone)
            self._kept[key] = _Entry(tensors, facts, stamps, value, dropper(self._kept, key))
        return value

    def __len__(self) -> int:
        return len(self._kept)
