"""Bounded stores of remembered answers drop their oldest entries first, also when
threads fill one at once (kvcopy.kept)."""

from __future__ import annotations

import threading

from kvcopy.kept import make_room


def test_make_room_drops_the_oldest_until_one_more_fits():
    store = {k: str(k) for k in range(5)}
    store[2] = "two"  # (a value replaced keeps its place)
    make_room(store, 4)
    assert list(store) == [2, 3, 4]
    make_room(store, 10)
    assert list(store) == [2, 3, 4]
    make_room(store, 1)
    assert store == {}
    make_room(store, 0)  # (nothing to drop: it returns)
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
    assert len(store) <= 64 + 8  # each thread may add one after making room


def test_an_entry_goes_with_its_freed_object_but_not_a_live_one_at_its_key():
    import gc
    import weakref

    from kvcopy.kept import dropper

    class Thing:
        pass

    class Entry:
        def __init__(self, thing: Thing, gone) -> None:
            self.ref = weakref.ref(thing, gone)

        def alive(self) -> bool:
            return self.ref() is not None

    store: dict = {}
    first, second = Thing(), Thing()
    store["k"] = Entry(first, dropper(store, "k"))
    store["j"] = Entry(second, dropper(store, "j"))
    del first
    gc.collect()
    assert list(store) == ["j"]
    third = Thing()
    old = store["j"]
    store["j"] = Entry(third, dropper(store, "j"))  # a live entry took the key
    del second, old
    gc.collect()
    assert list(store) == ["j"] and store["j"].alive()
    del third
    gc.collect()
    assert store == {}
