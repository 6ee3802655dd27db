"""resolve_stream and default-stream handling (CPU)."""

from __future__ import annotations

import numpy as np
import pytest

import kvcopy
from kvcopy.interop import streams


class ProtocolStream:
    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class PropertyProtocolStream:
    __cuda_stream__ = (0, 0xABC000)


@pytest.mark.parametrize("value", [0, 1, 2, 4096, 0xDEADBEEF, 2**64 - 1])
def test_ints_are_handles(value):
    assert kvcopy.resolve_stream(value) == value


@pytest.mark.parametrize("value", [3, 35, 4095])
def test_small_ints_past_the_default_streams_are_refused(value):
    """A torch stream's stream_id (small: 3, 35, ...) or a device index passed as a
    handle would crash the driver: a ValueError that says what a handle is instead."""
    message = (
        rf"^stream: handle {value} is not a valid CUstream value: handles are 0 "
        r"\(default\), 1 \(legacy\), 2 \(per-thread\) or the address of a CUstream, "
        r"never below 4096 \(a torch stream's stream_id"
    )
    for given in (value, np.int64(value), ProtocolStream(value)):
        with pytest.raises(ValueError, match=message):
            kvcopy.resolve_stream(given)


def test_none_is_default_stream():
    assert kvcopy.resolve_stream(None) == 0


def test_cuda_stream_protocol_method_and_attribute():
    assert kvcopy.resolve_stream(ProtocolStream(0x1234)) == 0x1234
    assert kvcopy.resolve_stream(PropertyProtocolStream()) == 0xABC000


@pytest.mark.parametrize("bad", ["0", 1.5, object(), [1], b"\x01"])
def test_unknown_objects_are_type_errors_naming_the_type(bad):
    with pytest.raises(TypeError, match=type(bad).__name__):
        kvcopy.resolve_stream(bad)


def test_bool_is_rejected():
    with pytest.raises(TypeError, match="bool"):
        kvcopy.resolve_stream(True)


@pytest.mark.parametrize("value", [-1, 2**64])
def test_out_of_range_handles(value):
    with pytest.raises(ValueError, match="not a valid CUstream"):
        kvcopy.resolve_stream(value)


def test_protocol_returning_garbage():
    with pytest.raises(TypeError, match="__cuda_stream__"):
        kvcopy.resolve_stream(ProtocolStream.__new__(type("X", (), {"__cuda_stream__": lambda s: 5})))


def test_cuda_bindings_custream():
    driver = pytest.importorskip("cuda.bindings.driver")
    assert kvcopy.resolve_stream(driver.CUstream(0x5000)) == 0x5000


def test_effective_handle_maps_zero(monkeypatch):
    monkeypatch.delenv("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", raising=False)
    assert streams.effective_handle(0) == streams.STREAM_LEGACY
    monkeypatch.setenv("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "1")
    assert streams.effective_handle(0) == streams.STREAM_PER_THREAD
    assert streams.effective_handle(0x1234) == 0x1234
    assert streams.effective_handle(1) == streams.STREAM_LEGACY


def test_stream_kinds():
    assert streams.stream_kind(1) == "legacy"
    assert streams.stream_kind(2) == "per_thread"
    assert streams.stream_kind(0x7000) == "created"


def test_framework_stream_defaults_to_zero_for_plain_arrays():
    import numpy as np

    assert streams.current_framework_stream(np.zeros(3, np.int64), [1, 2]) == 0
