"""The drop-ins' layouts are kept for the same tensor objects while those are unchanged,
and never for another tensor, a changed one, or a table whose contents changed; a kept
layout keeps no tensor alive (kvcopy.compat.kept_layouts)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from kvcopy import Layout
from kvcopy.compat import sglang
from kvcopy.compat.kept_layouts import kept_layout

torch = pytest.importorskip("torch")


def _rows(t) -> Layout:
    return Layout.of(t, slot=0)


def test_the_same_tensors_and_arguments_get_the_same_layout():
    t = torch.zeros((8, 16), dtype=torch.uint8)
    first = kept_layout([t], ("rows",), lambda: _rows(t))
    assert kept_layout([t], ("rows",), lambda: _rows(t)) is first
    assert kept_layout([t], ("other",), lambda: _rows(t)) is not first
    assert first.keep == () and first.bases.tolist() == [t.data_ptr()]
    layers = [torch.zeros((4, 8)) for _ in range(3)]
    assert sglang._token_rows(layers, "l") is sglang._token_rows(layers, "l")


def test_a_changed_or_new_tensor_is_described_anew():
    t = torch.zeros((8, 16), dtype=torch.uint8)
    first = kept_layout([t], ("rows",), lambda: _rows(t))
    t.set_(torch.zeros((8, 16), dtype=torch.uint8).untyped_storage())  # new memory, same shape
    moved = kept_layout([t], ("rows",), lambda: _rows(t))
    assert moved is not first and moved.bases.tolist() == [t.data_ptr()]
    memory = np.zeros((8, 16), np.uint8)
    a = torch.from_numpy(memory)
    kept = kept_layout([a], ("rows",), lambda: _rows(a))  # noqa: F821 - called before the del
    del a
    b = torch.from_numpy(memory)  # another tensor at the same address, shape and strides
    assert kept_layout([b], ("rows",), lambda: _rows(b)) is not kept


def test_a_tables_contents_count_and_a_caches_do_not():
    table = torch.tensor([4096, 8192])
    first = kept_layout(
        [table], ("t",), lambda: Layout.from_pointers(table.tolist(), slots=4, row_bytes=8), contents=True
    )
    cache = torch.zeros((8, 16))
    kept = kept_layout([cache], ("rows",), lambda: _rows(cache))
    table[1] = 12288
    cache[3] = 1.0  # an engine writing its cache: still the same layout
    again = kept_layout(
        [table], ("t",), lambda: Layout.from_pointers(table.tolist(), slots=4, row_bytes=8), contents=True
    )
    assert again is not first and again.bases.tolist() == [4096, 12288]
    assert kept_layout([cache], ("rows",), lambda: _rows(cache)) is kept


def test_a_kept_layout_keeps_no_tensor_alive_and_a_failed_build_keeps_nothing():
    t = torch.zeros((8, 16))
    kept_layout([t], ("rows",), lambda: _rows(t))  # noqa: F821 - called before the del
    gone = weakref.ref(t)
    del t
    gc.collect()
    assert gone() is None
    calls = []

    def build():
        calls.append(1)
        raise ValueError("no")

    u = torch.zeros(4)
    for _ in range(2):
        with pytest.raises(ValueError, match="no"):
            kept_layout([u], ("bad",), build)
    assert len(calls) == 2
    with pytest.raises(TypeError, match="src_layers must be a list of tensors"):
        sglang.transfer_kv_direct(u, [u], [0], [0], 1)


def test_inference_tensors_have_no_version_and_their_contents_count_as_fixed():
    from kvcopy.compat import pointer_tables

    with torch.inference_mode():
        table = torch.tensor([4096, 8192])
        cache = torch.zeros((8, 16))
    assert pointer_tables.addresses_of(table, "t") == [4096, 8192]
    first = kept_layout([table, cache], ("t",), lambda: _rows(cache), contents=True)
    assert kept_layout([table, cache], ("t",), lambda: _rows(cache), contents=True) is first
    with torch.inference_mode():
        table[1] = 12288  # no version to see it by: a table that changes is a new tensor
    assert pointer_tables.addresses_of(table, "t") == [4096, 8192]
    with torch.inference_mode():
        new = table.clone()
    assert pointer_tables.addresses_of(new, "t") == [4096, 12288]


def test_a_value_leaves_the_store_with_its_tensor():
    from kvcopy.compat.per_tensors import PerTensors

    store = PerTensors(8)
    a, b = torch.zeros(4), torch.zeros(4)
    store.get([a, b], (), lambda: "a and b")
    store.get([a], (), lambda: "a")
    assert len(store) == 2
    del b
    gc.collect()
    assert len(store) == 1  # without a scan or an insert
    assert store.get([a], (), lambda: "a again") == "a"


def test_a_full_store_drops_gone_tensors_first_then_the_oldest():
    from kvcopy.compat.per_tensors import PerTensors

    store = PerTensors(3)
    a, b, c = (torch.zeros(4) for _ in range(3))
    kept = {name: store.get([t], (), lambda name=name: name) for name, t in zip("abc", (a, b, c))}
    assert kept == {"a": "a", "b": "b", "c": "c"}
    del b
    gc.collect()
    d = torch.zeros(4)
    assert store.get([d], (), lambda: "d") == "d"  # b's place, b being gone
    assert len(store) == 3
    assert store.get([a], (), lambda: "a again") == "a"  # a, the oldest, still kept
    e = torch.zeros(4)
    assert store.get([e], (), lambda: "e") == "e"  # full and alive: a goes
    assert store.get([a], (), lambda: "a again") == "a again"
    assert store.get([d], (), lambda: "d again") == "d"


def test_a_128_layer_model_moved_layer_by_layer_stays_kept():
    """SGLang's per-layer load (page-first host to each layer's K and V) and backup
    (each layer's K and V to layer-first host) of a 128-layer model: every layout the
    second pass asks for is the one the first pass built."""
    layers, item = 128, 16
    host_k, host_v = (torch.zeros((8, layers * item), dtype=torch.uint8) for _ in range(2))
    dev = [
        (torch.zeros((8, item), dtype=torch.uint8), torch.zeros((8, item), dtype=torch.uint8))
        for _ in range(layers)
    ]
    back = [
        (torch.zeros((8, item), dtype=torch.uint8), torch.zeros((8, item), dtype=torch.uint8))
        for _ in range(layers)
    ]

    def one_pass() -> list:
        found = []
        for layer in range(layers):
            found.append(sglang._buffers((host_k, host_v), ("k", "v"), item, layers * item, layer * item))
            found.append(sglang._buffers(dev[layer], ("k", "v"), item, item))
            found.append(sglang._buffers(back[layer], ("k", "v"), item, item))
        return found

    first = one_pass()
    assert all(again is kept for again, kept in zip(one_pass(), first))


def test_an_unchanged_tensor_is_not_read_again_and_a_written_one_once(monkeypatch):
    """The facts a kept layout rests on are read where a tensor's version counter moved
    (a write to its data), once: the counter is noted again; while counters and
    addresses stand, nothing is read. Resizing it in place is still seen."""
    from kvcopy.compat import per_tensors

    reads = []
    real = per_tensors._facts
    monkeypatch.setattr(per_tensors, "_facts", lambda *args: reads.append(1) or real(*args))
    t = torch.zeros((8, 16), dtype=torch.uint8)
    first = kept_layout([t], ("rows",), lambda: _rows(t))
    assert kept_layout([t], ("rows",), lambda: _rows(t)) is first and len(reads) == 1
    t[2] = 7  # (a write: the counter moves, the facts stand)
    assert kept_layout([t], ("rows",), lambda: _rows(t)) is first and len(reads) == 2
    assert kept_layout([t], ("rows",), lambda: _rows(t)) is first and len(reads) == 2
    t.resize_(4, 16)
    resized = kept_layout([t], ("rows",), lambda: _rows(t))
    assert resized is not first and resized.slots == 4


def test_inference_tensors_are_checked_by_their_facts_at_every_call(monkeypatch):
    from kvcopy.compat import per_tensors

    reads = []
    real = per_tensors._facts
    monkeypatch.setattr(per_tensors, "_facts", lambda *args: reads.append(1) or real(*args))
    with torch.inference_mode():
        t = torch.zeros((8, 16), dtype=torch.uint8)
    first = kept_layout([t], ("rows",), lambda: _rows(t))
    assert kept_layout([t], ("rows",), lambda: _rows(t)) is first and len(reads) == 2
