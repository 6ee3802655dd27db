"""What was read from torch tensors and arrays is kept while they are unchanged
(kvcopy.interop.kept_reads): the same tensors are read once; every in-place change of
one (its metadata, its data, its memory), a freed one, an inference tensor, an array
changed in place, an array-interface producer that names a stream, or an object that
is no array is read again."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from kvcopy.interop.kept_reads import KeptReads
from kvcopy.testing import plans
from helpers.producers import Interface

torch = pytest.importorskip("torch")


def caches(n: int = 3) -> list:
    return [torch.zeros(8, 64, dtype=torch.uint8) for _ in range(n)]


class Reader:
    """A read that counts itself and returns what it read: each tensor's address and
    shape."""

    def __init__(self, tensors: list) -> None:
        self.tensors, self.reads = tensors, 0

    def __call__(self) -> tuple:
        self.reads += 1
        return tuple((address(t), tuple(t.shape)) for t in self.tensors)


def address(t) -> int:
    return t.ctypes.data if isinstance(t, np.ndarray) else t.data_ptr()


def read_through(kept: KeptReads, tensors: list, reader: Reader) -> tuple:
    return kept.get(tensors, "test", reader)


def test_the_same_tensors_are_read_once_even_in_another_list():
    kept, tensors = KeptReads(8), caches()
    reader = Reader(tensors)
    first = read_through(kept, tensors, reader)
    assert read_through(kept, list(tensors), reader) is first
    assert read_through(kept, tuple(tensors), reader) is first
    assert reader.reads == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.set_(torch.zeros(8, 64, dtype=torch.uint8).untyped_storage(), 0, (8, 64)),
        lambda t: t.set_(t.untyped_storage(), 64, (7, 64)),
        lambda t: t.resize_(4, 64),
        lambda t: t.resize_(64, 64),
        lambda t: t.as_strided_((4, 64), (128, 1)),
        lambda t: t.transpose_(0, 1),
        lambda t: t.unsqueeze_(0),
        lambda t: setattr(t, "data", torch.zeros(2, 64, dtype=torch.uint8)),
        lambda t: t.untyped_storage().resize_(0),
    ],
    ids=[
        "set_",
        "set_-same-storage",
        "resize_-smaller",
        "resize_-larger",
        "as_strided_",
        "transpose_",
        "unsqueeze_",
        "data-elsewhere",
        "storage-freed",
    ],
)
def test_a_tensor_changed_in_place_is_read_again(change):
    kept, tensors = KeptReads(8), caches()
    reader = Reader(tensors)
    read_through(kept, tensors, reader)
    change(tensors[1])
    again = read_through(kept, tensors, reader)
    assert reader.reads == 2
    assert again[1] == (tensors[1].data_ptr(), tuple(tensors[1].shape))
    assert read_through(kept, tensors, reader) is again  # kept again, as changed
    assert reader.reads == 2


class Relocating(torch.Tensor):
    """A tensor subclass whose own data_ptr() says it moved at every call."""

    moves = 0

    def data_ptr(self) -> int:
        Relocating.moves += 1
        return super().data_ptr() + Relocating.moves


def test_a_tensor_subclass_is_checked_through_its_own_readers():
    """torch.Tensor itself is checked through its C readers; a subclass through its
    attributes as it defines them (here: an address that moves, so it is read again)."""
    kept = KeptReads(8)
    tensors = [caches(1)[0], caches(1)[0].as_subclass(Relocating)]
    reader = Reader(tensors)
    read_through(kept, tensors, reader)
    read_through(kept, tensors, reader)
    assert reader.reads == 2
    plain = caches(2)
    reader = Reader(plain)
    read_through(kept, plain, reader)
    read_through(kept, plain, reader)
    plain[0].resize_(4, 64)
    read_through(kept, plain, reader)
    assert reader.reads == 2


def test_a_write_to_the_data_keeps_what_was_read():
    """A write bumps the version counter (an engine's attention writes its KV cache every
    step): the metadata is compared, not read into a new value."""
    kept, tensors = KeptReads(8), caches()
    reader = Reader(tensors)
    first = read_through(kept, tensors, reader)
    tensors[0].fill_(1)
    tensors[2].add_(1)
    assert read_through(kept, tensors, reader) is first
    assert read_through(kept, tensors, reader) is first
    assert reader.reads == 1
    tensors[1].fill_(2)
    tensors[1].transpose_(0, 1)  # (and then its metadata: read again)
    assert read_through(kept, tensors, reader)[1] == (tensors[1].data_ptr(), (64, 8))
    assert reader.reads == 2


def test_whether_a_value_is_kept_is_said():
    tensors = caches()
    with torch.inference_mode():
        frozen = caches()
    kept = KeptReads(8)
    assert kept.lookup(tensors, "test", lambda: 1) == (1, True)
    assert kept.lookup(tensors, "test", lambda: 2) == (1, True)
    assert kept.lookup(frozen, "test", lambda: 3) == (3, False)
    assert kept.lookup(caches(), "test", lambda: None) == (None, False)


def test_another_tensor_in_a_place_of_the_list_is_read_again():
    kept, tensors = KeptReads(8), caches()
    reader = Reader(tensors)
    read_through(kept, tensors, reader)
    other = list(tensors)
    other[2] = tensors[2].view(8, 64)  # the same memory, another object
    read_through(kept, other, Reader(other))
    swapped = [tensors[1], tensors[0], tensors[2]]
    swapped_reader = Reader(swapped)
    read_through(kept, swapped, swapped_reader)
    assert swapped_reader.reads == 1


def test_an_entry_leaves_with_its_first_freed_tensor():
    kept, tensors = KeptReads(8), caches()
    read_through(kept, tensors, Reader(tensors))
    assert len(kept) == 1
    tensors.pop()
    gc.collect()
    assert len(kept) == 0


class SlottedProducer:
    """A producer that takes no weak references."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int) -> None:
        self.__cuda_array_interface__ = Interface(ptr).__cuda_array_interface__


class Named:
    """Neither a tensor nor an array."""


class JaxLike(Interface):
    """A JAX array as kvcopy tells it (by its type's module): read through DLPack at
    every call, whatever interface it also offers."""


JaxLike.__module__ = "jaxlib.xla_extension"


def test_inference_tensors_and_objects_that_cannot_be_stamped_are_read_at_every_call():
    with torch.inference_mode():
        frozen = caches()
    arrays = [np.zeros((8, 64), np.uint8) for _ in range(3)]
    streamed = [Interface(1 << 40, stream=7), Interface(2 << 40)]  # (a stream: waited for each time)
    others = ([SlottedProducer(1 << 40)], [JaxLike(1 << 40)], [arrays[0], Named()])
    for tensors in (frozen, [*caches(2), Named()], streamed, *others):
        kept, reader = KeptReads(8), Counter()
        for _ in range(3):
            kept.get(tensors, "test", reader)
        assert reader.reads == 3 and len(kept) == 0


class Counter:
    """A read that counts itself and returns a new object each time."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> object:
        self.reads += 1
        return object()


def test_the_same_arrays_and_producers_are_read_once(tmp_path):
    arrays = [np.zeros((8, 64), np.uint8), np.zeros((4, 4), np.float32)[:, :2]]
    memmap = np.memmap(tmp_path / "cache", dtype=np.uint8, mode="w+", shape=(8, 64))
    for tensors in (arrays, [memmap], [Interface(1 << 40), Interface(2 << 40)], [caches(1)[0], *arrays]):
        kept, reader = KeptReads(8), Counter()
        first = kept.get(tensors, "test", reader)
        assert kept.get(list(tensors), "test", reader) is first
        assert reader.reads == 1 and len(kept) == 1


def _set_shape(a: np.ndarray) -> None:
    a.shape = (64, 8)


def _set_dtype(a: np.ndarray) -> None:
    a.dtype = np.uint16


def _set_read_only(a: np.ndarray) -> None:
    a.flags.writeable = False


@pytest.mark.parametrize("change", [_set_shape, _set_dtype, _set_read_only])
def test_an_array_changed_in_place_is_read_again(change):
    arrays = [np.zeros((8, 64), np.uint8) for _ in range(3)]
    kept, reader = KeptReads(8), Counter()
    first = kept.get(arrays, "test", reader)
    change(arrays[1])
    second = kept.get(arrays, "test", reader)
    assert second is not first and reader.reads == 2
    assert kept.get(arrays, "test", reader) is second  # (kept again as it is now)


def test_a_write_to_an_arrays_data_keeps_what_was_read():
    arrays = [np.zeros((8, 64), np.uint8) for _ in range(2)]
    kept, reader = KeptReads(8), Counter()
    first = kept.get(arrays, "test", reader)
    arrays[0][:] = 7
    assert kept.get(arrays, "test", reader) is first and reader.reads == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda i: i.update(data=(3 << 40, False)),
        lambda i: i.update(data=(1 << 40, True)),
        lambda i: i.update(shape=(4, 64)),
        lambda i: i.update(strides=(128, 1)),
        lambda i: i.update(typestr="<u2"),
        lambda i: i.update(stream=7),
    ],
)
def test_a_producer_whose_interface_changed_is_read_again(change):
    producers = [Interface(1 << 40), Interface(2 << 40)]
    kept, reader = KeptReads(8), Counter()
    first = kept.get(producers, "test", reader)
    change(producers[0].__cuda_array_interface__)
    assert kept.get(producers, "test", reader) is not first and reader.reads == 2


def test_an_entry_leaves_with_its_first_freed_array():
    kept, arrays = KeptReads(8), [np.zeros((8, 64), np.uint8) for _ in range(2)]
    kept.get(arrays, "test", Counter())
    assert len(kept) == 1
    arrays.pop()
    gc.collect()
    assert len(kept) == 0


def test_another_array_over_the_same_memory_is_read_again():
    base = np.zeros((8, 64), np.uint8)
    kept, reader = KeptReads(8), Counter()
    kept.get([base[:]], "test", reader)
    kept.get([base[:]], "test", reader)  # (a view made anew: another object)
    assert reader.reads == 2


def test_a_failed_or_empty_read_keeps_nothing():
    kept, tensors = KeptReads(8), caches()

    def fails() -> None:
        raise ValueError("bad tensors")

    with pytest.raises(ValueError, match="^bad tensors$"):
        kept.get(tensors, "test", fails)
    assert kept.get(tensors, "test", lambda: None) is None
    assert len(kept) == 0


def test_what_else_a_value_depends_on_is_part_of_its_key():
    kept, tensors = KeptReads(8), caches()
    assert kept.get(tensors, "a", lambda: 1) == 1
    assert kept.get(tensors, "b", lambda: 2) == 2
    assert kept.get(tensors, "a", lambda: 3) == 1


def test_the_store_is_bounded_oldest_first():
    kept = KeptReads(4)
    lists = [caches(1) for _ in range(6)]
    for k, tensors in enumerate(lists):
        kept.get(tensors, "test", lambda k=k: k)
    assert len(kept) <= 4
    assert kept.get(lists[-1], "test", lambda: "read") == 5
    assert kept.get(lists[0], "test", lambda: "read") == "read"


def test_a_swap_blocks_geometry_follows_a_moved_or_resized_cache():
    """block_geometry of per-layer caches repeated: the same geometry while unchanged,
    the new addresses and block counts after set_ and resize_."""
    src, dst = caches(), caches()
    first = plans.block_geometry(src, dst)
    assert plans.block_geometry(src, dst) is first
    moved = torch.zeros(8, 64, dtype=torch.uint8)
    src[1].set_(moved.untyped_storage(), 0, (8, 64))
    after = plans.block_geometry(src, dst)
    assert after.src_base.tolist()[1] == moved.data_ptr()
    dst[0].resize_(4, 64)
    assert plans.block_geometry(src, dst).dst_blocks.tolist() == [4, 8, 8]
    with pytest.raises(ValueError, match=r"destination block 5 is out of range for dst\[0\], which has 4"):
        plans.plan_blocks(src, dst, [[0, 5]])
