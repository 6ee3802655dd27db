"""Bounded stores of remembered answers (dicts, in insertion order): the oldest goes
first, and an answer about objects that are freed goes with them."""

from __future__ import annotations

from typing import Callable, Hashable


def make_room(store: dict, limit: int) -> None:
    """Drop the oldest entries of ``store`` until it holds fewer than ``limit``. Safe
    where other threads do the same at once (an entry another thread dropped first is
    passed over)."""
    while len(store) >= limit:
        try:
            del store[next(iter(store))]
        except StopIteration:  # (emptied: a limit of 0 holds nothing)
            return
        except (KeyError, RuntimeError):  # (changed under us: look again)
            continue


def dropper(store: dict, key: Hashable) -> Callable[[object], None]:
    """A weak reference's callback that drops ``store[key]`` where the entry there (an
    object with ``alive()``) holds a freed object: an entry leaves with the first of
    its objects, and a full store never scans for such entries. It takes no lock (a
    collection may run it in a thread that is changing the store) and leaves a live
    entry that took the key meanwhile."""

    def gone(_ref: object) -> None:
        found = store.get(key)
        if found is not None and not found.alive():
            store.pop(key, None)

    return gone
