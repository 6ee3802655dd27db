"""Bounded stores of remembered answers drop their oldest entries first, also when
threads fill one at once (kvcopy.kept)."""
from __future__ import annotations

import threading

from kvcopy.kept import make_room


def test_make_room_drops_the_oldest_until_one_more_fits():
    store = {k: str(k) for k in range(5)}
    store[2] = "two"                 # (a value replaced keeps its place)
    make_room(store, 4)
    assert list(store) == [2, 3, 4]
    make_room(store, 10)
    assert list(store) == [2, 3, 4]
    make_room(store, 1)
    assert store == {}


def test_threads_filling_one_store_at_once_keep_it_bounded():
    store: dict = {}
    failures: list[BaseException] = []
    start = threading.Barrier(8)

    def fill(base: int) -> None:
        try:
            start.wait()
            for k in range(5000):
                make_room(store, 64)
                store[(base, k)] = k
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=fill, args=(j,)) for j in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert len(store) <= 64 + 8      # each thread may add one after making room
