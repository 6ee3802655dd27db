"""Torch tensors given where kvcopy reads integers (pointers and sizes, block
mappings, row indices) and the empty block mapping: anything whose elements are not
plain integers is a TypeError naming the argument, never torch's own error and
never read with its mask or sign bit ignored (CPU)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import kvcopy
from helpers.cpu_fakes import FakeScope
from kvcopy import host
from kvcopy._plans.blocks import plan_blocks
from kvcopy.interop.arrays import as_block_mapping
from kvcopy.interop.tensors import block_layout

torch = pytest.importorskip("torch")

PAIRS = [[1, 2], [3, 0]]


def _masked() -> "torch.Tensor":
    with warnings.catch_warnings():  # torch calls masked tensors a prototype
        warnings.simplefilter("ignore", UserWarning)
        from torch.masked import masked_tensor

        return masked_tensor(torch.tensor(PAIRS), torch.tensor([[True, False], [True, True]]))


def _quiet(make):
    """``make`` without torch's warnings that the kind is a prototype, beta or deprecated."""

    def made() -> "torch.Tensor":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return make()

    return made


def _nested() -> "torch.Tensor":
    return torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3, 0])])


NOT_PLAIN_INTEGERS = {
    "meta": (lambda: torch.empty(2, 2, dtype=torch.int64, device="meta"), "meta tensor"),
    "sparse": (lambda: torch.tensor(PAIRS).to_sparse(), "not one strided buffer"),
    "sparse_csr": (_quiet(lambda: torch.tensor(PAIRS).to_sparse_csr()), "not one strided buffer"),
    "nested": (_quiet(_nested), "nested tensor"),
    "masked": (_masked, "masked tensor's mask"),
    "negative": (lambda: torch.tensor(PAIRS)._neg_view(), "negative view"),
    "bfloat16": (lambda: torch.tensor(PAIRS, dtype=torch.bfloat16), "dtype torch.bfloat16"),
    "float32": (lambda: torch.tensor(PAIRS, dtype=torch.float32), "dtype torch.float32"),
    "bool": (lambda: torch.tensor(PAIRS).bool(), "dtype torch.bool"),
    "quantized": (
        _quiet(
            lambda: torch.quantize_per_tensor(torch.tensor(PAIRS, dtype=torch.float32), 1.0, 0, torch.qint8)
        ),
        "quantized tensor",
    ),
}
KINDS = pytest.mark.parametrize("kind", sorted(NOT_PLAIN_INTEGERS))


def _flat(t: "torch.Tensor") -> "torch.Tensor":
    """One dimension of the same kind (pointers and indices are 1-D)."""
    if (
        t.is_nested
        or t.is_meta
        or t.layout is not torch.strided
        or t.is_quantized
        or type(t) is not torch.Tensor
    ):
        return t  # the kind is refused before its shape is looked at
    return t.flatten() if not t.is_neg() else t.resolve_neg().flatten()._neg_view()


@KINDS
def test_a_block_mapping_of_no_plain_integers_is_refused(kind):
    make, match = NOT_PLAIN_INTEGERS[kind]
    with pytest.raises(TypeError, match=rf"^block_mapping: .*{match}"):
        plan_blocks(np.zeros((4, 8), np.uint8), np.zeros((4, 8), np.uint8), make())


@KINDS
def test_pointers_of_no_plain_integers_are_refused_before_the_driver(kind):
    make, match = NOT_PLAIN_INTEGERS[kind]
    with pytest.raises(TypeError, match=rf"^src_ptrs: .*{match}"):
        kvcopy.copy_batch(_flat(make()), [0x2000] * 4, [8] * 4)


@KINDS
def test_row_indices_of_no_plain_integers_are_refused(kind):
    make, match = NOT_PLAIN_INTEGERS[kind]
    src = kvcopy.Layout.from_pointers([0x10000], slots=8, row_bytes=64)
    dst = kvcopy.Layout.from_pointers([0x20000], slots=8, row_bytes=64)
    with pytest.raises(TypeError, match=rf"^dst_indices: .*{match}"):
        kvcopy.copy_rows(src, dst, [0, 1, 2, 3], _flat(make()))


def test_a_negative_view_read_as_its_values_once_resolved():
    mapping = torch.tensor(PAIRS)._neg_view()._neg_view().resolve_neg()
    assert as_block_mapping(mapping).tolist() == PAIRS


def test_a_masked_tensor_is_refused_as_blocks():
    """Its address reads 0 and its mask lives apart from its bytes."""
    with pytest.raises(TypeError, match="^src: a masked tensor's mask"):
        block_layout(_masked(), "src")


@pytest.mark.parametrize(
    "mapping, kind, match",
    [
        (np.empty((0, 3), np.int64), ValueError, r"expected shape \(n, 2\), got \(0, 3\)"),
        (np.empty((2, 0), np.int64), ValueError, r"expected shape \(n, 2\), got \(2, 0\)"),
        (np.empty((0,), np.int64), ValueError, r"expected shape \(n, 2\), got \(0,\)"),
        (np.empty((0, 2), np.float64), TypeError, "expected integer block ids, got dtype float64"),
        (torch.empty(0, 2), TypeError, "expected integers, got dtype torch.float32"),
    ],
)
def test_an_empty_block_mapping_of_the_wrong_shape_or_dtype_is_refused(mapping, kind, match):
    with pytest.raises(kind, match=rf"^block_mapping: {match}"):
        plan_blocks(np.zeros((4, 8), np.uint8), np.zeros((4, 8), np.uint8), mapping)


@pytest.mark.parametrize("empty", [[], (), np.empty((0, 2), np.int64), torch.empty(0, 2, dtype=torch.int64)])
def test_an_empty_block_mapping_names_no_pairs(empty):
    assert as_block_mapping(empty).shape == (0, 2)


class _HostMemory:
    """kvcopy._cuda.memory's pinned allocation, answered from ordinary host memory."""

    def __init__(self) -> None:
        self.kept: list[np.ndarray] = []

    def host_alloc(self, nbytes: int) -> int:
        self.kept.append(np.zeros(nbytes, np.uint8))
        return self.kept[-1].ctypes.data

    def host_device_pointer(self, ptr: int) -> int:
        return ptr

    def host_free(self, ptr: int) -> None:
        pass


@pytest.mark.parametrize(
    "shape, dtype",
    [
        (4, np.dtype((np.float32, (3,)))),
        ((2, 5), np.dtype((np.int16, (2, 3)))),
        (0, np.dtype((np.uint8, (7,)))),
    ],
)
def test_pinned_empty_with_a_sub_array_dtype_is_what_numpy_empty_gives(monkeypatch, shape, dtype):
    monkeypatch.setattr(host, "memory", _HostMemory())
    monkeypatch.setattr(host, "ContextScope", FakeScope)
    made = kvcopy.pinned_empty(shape, dtype)
    expected = np.empty(shape, dtype)
    assert (made.shape, made.dtype) == (expected.shape, expected.dtype)
    assert made.nbytes == expected.nbytes
    made[...] = 7  # every element is writable memory of its own
    assert np.all(made == 7)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor([5, 1, 4, 1]),
        lambda: torch.tensor([5, 0, 1, 0, 4, 0, 1, 0])[::2],  # (every other one: strided)
        lambda: torch.tensor([[5, 1, 4, 1]])[0],
    ],
    ids=["plain", "strided", "a row of a 2-D tensor"],
)
def test_host_row_indices_of_plain_int64_tensors_are_their_values(make):
    from kvcopy._plans.rows import read_indices

    read = read_indices(make(), "src_indices")
    assert read.count == 4 and read.host.dtype == np.int64 and read.host.flags.c_contiguous
    assert read.host.tolist() == [5, 1, 4, 1]
    with torch.inference_mode():
        inference = torch.tensor([7, 2])
    assert read_indices(inference, "src_indices").host.tolist() == [7, 2]


def test_host_row_indices_of_two_dimensions_are_refused():
    from kvcopy._plans.rows import read_indices

    with pytest.raises(ValueError, match="src_indices: indices must be one-dimensional"):
        read_indices(torch.tensor([[1, 2], [3, 4]]), "src_indices")
