"""Bounded stores of remembered answers (dicts, in insertion order): the oldest goes
first."""
from __future__ import annotations


def make_room(store: dict, limit: int) -> None:
    """Drop the oldest entries of ``store`` until it holds fewer than ``limit``. Safe
    where other threads do the same at once (an entry another thread dropped first is
    passed over)."""
    while len(store) >= limit:
        try:
            del store[next(iter(store))]
        except (KeyError, RuntimeError, StopIteration):   # (changed under us: look again)
            continue
