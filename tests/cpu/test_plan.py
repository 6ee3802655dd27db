"""Argument conversion and planning (CPU)."""

from __future__ import annotations

import array

import numpy as np
import pytest

from kvcopy.interop.arrays import as_u64_array
from kvcopy._plans.copies import plan_copies


def u64(values):
    return np.asarray(values, dtype=np.uint64)


@pytest.mark.parametrize(
    "obj",
    [
        [1, 2, 3],
        (1, 2, 3),
        np.array([1, 2, 3], np.int32),
        np.array([1, 2, 3], np.uint64),
        array.array("q", [1, 2, 3]),
    ],
)
def test_integer_inputs_convert(obj):
    out = as_u64_array(obj, "x")
    assert out.dtype == np.uint64 and out.flags.c_contiguous
    assert out.tolist() == [1, 2, 3]


def test_torch_cpu_tensor_converts():
    torch = pytest.importorskip("torch")
    assert as_u64_array(torch.tensor([5, 6], dtype=torch.int64), "x").tolist() == [5, 6]


def test_values_above_int63_keep_their_bits():
    assert as_u64_array([2**64 - 1], "x").tolist() == [2**64 - 1]


@pytest.mark.parametrize(
    "obj, kind, match",
    [
        ([1.0, 2], TypeError, r"x\[0\] is float"),
        ([1, "2"], TypeError, r"x\[1\] is str"),
        ([1, None], TypeError, r"x\[1\] is NoneType"),
        ([True, 1], TypeError, r"x\[0\] is bool"),
        (np.array([1.0, 2.0]), TypeError, "integer dtype, got float64"),
        (np.array([True, False]), TypeError, "integer dtype, got bool"),
        (np.zeros((2, 2), np.int64), ValueError, "1-D"),
        ([1, -5], ValueError, r"x\[1\] = -5 is negative"),
        (np.array([3, -1], np.int64), ValueError, r"x\[1\] = -1 is negative"),
        ([2**64], ValueError, "64 bits"),
        ("123", TypeError, "got str"),
        (None, TypeError, "got NoneType"),
        (7, TypeError, "got int"),
    ],
)
def test_bad_inputs_name_the_argument(obj, kind, match):
    with pytest.raises(kind, match=match):
        as_u64_array(obj, "x")


def test_plan_drops_zero_sizes_and_keeps_origins():
    plan = plan_copies(u64([100, 0, 300]), u64([1000, 0, 3000]), u64([8, 0, 8]))
    assert plan.src.tolist() == [100, 300]
    assert plan.origin.tolist() == [0, 2]
    assert plan.caller_index(1) == 2


def test_plan_merges_copies_that_continue_each_other():
    plan = plan_copies(u64([100, 108, 116, 500]), u64([900, 908, 916, 2000]), u64([8, 8, 4, 4]))
    assert plan.src.tolist() == [100, 500]
    assert plan.sizes.tolist() == [20, 4]
    assert plan.origin.tolist() == [0, 3]


def test_plan_does_not_merge_when_only_one_side_continues():
    plan = plan_copies(u64([100, 108]), u64([900, 2000]), u64([8, 8]))
    assert plan.count == 2


def test_plan_errors():
    with pytest.raises(ValueError, match="differ in length: 2, 1, 2"):
        plan_copies(u64([1, 2]), u64([1]), u64([1, 1]))
    with pytest.raises(ValueError, match=r"src_ptrs\[1\] is a null pointer"):
        plan_copies(u64([1, 0]), u64([1, 2]), u64([1, 1]))
    with pytest.raises(ValueError, match=r"dst_ptrs\[0\] \+ sizes\[0\] runs past"):
        plan_copies(u64([1]), u64([2**64 - 4]), u64([8]))
    with pytest.raises(ValueError, match=r"sizes\[0\] = 9223372036854775808 is larger"):
        plan_copies(u64([1]), u64([1]), u64([2**63]))


def test_null_pointer_with_zero_size_is_allowed_and_dropped():
    plan = plan_copies(u64([0, 5]), u64([0, 6]), u64([0, 1]))
    assert plan.count == 1 and plan.origin.tolist() == [1]
