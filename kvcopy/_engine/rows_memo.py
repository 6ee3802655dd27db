"""copy_rows and copy_rows_both_ways calls remembered per set of layouts, so that the
same call again costs its launches instead of a whole plan: calls with GPU indices,
staged pairs, and layout-kernel calls with host indices between layouts that hold
their memory and share none (kvcopy._engine.rows.HostRepeat).

A serving step moves the same layouts by index tensors it refills in place, on the
same stream, step after step. What such a call works out (the checks, the memory's
classes, the policy's answer, the kernel's jobs, a staged pair's chunks) depends only
on the layouts, which never change (kvcopy.Layout is frozen and holds its memory; one
whose torch tensor moved is planned anew, which refuses it), on
where the index tensors are and how long, and on the stream, the method and the
settings its work is shaped by; the indices' values are read by the kernel when it
runs. So a call whose key matches the last one for its layouts repeats that call's
work. Calls with host indices are remembered too (keyed by their lengths: a staged
copy_rows_both_ways pair, a copy_rows call by the layout kernel): their values are
checked at every call before the call is repeated, and uploaded anew; only the
memory's classes, the policy's answer and the launches or chunks are not worked out
again. The key holds every setting and device fact the policy reads (their epoch)
and kvcopy._runtime.kept_memory's generation, which unregistering memory bumps.

Layouts are held weakly (the memo keeps no cache alive) and the index tensors not at
all (a new tensor at the same address is what the kernel will read). Work built in a
context that is gone is built again. At most _KEPT sets of layouts are remembered.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from typing import Any, Callable, Protocol

from kvcopy import policy
from kvcopy._cuda.rows_repeat import repeat_gpu_rows
from kvcopy._plans.rows import Indices
from kvcopy._runtime import device, kept_memory
from kvcopy.config import changes, config
from kvcopy.kept import dropper, make_room
from kvcopy.layouts import Layout

# (an engine moving a 128-layer model layer by layer makes a call a layer for each op:
# each of them is repeated; an entry is a few hundred bytes of launch arguments)
_KEPT = 1024


class Again(Protocol):
    """What repeats a remembered call (kvcopy._cuda.rows_repeat.GpuRowsRepeat,
    kvcopy._engine.rows.HostRepeat, a staged pair)."""

    def usable(self) -> bool: ...


class _Entry:
    __slots__ = ("layouts", "key", "repeat")

    def __init__(
        self,
        layouts: tuple[Layout, ...],
        key: tuple,
        repeat: Any,
        gone: Callable[[object], None] | None = None,
    ) -> None:
        self.layouts = tuple(weakref.ref(layout, gone) for layout in layouts)
        self.key, self.repeat = key, repeat

    def holds(self, layouts: tuple[Any, ...]) -> bool:
        return len(layouts) == len(self.layouts) and all(
            ref() is layout for ref, layout in zip(self.layouts, layouts)
        )

    def alive(self) -> bool:
        return all(ref() is not None for ref in self.layouts)


_memo: dict[tuple[int, ...], _Entry] = {}
_changing = threading.Lock()  # (lookups read the dict as it stands; changes take turns)


def _side(indices: Indices | None) -> tuple[int, int] | None:
    return None if indices is None else (indices.count, indices.device)


def call_key(
    src_indices: Indices | None, dst_indices: Indices | None, rows: Any, handle: int, method: str
) -> tuple:
    """What, besides the layouts, a copy_rows call's launches depend on."""
    return (
        _side(src_indices),
        _side(dst_indices),
        rows,
        handle,
        method,
        epoch_now(),
    )


def epoch_now() -> tuple[int, int, int]:
    """The counters of every device fact and setting the policy reads, and of memory
    that may have changed kind under a layout (kvcopy.register's unregistering): a
    remembered call is repeated only under the same (EPOCH_SOURCES names them)."""
    return device.generation, changes(), kept_memory.generation()


# where epoch_now's counters live, for the repeat in C to read (module, attribute; the
# settings' module by name: the package's ``config`` is the settings object)
EPOCH_SOURCES = (
    (device, "generation"),
    (importlib.import_module("kvcopy.config"), "_changes"),
    (kept_memory, "_generation"),
)


def pair_key(store_key: tuple, load_key: tuple) -> tuple:
    """What, besides the four layouts, a copy_rows_both_ways call's work depends on
    (each side's call_key, and the staged path's settings)."""
    return (
        store_key,
        load_key,
        config.staging_bytes,
        policy.ROWS_STAGING_MIN_BYTES,
        policy.ROWS_STAGING_MAX_PLANES,
        policy.STAGING_CTAS,
    )


def entry(*layouts: Any) -> "_Entry | None":
    """The call remembered between these layouts, in this order (so they were checked
    against each other), or None."""
    found = _memo.get(tuple(map(id, layouts)))
    if found is None or not found.holds(layouts):
        return None
    if any(layout.moved() is not None for layout in layouts):
        return None  # (planned anew, which names the tensor that moved)
    return found


def repeat(found: "_Entry", key: tuple) -> Any:
    """What repeats the remembered call, where ``key`` is its key and it may run again;
    else None."""
    if found.key != key:
        return None
    if not found.repeat.usable():
        with _changing:
            _memo.pop(tuple(id(ref()) for ref in found.layouts), None)
        return None
    return found.repeat


def repeat_gpu(src: Layout, dst: Layout, a: Any, b: Any, rows: Any, stream: Any, method: Any) -> str | None:
    """copy_rows(src, dst, a, b, rows=rows, stream=stream, method=method) issued again
    from C where the call between these layouts was remembered with its indices on the
    GPU and this is the same call (kvcopy._cuda.rows_repeat): 'kernel'. Else None,
    nothing issued."""
    return repeat_gpu_rows(_memo, src, dst, a, b, rows, stream, method)


def remember(layouts: tuple[Layout, ...], key: tuple, again: Again) -> None:
    """Keep ``again`` as the call between these layouts with this key (thread-safe)."""
    at = tuple(map(id, layouts))
    with _changing:
        if at not in _memo:
            make_room(_memo, _KEPT)  # (entries of freed layouts are gone already)
        _memo[at] = _Entry(layouts, key, again, dropper(_memo, at))


def forget() -> None:
    """Drop every remembered call (tests; after changing what the key does not hold)."""
    with _changing:
        _memo.clear()
