"""What was read from torch tensors and arrays, kept while none of them has changed.

Reading a torch tensor's geometry (address, shape, strides, dtype, flags) costs about
0.7 µs a tensor, an array's through its interface more; an engine hands kvcopy the
same per-layer caches every step, 32 to 128 tensors a side, so rereading them was
most of a call's CPU time. A value worked out from a sequence of tensors is kept here
and given back while each tensor is the same live object, at the same address, with
the same version counter:

- every in-place change of a tensor's metadata (``set_``, ``resize_``,
  ``as_strided_``, ``transpose_`` and the other in-place view ops) bumps its version
  counter, so a changed tensor is read again;
- a write to the data bumps it too: then the tensor's shape, strides, dtype and
  conjugate and negative bits are read and compared with those kept, and the value
  stays where they are equal (the KV caches an engine's attention writes every step);
- ``tensor.data = other`` changes no counter; the address is checked besides, so a
  tensor moved to other memory is read again. The one change not seen is ``.data =``
  given a view of the same memory at the same address (only its shape or strides
  differ): kvcopy does not keep up with it, which never reaches freed memory, since
  the view holds it;
- a tensor freed and another made at its ``id`` is another object: the entry holds
  weak references, never the tensors themselves (so their memory is never held);
- inference tensors (made under ``torch.inference_mode``) have no version counter:
  nothing read from them is kept, and they are read at every call.

Arrays have no version counter; what is compared at every call is all that reading
one finds (kvcopy._cuda.tensor_stamps.array_stamp), besides its identity:

- a NumPy array (``numpy.memmap`` too): its address, shape, strides, item size,
  format and writability, through the buffer protocol, so ``shape =``, ``dtype =``
  or ``flags.writeable =`` make it new. The entry holds a weak reference to it, which
  NumPy's in-place ``resize`` refuses, as it refuses one of an array that has views
  (``numpy.resize`` makes a new array);
- a ``__cuda_array_interface__`` producer (Numba, a custom allocator's wrapper): its
  interface, read again at every call and compared whole (address, writability,
  shape, strides, type). One that names a stream is read at every call: that stream
  is to be waited for each time. So is a JAX array, read through DLPack so that the
  computation writing it is ordered before each copy.

Like a tensor, an array holds its memory for as long as it lives (a producer that
does not, a view of memory freed under it, is the caller's error either way).

The check is one C loop (kvcopy._cuda.tensor_stamps) that calls torch.Tensor's own C
readers of the counter and the address: about 0.09 µs a tensor on a 2-core CPU host,
an eighth of reading it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Hashable, Sequence, TypeVar

import numpy as np

from kvcopy._cuda.tensor_stamps import array_stamp, identity_hash, stamps_hold
from kvcopy.interop.frameworks import framework_of, is_torch
from kvcopy.kept import dropper, make_room

T = TypeVar("T")


class _Entry:
    """One kept value: the tensors' weak references, version counters, addresses and
    metadata (shape, strides, dtype, conjugate and negative bits)."""

    __slots__ = ("refs", "versions", "addresses", "metas", "value")

    def __init__(self, refs: tuple, versions: tuple, addresses: tuple, metas: tuple, value: Any) -> None:
        self.refs, self.versions, self.addresses = refs, versions, addresses
        self.metas, self.value = metas, value

    def alive(self) -> bool:
        return all(ref() is not None for ref in self.refs)


def _meta(t: Any) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.is_conj(), t.is_neg())


def _stamps(tensors: Sequence[Any]) -> tuple[tuple, tuple, tuple] | None:
    """Each object's stamp (a torch tensor's version counter; an array's array_stamp),
    address and torch metadata (None for an array, whose stamp holds it), or None where
    one can be neither: a torch tensor with no version counter (an inference tensor) or
    no storage (sparse, nested: the reader names them), or an object that is no array
    kvcopy can stamp."""
    versions: list[Any] = []
    addresses: list[int] = []
    metas: list[tuple | None] = []
    for t in tensors:
        if is_torch(t):
            try:
                versions.append(t._version)  # (first: see _renewed)
                addresses.append(t.data_ptr())
                metas.append(_meta(t))
            except (RuntimeError, AttributeError):
                return None
            continue
        stamp = stamp_of(t)
        if stamp is None:
            return None
        versions.append(stamp[0])
        addresses.append(stamp[1])
        metas.append(None)
    return tuple(versions), tuple(addresses), tuple(metas)


def stamp_of(obj: Any) -> tuple | None:
    """``obj``'s array_stamp, (stamp, address), where what is read from it may be kept;
    None for a JAX array, which is read through DLPack at every call so that the
    computation writing it is ordered before the copy, and for what array_stamp cannot
    stamp. The one rule of what is kept of an array, for kept reads, layouts and the
    memory layouts hold."""
    return None if framework_of(obj) == "jax" else array_stamp(obj)


def may_keep(obj: Any) -> bool:
    """Whether what is read from ``obj`` may be kept (a cheap look at one object of a
    call; KeptReads stamps each): a torch tensor, a NumPy array or an array-interface
    producer, but not a JAX array (stamp_of)."""
    framework = framework_of(obj)
    if framework == "torch":
        return True
    if framework == "jax":
        return False
    if isinstance(obj, np.ndarray):
        return True
    try:
        return hasattr(obj, "__cuda_array_interface__")
    except Exception:  # noqa: BLE001 - (a producer whose interface raises: the reader names it)
        return False


class KeptReads:
    """Values worked out from sequences of torch tensors and arrays, bounded to ``limit`` entries
    (the oldest goes first), each kept while its tensors are unchanged (module doc).

    Thread-safe: a lookup reads one entry, which is never changed; a store replaces
    it whole."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._entries: dict[Hashable, _Entry] = {}
        self._lock = threading.Lock()

    def get(self, tensors: Sequence[Any], extra: Hashable, read: Callable[[], T]) -> T:
        """``read()``'s value for ``tensors`` and ``extra`` (see lookup)."""
        return self.lookup(tensors, extra, read)[0]

    def lookup(self, tensors: Sequence[Any], extra: Hashable, read: Callable[[], T]) -> tuple[T, bool]:
        """``read()``'s value for ``tensors`` and ``extra`` (whatever else the value
        depends on), and whether it is kept: kept from an earlier call where every
        tensor is the same object, unchanged; else ``read()`` now, kept unless it is
        None or a tensor cannot be stamped. An exception from ``read`` passes through
        and keeps nothing."""
        key = (extra, identity_hash(tensors))
        found = self._kept(key, tensors)
        if found is not None:
            return found.value, True
        # (stamped before the read: a change between the two makes the next call read
        # again, and never keeps an old value under a new stamp)
        stamps = _stamps(tensors)
        value = read()
        if value is None or stamps is None:
            return value, False
        return value, self._keep(key, tensors, stamps, value)

    def peek(self, tensors: Sequence[Any], extra: Hashable) -> Any | None:
        """The value kept for ``tensors`` and ``extra`` while they are unchanged (see
        lookup), else None; reads nothing from the tensors where nothing is kept."""
        found = self._kept((extra, identity_hash(tensors)), tensors)
        return None if found is None else found.value

    def _kept(self, key: tuple, tensors: Sequence[Any]) -> _Entry | None:
        """The entry under ``key`` where ``tensors`` are its tensors, unchanged (their
        data written to aside: _renewed), else None."""
        # (the key is a hash of identities; stamps_hold checks the identities)
        entry = self._entries.get(key)
        if entry is None:
            return None
        if stamps_hold(entry.refs, tensors, entry.versions, entry.addresses):
            return entry
        return self._renewed(key, entry, tensors)

    def _renewed(self, key: tuple, entry: _Entry, tensors: Sequence[Any]) -> _Entry | None:
        """``entry`` with the tensors' new version counters, where each tensor is the
        same object at the same address and those whose counter moved kept their
        metadata (a write to the data, as every step's attention makes to a KV cache);
        else None. Each counter is read before the metadata, so a change made meanwhile
        moves it past the one kept."""
        try:
            versions = []
            for ref, tensor, address, was in zip(entry.refs, tensors, entry.addresses, entry.versions):
                if ref() is not tensor:
                    return None
                if type(was) is not int:  # (an array: its stamp is compared whole)
                    if array_stamp(tensor) != (was, address):
                        return None
                    versions.append(was)
                    continue
                if tensor.data_ptr() != address:
                    return None
                versions.append(tensor._version)
            for tensor, was, now, meta in zip(tensors, entry.versions, versions, entry.metas):
                if now != was and _meta(tensor) != meta:
                    return None
        except (RuntimeError, AttributeError):
            return None
        renewed = _Entry(entry.refs, tuple(versions), entry.addresses, entry.metas, entry.value)
        with self._lock:
            if self._entries.get(key) is entry:  # (else dropped or replaced meanwhile)
                self._entries[key] = renewed
        return renewed

    def _keep(
        self, key: tuple, tensors: Sequence[Any], stamps: tuple[tuple, tuple, tuple], value: Any
    ) -> bool:
        try:
            refs = tuple(weakref.ref(t, dropper(self._entries, key)) for t in tensors)
        except TypeError:  # (an object that takes no weak reference)
            return False
        with self._lock:
            make_room(self._entries, self._limit)
            self._entries[key] = _Entry(refs, *stamps, value)
        return True

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


__all__ = ["KeptReads", "may_keep", "stamp_of"]
