"""copy_rows with GPU indices, the same call again issued from one C call
(kvcopy._cuda.rows_repeat): the rows the indices hold when the launch runs land
where they say, with no plan made; a call that differs in anything the launches
depend on goes the whole way, which plans it (and refuses what is wrong). The
layout kernel is emulated on host memory, the "GPU" indices read where they lie
(helpers.rows_fakes.RowsOnHostMemory)."""

from __future__ import annotations

import weakref

import numpy as np
import pytest

import kvcopy
from kvcopy import testing
from kvcopy.testing import cuda, engine
from helpers.rows_fakes import RowsOnHostMemory, emulate_on_host_memory

torch = pytest.importorskip("torch")

STREAM = 0x1234
SLOTS, ROW = 64, 256


class Indices:
    """Int64 slots in ordinary memory that say they are on the GPU, as CuPy's arrays
    do (the emulated kernel reads them where they lie)."""

    def __init__(self, values: np.ndarray, **fields) -> None:
        self.values = values
        self.__cuda_array_interface__ = {
            "shape": values.shape,
            "typestr": "<i8",
            "data": (values.ctypes.data, False),
            "version": 3,
            "strides": None,
            **fields,
        }


class Stream:
    """A stream object of the __cuda_stream__ protocol, weakly referable."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


@pytest.fixture
def emulated(seams):
    gpu = torch.arange(2 * SLOTS * ROW, dtype=torch.int32).to(torch.uint8).reshape(2, SLOTS, ROW)
    host = torch.zeros(2, SLOTS, ROW, dtype=torch.uint8)
    fake = RowsOnHostMemory([gpu.numpy()])
    emulate_on_host_memory(seams, fake)
    engine.rows_memo.forget()
    src = kvcopy.Layout.of(gpu, planes=(0,), slot=1)
    dst = kvcopy.Layout.of(host, planes=(0,), slot=1)
    return fake, gpu, host, src, dst


@pytest.fixture
def python_reads(monkeypatch):
    """The index arguments copy_rows read in Python (a call repeated from C reads none)."""
    read, real = [], kvcopy.rows.read_indices
    monkeypatch.setattr(kvcopy.rows, "read_indices", lambda obj, name: read.append(name) or real(obj, name))
    return read


def expect_rows(gpu, host, a, b) -> None:
    want = torch.zeros_like(host)
    want[:, torch.from_numpy(b)] = gpu[:, torch.from_numpy(a)]
    assert torch.equal(host, want)


def test_indices_rewritten_in_place_move_the_new_rows_without_a_plan(emulated, plans, python_reads):
    fake, gpu, host, src, dst = emulated
    a, b = np.zeros(12, np.int64), np.zeros(12, np.int64)
    src_indices, dst_indices = Indices(a), Indices(b)
    rng = np.random.default_rng(0)
    for call in range(5):
        a[:] = rng.choice(SLOTS, 12, replace=False)
        b[:] = rng.choice(SLOTS, 12, replace=False)
        host.zero_()
        assert kvcopy.copy_rows(src, dst, src_indices, dst_indices, stream=STREAM) == "kernel"
        expect_rows(gpu, host, a, b)
    assert plans[0] == 1 and fake.classified == 2 and python_reads == []
    assert kvcopy.last_decision().method == "kernel"


def test_one_index_array_for_both_sides_and_new_objects_at_the_same_place(emulated, plans, python_reads):
    fake, gpu, host, src, dst = emulated
    slots = np.array([3, 9, 27], np.int64)
    kvcopy.copy_rows(src, dst, Indices(slots), Indices(slots), stream=STREAM)
    same = Indices(slots)
    for values in ([4, 8, 16], [60, 1, 2]):
        slots[:] = values
        host.zero_()
        kvcopy.copy_rows(src, dst, same, same, stream=STREAM)
        expect_rows(gpu, host, slots, slots)
    assert plans[0] == 1 and python_reads == []


@pytest.mark.parametrize(
    "change",
    ["dst address", "count", "rows", "method", "stream", "setting", "memory forgotten", "device fact"],
)
def test_a_call_that_differs_is_planned(emulated, plans, change, monkeypatch):
    fake, gpu, host, src, dst = emulated
    a, b = np.array([1, 2, 3], np.int64), np.array([4, 5, 6], np.int64)
    kvcopy.copy_rows(src, dst, Indices(a), Indices(b), stream=STREAM)
    args = {"stream": STREAM}
    if change == "dst address":
        b = np.array([7, 8, 9], np.int64)
    elif change == "count":
        a, b = a[:2].copy(), b[:2].copy()
    elif change == "rows":
        args["rows"] = 3
    elif change == "method":
        args["method"] = "kernel"
    elif change == "stream":
        args["stream"] = STREAM + 0x1000
    elif change == "memory forgotten":
        engine.kept_memory.forget()  # (as kvcopy.register's unregistering does)
    elif change == "device fact":  # (as a new calibration or capability does)
        monkeypatch.setattr(engine.device, "generation", engine.device.generation + 1)
    host.zero_()
    with testing.settings(host_ctas=5 if change == "setting" else None):
        assert kvcopy.copy_rows(src, dst, Indices(a), Indices(b), **args) == "kernel"
    expect_rows(gpu, host, a, b)
    assert plans[0] == 2


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"typestr": "<i4"}, "src_indices: GPU indices must be int64"),
        ({"shape": (3, 1), "strides": None}, "src_indices: GPU indices must be one contiguous dimension"),
        ({"strides": (16,)}, "src_indices: GPU indices must be one contiguous dimension"),
    ],
)
def test_indices_of_another_kind_at_the_same_place_are_refused_as_at_first(emulated, fields, error):
    fake, gpu, host, src, dst = emulated
    slots = np.array([1, 2, 3], np.int64)
    kvcopy.copy_rows(src, dst, Indices(slots), stream=STREAM)
    launched = len(fake.calls)
    with pytest.raises((TypeError, ValueError), match=error):
        kvcopy.copy_rows(src, dst, Indices(slots, **fields), stream=STREAM)
    assert len(fake.calls) == launched


def test_indices_with_writes_pending_are_read_the_whole_way(emulated, plans, python_reads):
    fake, gpu, host, src, dst = emulated
    slots = np.array([1, 2, 3], np.int64)
    kvcopy.copy_rows(src, dst, Indices(slots), stream=STREAM)
    kvcopy.copy_rows(src, dst, Indices(slots, stream=STREAM), stream=STREAM)
    expect_rows(gpu, host, slots, np.arange(3))
    assert python_reads == ["src_indices", "dst_indices"]  # (the full read, which honours the stream)
    assert plans[0] == 1  # (and found the call the same: the launches repeated)


def test_a_layout_whose_tensor_moved_is_refused_not_repeated(emulated):
    fake, gpu, host, src, dst = emulated
    slots = np.array([1, 2], np.int64)
    kvcopy.copy_rows(src, dst, Indices(slots), stream=STREAM)
    launched = len(fake.calls)
    host.set_(torch.zeros(2, SLOTS, ROW, dtype=torch.uint8))  # (the layout's memory is gone)
    with pytest.raises(ValueError, match="moved or changed shape"):
        kvcopy.copy_rows(src, dst, Indices(slots), stream=STREAM)
    assert len(fake.calls) == launched


def test_a_layout_whose_array_changed_is_refused_not_repeated(emulated, plans):
    """A layout over a NumPy array is repeated from C while the array is unchanged; one
    changed in place since the layout was made (its shape, its writability) is refused
    by name, nothing launched."""
    fake, gpu, host, src, _ = emulated
    array = np.zeros((2, SLOTS, ROW), np.uint8)
    dst = kvcopy.Layout.of(array, planes=(0,), slot=1)
    slots = np.array([1, 2], np.int64)
    for _ in range(2):
        kvcopy.copy_rows(src, dst, Indices(slots), stream=STREAM)
    assert plans[0] == 1  # (planned once, then repeated from C)
    launched = len(fake.calls)
    for change in ("shape", "writeable"):
        if change == "shape":
            array.shape = (2, SLOTS // 2, 2 * ROW)
        else:
            array.flags.writeable = False
        with pytest.raises(ValueError, match=r"^dst: tensor 0 of the layout has moved or changed shape"):
            kvcopy.copy_rows(src, dst, Indices(slots), stream=STREAM)
        array.shape, array.flags.writeable = (2, SLOTS, ROW), True
    assert len(fake.calls) == launched
    kvcopy.copy_rows(src, dst, Indices(slots), stream=STREAM)
    assert np.array_equal(array[0, :2], gpu.numpy()[0, 1:3])  # (rows 1 and 2 to rows 0 and 1)


def test_a_stream_object_is_known_again_and_another_resolved(emulated, plans, python_reads):
    fake, gpu, host, src, dst = emulated
    slots = np.array([5, 6], np.int64)
    stream = Stream(STREAM)
    for _ in range(3):
        kvcopy.copy_rows(src, dst, Indices(slots), stream=stream)
    kvcopy.copy_rows(src, dst, Indices(slots), stream=Stream(STREAM))  # (the same handle)
    assert plans[0] == 1 and python_reads == []
    kvcopy.copy_rows(src, dst, Indices(slots), stream=Stream(STREAM + 0x1000))
    assert plans[0] == 2
    launched = [call for call in fake.calls if call[0] == "launch"]
    assert len(launched) == 5
    with pytest.raises(ValueError, match="not a valid CUstream"):
        kvcopy.copy_rows(src, dst, Indices(slots), stream=Stream(7))


def test_the_repeat_holds_no_stream_object(emulated):
    fake, gpu, host, src, dst = emulated
    stream = Stream(STREAM)
    kvcopy.copy_rows(src, dst, Indices(np.array([1], np.int64)), stream=stream)
    gone = weakref.ref(stream)
    del stream
    assert gone() is None


@pytest.mark.parametrize(
    "face, site",
    [
        ({"typestr": "<i8", "data": (0x5000, False), "shape": (3,), "version": 3}, (True, 0x5000, 3, -1)),
        ({"typestr": "<i8", "data": (0x5000, False), "shape": (0,), "version": 3}, (True, 0, 0, -1)),
        (
            {"typestr": "<i8", "data": (0x5000, True), "shape": (3,), "version": 2, "strides": (8,)},
            (True, 0x5000, 3, -1),
        ),
        ({"typestr": "<i4", "data": (0x5000, False), "shape": (3,), "version": 3}, None),
        ({"typestr": "<i8", "data": (0x5000, False), "shape": (3,), "version": 3, "strides": (16,)}, None),
        ({"typestr": "<i8", "data": (0x5000, False), "shape": (3, 1), "version": 3}, None),
        ({"typestr": "<i8", "data": (0x5000, 0), "shape": (3,), "version": 3}, None),
        ({"typestr": "<i8", "data": (0x5000, False), "shape": (3,), "version": 3.0}, None),
        ({"typestr": "<i8", "data": (0x5000, False), "shape": (3,), "version": 3, "mask": object()}, None),
        ({"typestr": "<i8", "data": (0x5000, False), "shape": (3,), "version": 3, "stream": 1}, None),
        ({"typestr": "<i8", "data": (-1, False), "shape": (3,), "version": 3}, None),
    ],
)
def test_index_site_reads_only_plain_int64_interfaces(face, site):
    holder = type("Producer", (), {})()
    holder.__cuda_array_interface__ = face
    assert cuda.rows_repeat.index_site(holder) == site


def test_index_site_leaves_host_tensors_and_other_objects_to_the_whole_way():
    assert cuda.rows_repeat.index_site(None) == (False, 0, 0, -1)
    assert cuda.rows_repeat.index_site(torch.arange(4)) is None  # (host indices: checked in full)
    assert cuda.rows_repeat.index_site(np.arange(4)) is None
    assert cuda.rows_repeat.index_site([1, 2]) is None


def test_the_epoch_in_c_reads_the_counters_the_python_key_holds(monkeypatch):
    """The repeat in C reads the counters EPOCH_SOURCES names; the Python path's key
    holds epoch_now(): both name the same counters, in the same order, so that each
    change moves both."""
    memo = engine.rows_memo
    assert memo.epoch_now() == tuple(getattr(module, name) for module, name in memo.EPOCH_SOURCES)
    for k, (module, name) in enumerate(memo.EPOCH_SOURCES):
        before = memo.epoch_now()
        monkeypatch.setattr(module, name, getattr(module, name) + 1)
        after = memo.epoch_now()
        assert [a != b for a, b in zip(after, before)] == [i == k for i in range(len(before))]
