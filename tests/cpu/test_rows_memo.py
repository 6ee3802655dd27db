"""copy_rows with GPU indices, repeated: the same call again (same layouts, index
tensors at the same addresses, stream, method and settings) repeats its launches
without planning or classifying again; anything else in the key plans afresh, and
the memo keeps no layout alive. The driver is faked (kvcopy.testing's seams)."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

import kvcopy
from kvcopy import testing
from kvcopy.testing import engine
from helpers.rows_fakes import DEVICE, PINNED, STREAM, GpuIndices, caches, install_rows_fakes

OTHER_STREAM = 0x4321


@pytest.fixture
def slot_memory():
    return np.zeros(1 << 16, np.uint8)  # the ring slot's host side: host indices go there


@pytest.fixture
def driver(seams, slot_memory):
    return install_rows_fakes(seams, slot_memory, DEVICE, PINNED)


def indices_of(call) -> tuple[int, int]:
    """(source indices' address, stream) of a recorded launch."""
    return call[2][0], call[7]


def test_the_same_call_again_repeats_its_launch_without_planning(driver):
    paged, chunk = caches()
    slots = GpuIndices(40)
    for _ in range(3):
        assert kvcopy.copy_rows(paged, chunk, slots, stream=STREAM) == "kernel"
    assert driver.classified == 2  # both sides once, by the first call only
    assert len(driver.calls) == 3 and len(set(driver.calls)) == 1
    assert indices_of(driver.calls[0]) == (0x7000_0000, STREAM)
    assert kvcopy.last_decision().method == "kernel"


@pytest.mark.parametrize("change", ["address", "count", "stream", "method", "ctas"])
def test_a_call_that_differs_in_its_key_is_planned_again(driver, change):
    paged, chunk = caches()
    kvcopy.copy_rows(paged, chunk, GpuIndices(40), stream=STREAM)
    slots, stream, method = GpuIndices(40), STREAM, "auto"
    if change == "address":
        slots = GpuIndices(40, 0x7100_0000)
    elif change == "count":
        slots = GpuIndices(20)
    elif change == "stream":
        stream = OTHER_STREAM
    elif change == "method":
        method = "kernel"
    with testing.settings(host_ctas=5 if change == "ctas" else None):
        kvcopy.copy_rows(paged, chunk, slots, stream=stream, method=method)
        kvcopy.copy_rows(paged, chunk, slots, stream=stream, method=method)
    assert driver.classified == 4  # planned twice, the second repeated
    first, second, third = driver.calls
    assert second == third
    if change == "address":
        assert indices_of(second) == (0x7100_0000, STREAM)
    elif change == "count":
        assert second[4] == 20
    elif change == "stream":
        assert indices_of(second) == (0x7000_0000, OTHER_STREAM)
    elif change == "ctas":
        assert driver.ctas[1:] == [5, 5]


def test_launches_whose_context_is_gone_are_built_again(driver):
    paged, chunk = caches()
    kvcopy.copy_rows(paged, chunk, GpuIndices(40), stream=STREAM)
    driver.context_alive = False
    kvcopy.copy_rows(paged, chunk, GpuIndices(40), stream=STREAM)
    assert driver.classified == 4 and len(driver.calls) == 2


def test_host_indices_are_checked_and_planned_at_every_call(driver):
    paged, chunk = caches()
    kvcopy.copy_rows(paged, chunk, GpuIndices(40), stream=STREAM)
    for _ in range(2):
        kvcopy.copy_rows(paged, chunk, np.arange(20), stream=STREAM)
    assert driver.classified == 6
    with pytest.raises(ValueError, match=r"src_indices\[1\] = 500 is out of range"):
        kvcopy.copy_rows(paged, chunk, [1, 500], stream=STREAM)


def test_bad_indices_between_known_layouts_are_refused_as_at_first(driver):
    paged, chunk = caches()
    kvcopy.copy_rows(paged, chunk, GpuIndices(40), stream=STREAM)
    calls = len(driver.calls)
    bad = GpuIndices(40)
    bad.__cuda_array_interface__ = dict(bad.__cuda_array_interface__, typestr="<i4")
    with pytest.raises(TypeError, match="src_indices: GPU indices must be int64"):
        kvcopy.copy_rows(paged, chunk, bad, stream=STREAM)
    with pytest.raises(ValueError, match="rows .41. differs from the indices' length .40."):
        kvcopy.copy_rows(paged, chunk, GpuIndices(40), rows=41, stream=STREAM)
    with pytest.raises(
        ValueError, match="must both be on the GPU or both on the host; got src_indices on the GPU"
    ):
        kvcopy.copy_rows(paged, chunk, GpuIndices(4), np.arange(4), stream=STREAM)
    assert len(driver.calls) == calls


def test_a_repeat_notes_its_traffic_as_the_first_call_did(driver):
    paged, chunk = caches()
    now = [100.0]
    with testing.fake_clock(lambda: now[0]):
        kvcopy.copy_rows(paged, chunk, GpuIndices(40), stream=STREAM)
        now[0] = 200.0
        kvcopy.copy_rows(paged, chunk, GpuIndices(40), stream=STREAM)
        assert engine.traffic_window.other_way_recent(0, "h2d", 1.0, OTHER_STREAM, 1)
    assert driver.classified == 2


def test_the_memo_keeps_no_layout_alive(driver):
    paged, chunk = caches()
    kvcopy.copy_rows(paged, chunk, GpuIndices(40), stream=STREAM)
    assert len(engine.rows_memo._memo) == 1
    gone = weakref.ref(paged)
    del paged
    gc.collect()
    assert gone() is None
    assert len(engine.rows_memo._memo) == 0  # its call went with it
    paged, _ = caches()  # a new layout is planned, whatever id it got
    kvcopy.copy_rows(paged, chunk, GpuIndices(40), stream=STREAM)
    assert driver.classified == 4


def test_threads_remembering_past_the_limit_at_once_keep_the_memo_whole(driver):
    """Many threads remembering calls between their own layouts at once, past the
    memo's limit: no thread fails, the memo holds at most its limit, and every entry
    left is found by its own layouts."""
    memo = engine.rows_memo
    layouts = [caches() for _ in range(4 * memo._KEPT)]
    failures: list[BaseException] = []
    start = threading.Barrier(8)

    class Again:
        def usable(self):
            return True

    def remember(part: list) -> None:
        try:
            start.wait()
            for pair in part:
                memo.remember(pair, ("key",), Again())
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=remember, args=(layouts[j::8],)) for j in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert len(memo._memo) == memo._KEPT  # every layout is alive: only the limit evicts
    for found in list(memo._memo.values()):
        assert memo.entry(*(ref() for ref in found.layouts)) is found


def test_a_call_per_layer_of_a_128_layer_model_is_remembered_for_each_layer(driver):
    """An engine moving 128 layers one copy_rows each, step after step, and a store and a
    load a layer: the second step repeats every call without classifying again."""
    pairs = [caches() for _ in range(2 * 128)]
    for _ in range(2):
        for paged, chunk in pairs:
            kvcopy.copy_rows(paged, chunk, GpuIndices(40), stream=STREAM)
    assert driver.classified == 2 * len(pairs)  # both sides of each pair, once
    assert len(driver.calls) == 2 * len(pairs)
