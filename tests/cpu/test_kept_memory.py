"""Memory classified once per allocation (kvcopy._runtime.kept_memory), on the CPU with
the driver layer faked (bench/cpu_calls.py's fake): a swap_blocks call repeated over the
same live torch tensors asks the driver about their memory once; another tensor, a
moved one, a freed one, memory unregistered, or objects other than torch tensors are
classified again."""

from __future__ import annotations

import ctypes
import gc

import cpu_calls  # bench/cpu_calls.py (tests/conftest.py puts bench/ on the path)
import numpy as np
import pytest

import kvcopy
from kvcopy.testing import engine
from helpers.producers import Interface

torch = pytest.importorskip("torch")
kept_memory = engine.kept_memory
ONE = np.array([[1, 2]])


@pytest.fixture
def host():
    fake = cpu_calls.FakeHost([])
    with fake.standing_in():
        yield fake


def classifications(host, src, dst, calls: int = 1) -> int:
    """How often ``calls`` swap_blocks calls from src to dst asked the driver to
    classify memory (one question per side)."""
    host.counts.clear()
    for _ in range(calls):
        kvcopy.swap_blocks(src, dst, ONE, stream=0x7F00_1234)
    return host.counts["classify.classify_pointers"] // 2


def caches(layers: int = 4) -> list:
    return [torch.zeros(8, 256, dtype=torch.uint8) for _ in range(layers)]


def test_the_same_live_tensors_are_classified_once(host):
    src, dst = caches(), caches()
    assert classifications(host, src, dst, calls=5) == 1
    assert classifications(host, dst, src) == 1  # (the other way is another plan)
    assert classifications(host, dst, src, calls=3) == 0


def test_another_tensor_at_the_same_place_is_classified_again(host):
    src, dst = caches(), caches()
    classifications(host, src, dst)
    same_memory = [t.view(8, 256) for t in src]  # other objects over the same memory
    assert classifications(host, same_memory, dst) == 1


def test_a_moved_tensor_is_classified_again(host):
    src, dst = caches(), caches()
    classifications(host, src, dst)
    src[2].set_(torch.zeros(8, 256, dtype=torch.uint8).untyped_storage(), 0, (8, 256))
    assert classifications(host, src, dst) == 1
    assert classifications(host, src, dst) == 0


def test_caches_written_between_calls_are_classified_once(host):
    """An engine's attention writes its GPU cache every step, which bumps each tensor's
    version counter: the tensors are the same, and so is their memory."""
    src, dst = caches(), caches()
    classifications(host, src, dst)
    for step in range(3):
        for tensor in src:
            tensor.fill_(step)
        assert classifications(host, src, dst) == 0


def test_inference_tensors_are_classified_once(host):
    """Inference tensors have no version counter: their geometry is read at every call,
    their memory known again by the tensors themselves."""
    with torch.inference_mode():
        src, dst = caches(), caches()
    assert classifications(host, src, dst, calls=3) == 1


def test_an_entry_leaves_with_its_first_freed_tensor(host):
    src, dst = caches(), caches()
    classifications(host, src, dst)
    assert kept_memory.kept() == 1
    src.pop()
    dst.pop()
    gc.collect()
    assert kept_memory.kept() == 0


def test_forgetting_classifies_every_tensor_again(host):
    src, dst = caches(), caches()
    classifications(host, src, dst)
    kept_memory.forget()
    assert classifications(host, src, dst) == 1


def test_registering_or_unregistering_host_memory_forgets_what_was_kept(host):
    """kvcopy.register makes a tensor's memory pinned, and its unregistration pageable
    again: nothing classified before either is trusted after it."""
    host.answers.update(
        {
            "memory.host_register": lambda ptr, size, readonly: None,
            "memory.host_unregister": lambda ptr: None,
            "memory.host_device_pointer": lambda ptr: ptr,
        }
    )
    src, dst = caches(), caches()
    classifications(host, src, dst)
    with kvcopy.register(dst[0].numpy()):
        assert kept_memory.kept() == 0
        assert classifications(host, src, dst, calls=2) == 1
        assert kept_memory.kept() == 1
    assert kept_memory.kept() == 0
    assert classifications(host, src, dst) == 1


def test_the_same_live_numpy_arrays_are_classified_once(host):
    src = [np.zeros((8, 256), np.uint8) for _ in range(4)]
    dst = [np.zeros((8, 256), np.uint8) for _ in range(4)]
    assert classifications(host, src, dst, calls=5) == 1
    dst[2].shape = (16, 128)  # (in place: another geometry, read and classified again)
    with pytest.raises(ValueError, match=r"dst\[2\]"):
        kvcopy.swap_blocks(src, dst, ONE, stream=0x7F00_1234)
    dst[2].shape = (8, 256)  # (as it was: what was kept holds again)
    assert classifications(host, src, dst) == 0
    dst[2].flags.writeable = False
    with pytest.raises(ValueError, match=r"^dst\[2\] is read-only$"):
        kvcopy.swap_blocks(src, dst, ONE, stream=0x7F00_1234)
    dst[2] = np.zeros((16, 256), np.uint8)  # (another array, other memory: classified once)
    assert classifications(host, src, dst, calls=3) == 1


def test_arrays_made_anew_at_every_call_are_classified_at_every_call(host):
    src = [np.zeros((8, 256), np.uint8) for _ in range(4)]
    dst = [np.zeros((8, 256), np.uint8) for _ in range(4)]
    host.counts.clear()
    for _ in range(3):
        kvcopy.swap_blocks([a[:] for a in src], dst, ONE, stream=0x7F00_1234)
    assert host.counts["classify.classify_pointers"] // 2 == 3


def test_the_benchmarks_torch_row_classifies_once():
    """bench/cpu_calls.py's row of 32 torch tensors a side: steady calls classify
    nothing, and issue as before (one launch of the layout kernel)."""
    stand_ins = cpu_calls.torch_stand_ins()
    fake = cpu_calls.FakeHost(cpu_calls.host_pools()[:1], stand_ins[:32])
    with fake.standing_in():
        call = dict(cpu_calls.rows(fake, cpu_calls.host_pools(), stand_ins))[
            "swap_blocks 1 pair, 32 torch tensors a side"
        ]
        call()
        fake.counts.clear()
        call()
        assert "classify.classify_pointers" not in fake.counts
        assert fake.counts["rows.RowsLaunches.launch"] == 1


def row_classifications(host, src, dst, calls: int = 1) -> int:
    """How often ``calls`` copy_rows calls (host indices) classified memory."""
    host.counts.clear()
    rows = np.array([3, 1, 4], dtype=np.int64)
    for _ in range(calls):
        kvcopy.copy_rows(src, dst, rows, rows, stream=0x7F00_1234)
    return host.counts["classify.classify_pointers"] // 2


def test_layouts_of_the_same_live_tensors_are_classified_once(host):
    src, dst = caches(2), caches(2)
    a, b = kvcopy.Layout.of(src, slot=0), kvcopy.Layout.of(dst, slot=0)
    assert row_classifications(host, a, b, calls=4) == 1
    again = kvcopy.Layout.of(src, slot=0)  # (another layout of the same tensors)
    assert row_classifications(host, again, b) == 0


def test_a_layout_over_memory_its_tensors_do_not_hold_is_classified_at_every_call(host):
    """A layout from pointers may keep a tensor for its lifetime only, its planes
    elsewhere: what those planes are on is asked at every call."""
    held, elsewhere = caches(1)[0], np.zeros((8, 256), np.uint8)
    a = kvcopy.Layout.from_pointers([elsewhere.ctypes.data], slots=8, row_bytes=256, keep=(held,))
    b = kvcopy.Layout.of(caches(1), slot=0)
    assert row_classifications(host, a, b, calls=3) == 3


class _KvcopyMemory(kept_memory.HeldMemory):
    """Stands in for kvcopy's own host allocations (pinned_empty's, a pool's views):
    NumPy arrays made over it hold its span."""

    __slots__ = ("buffer", "__array_interface__")

    def __init__(self, nbytes: int) -> None:
        self.buffer = np.zeros(nbytes, np.uint8)
        super().__init__(self.buffer.ctypes.data, nbytes)
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (self.buffer.ctypes.data, False),
            "version": 3,
        }


def test_layouts_of_arrays_over_kvcopys_own_memory_are_classified_once(host):
    held = np.asarray(_KvcopyMemory(8 * 256)).reshape(8, 256)[2:]  # (a view of a view)
    a = kvcopy.Layout.of(held, slot=0)
    b = kvcopy.Layout.of(caches(1), slot=0)
    assert row_classifications(host, a, b, calls=4) == 1
    assert row_classifications(host, b, a, calls=3) == 1
    # one over memory nothing holds for it (a ctypes buffer made from an address): at every call
    over = np.zeros(6 * 256, np.uint8)
    unheld = np.frombuffer((ctypes.c_uint8 * over.nbytes).from_address(over.ctypes.data), np.uint8)
    assert row_classifications(host, kvcopy.Layout.of(unheld.reshape(6, 256), slot=0), b, calls=2) == 2


def test_layouts_of_arrays_that_hold_their_memory_are_classified_once(host, tmp_path):
    """A NumPy array of its own (a view of one too), a memory map, an array-interface
    producer that names no stream: each holds the bytes it describes while it lives."""
    b = kvcopy.Layout.of(caches(1), slot=0)
    mapped = np.memmap(tmp_path / "cache", dtype=np.uint8, mode="w+", shape=(6, 256))
    for array in (np.zeros((6, 256), np.uint8), np.zeros((12, 256), np.uint8)[::2], mapped):
        assert row_classifications(host, kvcopy.Layout.of(array, slot=0), b, calls=3) == 1
    producer = Interface(cpu_calls.DEVICE_BASE, (6, 256))
    assert row_classifications(host, kvcopy.Layout.of(producer, slot=0), b, calls=3) == 1
    streamed = Interface(cpu_calls.DEVICE_BASE, (6, 256), stream=0x7F00_1234)
    assert row_classifications(host, kvcopy.Layout.of(streamed, slot=0), b, calls=2) == 2


def test_a_layout_keeping_an_object_whose_interface_describes_no_array_is_classified_each_call(host):
    """A layout from pointers may keep any object; one whose interface is malformed
    holds nothing kvcopy can tell, and the calls go on as for any unheld layout."""
    memory = np.zeros((6, 256), np.uint8)
    odd = Interface(memory.ctypes.data, (-6, 256))  # (a negative extent: no array)
    a = kvcopy.Layout.from_pointers([memory.ctypes.data], slots=6, row_bytes=256, keep=(odd,))
    b = kvcopy.Layout.of(caches(1), slot=0)
    assert kept_memory.owned_span(odd) is None
    assert row_classifications(host, a, b, calls=2) == 2


def test_a_layout_whose_array_changed_is_refused_by_name(host):
    array = np.zeros((6, 256), np.uint8)
    a, b = kvcopy.Layout.of(array, slot=0), kvcopy.Layout.of(caches(1), slot=0)
    assert row_classifications(host, a, b, calls=2) == 1
    array.shape = (12, 128)
    with pytest.raises(ValueError, match=r"^src: tensor 0 of the layout has moved or changed shape"):
        row_classifications(host, a, b)
    array.shape = (6, 256)
    assert row_classifications(host, a, b) == 0


def test_held_span_follows_an_arrays_bases_to_kvcopys_own_memory():
    memory = _KvcopyMemory(4096)
    start = memory.buffer.ctypes.data
    view = np.asarray(memory)[1024:].view(np.int32).reshape(8, -1)
    assert kept_memory.held_span(view) == (start, start + 4096)
    assert kept_memory.held_span(np.zeros(4)) is None
    assert kept_memory.held_span(memory.buffer) is None


def test_a_store_and_a_load_at_once_over_the_same_tensors_are_classified_once():
    """swap_blocks_both_ways of a GPU cache's store to host and a load back, repeated:
    each direction's memory is asked of the driver at the first call only, and both
    go out in one launch at every call."""
    gpu, cpu = caches(), caches()
    store, load = np.array([[1, 2]]), np.array([[3, 4]])
    host = cpu_calls.FakeHost([], gpu)  # (gpu's memory answers as device memory)
    host.answers["launch.blocks_both_upload_bytes"] = lambda *args: 4096
    host.answers["launch.launch_blocks_both_uploaded"] = lambda *args: 1
    with host.standing_in():
        store_and_load_twice(host, gpu, cpu, store, load)


def store_and_load_twice(host, gpu: list, cpu: list, store: np.ndarray, load: np.ndarray) -> None:
    for _ in range(4):
        assert kvcopy.swap_blocks_both_ways((gpu, cpu, store), (cpu, gpu, load), stream=0x7F00_1234) == (
            "kernel",
            "kernel",
        )
    assert host.counts["classify.classify_pointers"] == 4  # (two sides a direction, once)
    moved = torch.zeros(8, 256, dtype=torch.uint8)
    cpu[1].set_(moved.untyped_storage(), 0, (8, 256))
    host.counts.clear()
    kvcopy.swap_blocks_both_ways((gpu, cpu, store), (cpu, gpu, load), stream=0x7F00_1234)
    assert host.counts["classify.classify_pointers"] == 4


def test_a_store_and_a_load_at_once_over_the_same_arrays_are_classified_once():
    """The same over a GPU array-interface producer per layer and NumPy arrays on the
    host: each direction's memory asked at the first call only; another host array in
    a layer's place is asked about again."""
    pools = cpu_calls.host_pools()
    host = cpu_calls.FakeHost(pools)
    host.answers["launch.blocks_both_upload_bytes"] = lambda *args: 4096
    host.answers["launch.launch_blocks_both_uploaded"] = lambda *args: 1
    gpu = [cpu_calls.GpuArray((64, 2048), cpu_calls.DEVICE_BASE + k * 64 * 2048) for k in range(4)]
    cpu = list(pools[1:5])
    with host.standing_in():
        for _ in range(4):
            ran = kvcopy.swap_blocks_both_ways((gpu, cpu, [[1, 2]]), (cpu, gpu, [[3, 4]]), stream=0x7F00_1234)
            assert ran == ("kernel", "kernel")
        assert host.counts["classify.classify_pointers"] == 4  # (two sides a direction, once)
        assert host.counts["launch.launch_blocks_both_uploaded"] == 4
        cpu[1] = pools[5]
        host.counts.clear()
        kvcopy.swap_blocks_both_ways((gpu, cpu, [[1, 2]]), (cpu, gpu, [[3, 4]]), stream=0x7F00_1234)
        assert host.counts["classify.classify_pointers"] == 4


def sglang_classifications(host, k_src, k_dst, v_src, v_dst, calls: int = 1) -> int:
    """How often ``calls`` of SGLang's per-layer transfer (host indices) classified memory."""
    from kvcopy.compat import sglang

    host.counts.clear()
    slots = torch.tensor([3, 1, 4])
    for _ in range(calls):
        sglang.transfer_kv_per_layer(k_src, k_dst, v_src, v_dst, slots, slots, 256)
    return host.counts["classify.classify_pointers"] // 2


def test_a_drop_ins_layouts_of_the_same_live_tensors_are_classified_once(host):
    k_src, v_src, k_dst, v_dst = caches()
    assert sglang_classifications(host, k_src, k_dst, v_src, v_dst, calls=4) == 1
    assert sglang_classifications(host, k_dst, k_src, v_dst, v_src) == 1  # (the other way)
    assert sglang_classifications(host, k_dst, k_src, v_dst, v_src, calls=2) == 0


def test_a_drop_ins_layouts_of_changed_tensors_are_classified_again(host):
    k_src, v_src, k_dst, v_dst = caches()
    sglang_classifications(host, k_src, k_dst, v_src, v_dst)
    k_dst.set_(torch.zeros(8, 256, dtype=torch.uint8).untyped_storage(), 0, (8, 256))  # moved
    assert sglang_classifications(host, k_src, k_dst, v_src, v_dst) == 1
    other = k_src.view(8, 256)  # another object over the same memory
    assert sglang_classifications(host, other, k_dst, v_src, v_dst) == 1
    kept_memory.forget()
    assert sglang_classifications(host, other, k_dst, v_src, v_dst) == 1


def test_a_drop_ins_tables_of_addresses_are_classified_at_every_call(host, monkeypatch):
    """A table holds addresses, not the memory at them: what is there may change."""
    from kvcopy.compat import pointer_tables, sglang

    # (the driver's answer of how far an allocation reaches: each cache's 2 KiB)
    monkeypatch.setattr(pointer_tables, "_reach_of", lambda address, name: 8 * 256)

    src, dst = caches(2), caches(2)
    table = lambda tensors: torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)  # noqa: E731
    src_k, src_v, dst_k, dst_v = table(src[:1]), table(src[1:]), table(dst[:1]), table(dst[1:])
    slots = torch.tensor([3, 1, 4])
    host.counts.clear()
    for _ in range(3):
        sglang.transfer_kv_all_layer(src_k, dst_k, src_v, dst_v, slots, slots, 256, 1)
    assert host.counts["classify.classify_pointers"] // 2 == 3
