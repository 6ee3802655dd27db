"""Memory classified once per allocation: what the driver said of a swap_blocks plan's
or a copy_rows plan's memory (each side's kinds and device, and each tensor's or
plane's base as the device sees it), kept while the torch tensors that hold that
memory live.

Classifying asks the driver about every tensor's memory (cuPointerGetAttributes), at
every call until now; an engine passes the same caches every step. An entry is kept
under the plan's geometry (every tensor's address, extent and stride), the context
and the tensors' identities, and answers only while each of those tensors is alive
and is the one the call names. A live torch tensor holds its storage, so the memory
at those addresses is the allocation that was classified: its kind cannot have
changed. A tensor moved (``set_``, a ``resize_`` that reallocates) has new addresses,
so a new geometry; a new tensor at a freed tensor's address is another object.

Only torch tensors are kept: other objects (an array-interface producer over a custom
allocator's memory, say) need not hold the memory they describe. Memory page-locked
by hand (``cudaHostRegister``) must stay registered while kvcopy copies the tensor
over it; ``kvcopy.register`` forgets every entry when it unregisters.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvcopy.interop.frameworks import framework_of
from kvcopy.interop.kept_reads import stamp_of
from kvcopy.interop.protocols import byte_span
from kvcopy.interop.tensors import strided_access
from kvcopy.kept import dropper, make_room

# Enough for both directions of every layer of a 128-layer model called layer by layer.
_KEPT = 512
_STORE_CONTEXTS = 8  # contexts one geometry's store keeps memory for


@dataclass(frozen=True)
class KeptMemory:
    """One plan's memory as classified: ``found`` (the engine's MemoryClasses) and each
    side's bases as the device sees them (read-only)."""

    found: Any
    src_view: np.ndarray
    dst_view: np.ndarray
    owners: tuple  # weak references to the tensors, in the plan's order

    def alive(self) -> bool:
        return all(ref() is not None for ref in self.owners)

    def held_by(self, owners: tuple) -> bool:
        """Whether ``owners`` are, one by one, the live tensors this was classified for."""
        return len(owners) == len(self.owners) and all(
            ref() is tensor for ref, tensor in zip(self.owners, owners)
        )


_kept: dict[tuple, KeptMemory] = {}
_lock = threading.Lock()
_generation = 0  # bumped where memory may have changed kind under a live tensor


def _key(geometry_key: Any, context: int, owners: tuple) -> tuple:
    return (_generation, context, geometry_key, tuple(map(id, owners)))


def may_be_kept(owners: tuple) -> bool:
    """Whether memory read from ``owners`` may be kept, by the first one alone (a call's
    cheap look before find(); keep() checks every owner)."""
    return bool(owners) and framework_of(owners[0]) == "torch"


def keepable(owners: tuple) -> bool:
    """Whether memory read from ``owners`` may be kept: torch tensors, each holding its
    storage, and nothing else."""
    return bool(owners) and all(framework_of(t) == "torch" for t in owners)


def find(geometry_key: Any, context: int, owners: tuple) -> KeptMemory | None:
    """The memory kept for a plan of ``geometry_key`` over ``owners`` in ``context``,
    or None."""
    if geometry_key is None or not owners:
        return None
    entry = _kept.get(_key(geometry_key, context, owners))
    if entry is None or not entry.held_by(owners):
        return None  # (an id reused by another object)
    return entry


def keep(
    geometry_key: Any, context: int, owners: tuple, found: Any, src_view: np.ndarray, dst_view: np.ndarray
) -> None:
    """Keep what classification found for a plan over ``owners`` (all torch tensors,
    else nothing is kept); an entry leaves with the first of its tensors."""
    if geometry_key is None or not keepable(owners):
        return
    key = _key(geometry_key, context, owners)
    try:
        refs = tuple(weakref.ref(t, dropper(_kept, key)) for t in owners)
    except TypeError:  # (an object that takes no weak reference)
        return
    for view in (src_view, dst_view):
        view.flags.writeable = False
    with _lock:
        make_room(_kept, _KEPT)
        _kept[key] = KeptMemory(found, src_view, dst_view, refs)


class MemoryStore:
    """What the engine found of one set of tensors' memory, by context, held by what
    lives exactly as long as those tensors are the same live, unchanged objects (a
    KeptGeometry: kvcopy.interop.kept_reads checks them), so no owner is checked
    here. forget() empties every store. ``repeats``: the calls remembered over the
    same tensors (kvcopy._engine.repeats), which live as long."""

    __slots__ = ("by_context", "repeats", "__weakref__")

    def __init__(self) -> None:
        self.by_context: dict[int, KeptMemory] = {}
        self.repeats: dict[tuple, Any] = {}


_stores: "weakref.WeakSet[MemoryStore]" = weakref.WeakSet()


def new_store() -> MemoryStore:
    """An empty store, emptied by forget() while it lives."""
    store = MemoryStore()
    with _lock:
        _stores.add(store)
    return store


def find_in(store: MemoryStore, context: int) -> KeptMemory | None:
    """The memory kept in ``store`` for ``context``, or None."""
    return store.by_context.get(context)


def keep_in(store: MemoryStore, context: int, found: Any, src_view: np.ndarray, dst_view: np.ndarray) -> None:
    """Keep what classification found in ``store`` for ``context``."""
    for view in (src_view, dst_view):
        view.flags.writeable = False
    with _lock:
        if len(store.by_context) >= _STORE_CONTEXTS:  # (contexts come and go: bounded)
            store.by_context.clear()
        store.by_context[context] = KeptMemory(found, src_view, dst_view, ())


class HeldMemory:
    """The owner of one of kvcopy's own host allocations that NumPy arrays are made over
    (kvcopy.pinned_empty's, a pinned pool's views): an array whose chain of ``base``
    objects reaches one holds ``span`` (start, end) for as long as it lives, pinned and
    mapped, since the memory goes back only with the owner's last array and NumPy
    cannot point such an array elsewhere. Layouts over them are held as layouts over
    torch tensors are."""

    __slots__ = ("span", "__weakref__")

    def __init__(self, start: int, nbytes: int) -> None:
        self.span = (start, start + nbytes)


def held_span(array: Any) -> tuple[int, int] | None:
    """The span of kvcopy's own allocation that NumPy ``array`` is over (HeldMemory),
    or None for any other object."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return base.span if isinstance(base, HeldMemory) else None


def owned_span(owner: Any) -> tuple[int, int] | None:
    """The bytes ``owner`` (not a torch tensor) holds for as long as it lives, as
    (start, end): a NumPy array over kvcopy's own memory, that allocation (held_span);
    one whose chain of bases ends at an array that owns its data (NumPy's allocation)
    or at a memory map (``numpy.memmap``), that array's bytes; an array-interface
    producer that names no stream, the bytes its interface describes (the protocol's
    rule: the producer keeps its memory while it lives). None for anything else: an
    array over memory another object manages (a ctypes buffer made from an address),
    a producer naming a stream, a JAX array."""
    if isinstance(owner, np.ndarray):
        span = held_span(owner)
        if span is not None:
            return span
        root = owner
        while isinstance(root.base, np.ndarray):
            root = root.base
        if not (root.flags.owndata or isinstance(root.base, mmap.mmap)):
            return None
        face = root.__array_interface__
        return byte_span(face["data"][0], root.shape, root.strides, root.itemsize)
    if stamp_of(owner) is None:
        return None
    try:
        ptr, shape, strides, itemsize, _ = strided_access(owner, "keep")
    except (TypeError, ValueError):  # (an object a layout keeps that describes no array)
        return None
    return byte_span(ptr, shape, strides, itemsize)


def holds_planes(layout: Any) -> bool:
    """Whether what a layout keeps (torch tensors, arrays that hold their memory:
    owned_span) holds every byte of its planes: each plane, base to extent, inside one
    owner's memory (planes_inside). A layout built from pointers may keep a tensor for
    its lifetime only, over other memory: such a layout's memory is classified at every
    call."""
    return planes_inside(layout, layout.keep)


def planes_inside(layout: Any, owners: Sequence[Any]) -> bool:
    """Whether every plane of ``layout``, base to extent, lies inside the memory one of
    ``owners`` holds: each a torch tensor (its storage) or an array that holds its
    memory (owned_span); False where one is anything else."""
    if not owners:
        return False
    spans = []
    for owner in owners:
        if framework_of(owner) == "torch":
            storage = owner.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
            continue
        span = owned_span(owner)
        if span is None:
            return False
        spans.append(span)
    extent = layout.extent
    return all(any(lo <= base and base + extent <= hi for lo, hi in spans) for base in layout.bases.tolist())


# Layouts whose memory is held for as long as anyone can name them (a drop-in's
# layouts of its own tensors, handed out only while those tensors are the same live,
# unchanged objects), each with the stores of the pairs it is the source of.
_held: "weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[Any, dict[str, MemoryStore]]]" = (
    weakref.WeakKeyDictionary()
)


def hold_layout(layout: Any) -> None:
    """Mark ``layout`` as one whose planes stay the memory they were built over while the
    layout is in use (the caller's promise: it hands the layout out only while the
    tensors holding that memory live unchanged), so that what the driver says of a pair
    of such layouts is kept (layout_store)."""
    with _lock:
        _held.setdefault(layout, weakref.WeakKeyDictionary())


def release_layout(layout: Any) -> None:
    """Stop holding ``layout`` (hold_layout): its memory goes away (an opened peer's
    layout unmapped), so what was found of it, as either side of a pair, is dropped
    and a later call with it is classified again."""
    with _lock:
        _held.pop(layout, None)
        for by_dst in list(_held.values()):
            by_dst.pop(layout, None)


# Layouts found not to hold their planes (holds_planes), not asked again.
_unheld: "weakref.WeakSet[Any]" = weakref.WeakSet()


def held(layout: Any) -> bool:
    """Whether ``layout`` is held: marked so (hold_layout), or its own torch tensors hold
    every plane (holds_planes; asked once per layout: the caller checks at every call
    that those tensors have not moved, Layout.check_current, so they hold the same
    allocations for as long as the layout is used)."""
    if layout in _held:
        return True
    if layout in _unheld:
        return False
    if holds_planes(layout):
        hold_layout(layout)
        return True
    with _lock:
        _unheld.add(layout)
    return False


def layout_store(src: Any, dst: Any, asked: str) -> MemoryStore | None:
    """The store of what the engine found of the memory of a pair of held layouts for a
    call asking ``asked`` of the policy, or None where either is not held: marked so
    (hold_layout), or holding its planes in its own torch tensors, which the caller
    has checked are where they were when the layout was made (Layout.check_current).
    A store leaves with either layout."""
    if not (held(src) and held(dst)):
        return None
    by_dst = _held[src]
    stores = by_dst.get(dst)
    store = stores.get(asked) if stores is not None else None
    if store is None:
        store = new_store()
        with _lock:
            by_dst.setdefault(dst, {})[asked] = store
    return store


def forget() -> None:
    """Drop every entry: memory may have changed kind under a live tensor (host memory
    unregistered, a context reset)."""
    global _generation
    with _lock:
        _generation += 1
        _kept.clear()
        for store in list(_stores):
            store.by_context.clear()


def generation() -> int:
    """Bumped by every forget(): what was found of memory before is not to be trusted."""
    return _generation


def kept() -> int:
    """How many plans' memory is kept (for tests)."""
    return len(_kept) + sum(len(store.by_context) for store in list(_stores))
