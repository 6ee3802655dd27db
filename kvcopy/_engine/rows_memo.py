"""copy_rows calls with GPU indices, remembered per pair of layouts, so that the same
call again costs one launch instead of a whole plan.

A serving step moves the same layouts by index tensors it refills in place, on the
same stream, step after step. What copy_rows works out for such a call (the checks,
the memory's classes, the policy's answer, the kernel's job) depends only on the
layouts, which never change (kvcopy.Layout is frozen and holds its memory), on where
the index tensors are and how long, and on the stream, the method and the settings
the kernel's footprint comes from; the indices' values are read by the kernel when
it runs. So a call whose key matches the last one for its pair of layouts repeats
that call's launches.

Layouts are held weakly (the memo keeps no cache alive) and the index tensors not at
all (a new tensor at the same address is what the kernel will read). Launches built
in a context that is gone are built again. At most _KEPT pairs are remembered.
"""
from __future__ import annotations

import weakref
from typing import Any

from kvcopy._engine.rows import Repeat
from kvcopy._plans.rows import Indices
from kvcopy.config import config
from kvcopy.layouts import Layout

_KEPT = 64


class _Entry:
    __slots__ = ("src", "dst", "key", "repeat")

    def __init__(self, src: Layout, dst: Layout, key: tuple, repeat: Repeat) -> None:
        self.src, self.dst = weakref.ref(src), weakref.ref(dst)
        self.key, self.repeat = key, repeat


_memo: dict[tuple[int, int], _Entry] = {}


def _side(indices: Indices | None) -> tuple[int, int] | None:
    return None if indices is None else (indices.count, indices.device)


def call_key(src_indices: Indices | None, dst_indices: Indices | None, rows: Any,
             handle: int, method: str) -> tuple:
    """What, besides the layouts, a copy_rows call's launches depend on."""
    return (_side(src_indices), _side(dst_indices), rows, handle, method, config.host_ctas,
            config.device_ctas, config.peer_ctas, config.threads_per_cta)


def entry(src: Any, dst: Any) -> "_Entry | None":
    """The call remembered between these two layouts (so they were checked against each
    other), or None."""
    found = _memo.get((id(src), id(dst)))
    if found is None or found.src() is not src or found.dst() is not dst:
        return None
    return found


def repeat(found: "_Entry", key: tuple) -> Repeat | None:
    """The remembered call, where ``key`` is its key and it may run again."""
    if found.key != key:
        return None
    if not found.repeat.usable():
        _memo.pop((id(found.src()), id(found.dst())), None)
        return None
    return found.repeat


def remember(src: Layout, dst: Layout, key: tuple, again: Repeat) -> None:
    """Keep ``again`` as the call between these layouts with this key."""
    if len(_memo) >= _KEPT:
        for pair in [p for p, e in _memo.items() if e.src() is None or e.dst() is None]:
            del _memo[pair]
        if len(_memo) >= _KEPT:
            del _memo[next(iter(_memo))]   # the oldest remembered
    _memo[(id(src), id(dst))] = _Entry(src, dst, key, again)


def forget() -> None:
    """Drop every remembered call (tests; after changing what the key does not hold)."""
    _memo.clear()
