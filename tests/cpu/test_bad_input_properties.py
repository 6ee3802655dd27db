"""Malformed arguments, generated: every one is a TypeError (wrong type) or a
ValueError (wrong value) naming the argument, raised before any driver call.
Runs on the CPU (no GPU or driver needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcopy
from kvcopy._plans.blocks import plan_blocks
from kvcopy.testing import cuda

NOT_BOOLS = st.one_of(
    st.text(max_size=4),
    st.integers(),
    st.floats(allow_nan=False),
    st.none(),
    st.lists(st.booleans(), max_size=2),
    st.binary(max_size=2),
)
NOT_INTS = st.one_of(
    st.text(max_size=4),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
FEW = settings(max_examples=60, deadline=None)


# ------------------------------------------------------------------ flags that must be bools


@FEW
@given(value=NOT_BOOLS)
def test_flags_accept_only_bools(value):
    host = np.zeros((4, 16), np.uint8)
    calls = {
        "check_overlap": lambda: kvcopy.copy_batch([1], [2], [3], check_overlap=value),
        "allow_batch": lambda: kvcopy.copy_batch([1], [2], [3], allow_batch=value),
        "split_blocks": lambda: kvcopy.swap_blocks(host, host.copy(), [[0, 1]], split_blocks=value),
        "readonly": lambda: kvcopy.block_view(0x1000, 16, num_blocks=4, readonly=value),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=name):
            call()


# ------------------------------------------------------------------ integers


@FEW
@given(value=NOT_INTS)
def test_max_ctas_of_the_wrong_type_is_a_type_error(value):
    if value is None:
        return  # None means "the default"
    with pytest.raises(TypeError, match="max_ctas"):
        kvcopy.copy_batch([1], [2], [3], max_ctas=value)


@FEW
@given(value=st.integers(max_value=0))
def test_max_ctas_below_one_is_a_value_error(value):
    with pytest.raises(ValueError, match="max_ctas"):
        kvcopy.copy_batch([1], [2], [3], max_ctas=value)


@FEW
@given(
    name=st.sampled_from(["host_ctas", "device_ctas", "batch_chunk", "threads_per_cta"]),
    value=st.one_of(NOT_INTS, st.integers(max_value=0), st.integers(min_value=1 << 25)),
)
def test_config_refuses_bad_values_and_keeps_the_old_one(name, value):
    old = getattr(kvcopy.config, name)
    if value is None and name in ("device_ctas", "host_ctas"):
        return  # None means "the device's own", these settings' default
    with pytest.raises((TypeError, ValueError), match=f"config.{name}"):
        setattr(kvcopy.config, name, value)
    assert getattr(kvcopy.config, name) == old


@pytest.mark.parametrize(
    "name, value", [("threads_per_cta", 1000), ("threads_per_cta", 48), ("host_ctas", -5), ("host_ctas", "4")]
)
def test_config_examples(name, value):
    with pytest.raises((TypeError, ValueError), match=name):
        setattr(kvcopy.config, name, value)


def test_config_has_no_unknown_settings():
    with pytest.raises(AttributeError, match="host_cta"):
        kvcopy.config.host_cta = 4


@pytest.mark.parametrize(
    "variable, value",
    [
        ("KVCOPY_HOST_CTAS", "sixteen"),
        ("KVCOPY_THREADS", "1000"),
        ("KVCOPY_BATCH_CHUNK", "-3"),
        ("KVCOPY_UNROLL", "x"),
    ],
)
def test_bad_environment_value_names_the_variable(variable, value):
    out = subprocess.run(
        [sys.executable, "-c", "import kvcopy"],
        capture_output=True,
        text=True,
        env=dict(os.environ, **{variable: value}),
        cwd=os.path.dirname(__file__),
    )
    assert out.returncode != 0
    assert "ValueError" in out.stderr and f"{variable}=" in out.stderr, out.stderr[-500:]


# ------------------------------------------------------------------ pinned_empty shapes


@FEW
@given(
    shape=st.one_of(
        st.text(max_size=3),
        st.floats(allow_nan=False),
        st.none(),
        st.lists(st.one_of(st.floats(allow_nan=False), st.text(max_size=2)), min_size=1, max_size=3).map(
            tuple
        ),
    )
)
def test_pinned_empty_shape_of_the_wrong_type(shape):
    with pytest.raises(TypeError, match="pinned_empty: shape"):
        kvcopy.pinned_empty(shape)


@FEW
@given(shape=st.lists(st.integers(min_value=1 << 22, max_value=1 << 40), min_size=3, max_size=4))
def test_pinned_empty_too_large_never_wraps(shape):
    with pytest.raises(ValueError, match="pinned_empty"):
        kvcopy.pinned_empty(tuple(shape), np.float64)


@pytest.mark.parametrize(
    "shape, kind",
    [
        ("10", TypeError),
        ((2.7, 3), TypeError),
        (1.5, TypeError),
        ((2**32, 2**32), ValueError),
        ((4, -1), ValueError),
    ],
)
def test_pinned_empty_examples(shape, kind):
    with pytest.raises(kind, match="pinned_empty"):
        kvcopy.pinned_empty(shape)


@pytest.mark.parametrize(
    "obj, kind", [("x", TypeError), (-1, ValueError), (0, ValueError), (2**64, ValueError)]
)
def test_device_pointer_checks_before_the_driver(obj, kind):
    with pytest.raises(kind, match="device_pointer"):
        kvcopy.device_pointer(obj)


# ------------------------------------------------------------------ block_view extents


@FEW
@given(
    address=st.integers(min_value=1, max_value=2**66),
    block=st.integers(min_value=1, max_value=2**40),
    count=st.integers(min_value=0, max_value=2**40),
    extra=st.integers(min_value=0, max_value=2**20),
)
def test_block_view_never_wraps_the_address_space(address, block, count, extra):
    try:
        view = kvcopy.block_view(address, block, num_blocks=count, block_stride=block + extra)
    except ValueError as exc:
        assert "block_view" in str(exc)
        return
    lay = view.layout
    assert lay.ptr < 2**64
    assert lay.ptr + (lay.num_blocks - 1) * lay.block_stride + lay.block_bytes <= 2**64 or not lay.num_blocks


def test_block_view_examples():
    with pytest.raises(ValueError, match="below 2\\*\\*64"):
        kvcopy.block_view(2**64, 16, num_blocks=1)
    with pytest.raises(ValueError, match="address space"):
        kvcopy.block_view(2**64 - 32, 16, num_blocks=4)


# ------------------------------------------------------------------ block ids and tensors


@FEW
@given(big=st.integers(min_value=2**63, max_value=2**64 - 1), row=st.integers(0, 3), column=st.integers(0, 1))
def test_uint64_block_ids_are_reported_as_given(big, row, column):
    mapping = np.zeros((4, 2), np.uint64)
    mapping[:, 1] = np.arange(4, dtype=np.uint64)
    mapping[row, column] = big
    side = "source" if column == 0 else "destination"
    with pytest.raises(ValueError, match=rf"block_mapping\[{row}\]: {side} block {big} "):
        plan_blocks(np.zeros((8, 16), np.uint8), np.zeros((8, 16), np.uint8), mapping)


@FEW
@given(pairs=st.integers(min_value=2, max_value=64), dup=st.booleans())
def test_duplicate_destinations_cost_follows_the_batch_not_the_pool(pairs, dup):
    huge = kvcopy.block_view(0x10000, 1, num_blocks=2**36)  # 64 Gi blocks: no bitmap of that
    ids = np.arange(pairs, dtype=np.int64) * 2**29
    if dup:
        ids[-1] = ids[0]
    mapping = np.stack([np.arange(pairs), ids], axis=1)
    if dup:
        with pytest.raises(ValueError, match="both write destination block 0"):
            plan_blocks(huge, huge, mapping)
    else:
        assert plan_blocks(huge, huge, mapping).num_pairs == pairs


@FEW
@given(
    ids=st.lists(st.integers(-3, 2**40), min_size=1, max_size=300),
    limit=st.sampled_from([64, 5000, 2**40]),
    sources=st.lists(st.integers(-3, 2**40)),
)
def test_the_one_pass_id_checks_agree_with_numpy(ids, limit, sources):
    """block_ids_ok, row_slots_ok and first_common_slot keep a bitmap of the ids while
    the range is at most 64 per id, else a hash table: the answers are NumPy's either way."""
    checks = cuda.plan_arrays
    dst = np.array(ids, np.int64) % (limit + 3) - 3 if limit < 2**40 else np.array(ids, np.int64)
    src = np.zeros(dst.size, np.int64)
    in_range = bool(((dst >= 0) & (dst < limit)).all())
    unique = np.unique(dst).size == dst.size
    assert checks.block_ids_ok(np.stack([src, dst], axis=1), 1, limit) == (in_range and unique)
    live = dst[dst >= 0]
    assert checks.row_slots_ok(dst, limit, True) == bool(
        (live < limit).all() and np.unique(live).size == live.size
    )
    assert checks.row_slots_ok(dst, limit, False) == bool((live < limit).all())
    a = np.array(sources, np.int64)
    a_live = set(int(v) for v in a if 0 <= v < limit)
    expected = next((j for j, v in enumerate(dst) if 0 <= v < limit and int(v) in a_live), -1)
    assert checks.first_common_slot(a, dst, limit) == expected


@pytest.mark.parametrize(
    "src, match",
    [
        (None, "src: expected a tensor or array, got NoneType"),
        (np.empty((4, 2), dtype=object), "Python objects"),
        ([np.zeros((4, 4)), "x"], r"src\[1\]"),
    ],
)
def test_swap_blocks_names_the_bad_tensor(src, match):
    dst = [np.zeros((4, 4))] * (len(src) if isinstance(src, list) else 1)
    with pytest.raises(TypeError, match=match):
        kvcopy.swap_blocks(
            src if isinstance(src, list) else src, dst if isinstance(src, list) else dst[0], [[0, 1]]
        )


# ------------------------------------------------------------------ streams


@FEW
@given(handle=st.floats(min_value=0, max_value=2**40, allow_nan=False))
def test_cuda_stream_protocol_with_a_float_handle_is_refused(handle):
    class FloatStream:
        def __cuda_stream__(self):
            return (0, handle)

    with pytest.raises(TypeError, match="float"):
        kvcopy.resolve_stream(FloatStream())


@FEW
@given(
    handle=st.one_of(st.integers(min_value=0, max_value=2), st.integers(min_value=4096, max_value=2**63 - 1)),
    kind=st.sampled_from([np.int64, np.uint64, int]),
)
def test_numpy_integers_are_stream_handles(handle, kind):
    assert kvcopy.resolve_stream(kind(handle)) == handle
