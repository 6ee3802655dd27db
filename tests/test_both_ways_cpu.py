"""copy_both_ways' ordering and validation, with the driver faked (CPU): under capture
both sides stay on the capturing stream; otherwise a side that does not share the
kernel launch runs on kvcopy's side stream, forked from the caller's stream before
anything is issued and joined back after; a bad side stops both before either runs."""
from __future__ import annotations

import numpy as np
import pytest

from kvcopy import both_ways

HANDLE, SIDE = 0x1234, 0x5678


class Recorder:
    """The driver calls and issues both_ways makes, in order."""

    def __init__(self, capturing: int = 0, fused=None, bad: str | None = None) -> None:
        self.calls: list[str] = []
        self.capturing, self.fused, self.bad = capturing, fused, bad

    # kvcopy._cuda.driver
    def stream_capture_status(self, handle: int) -> int:
        return self.capturing

    def stream_wait_stream(self, consumer: int, producer: int) -> None:
        self.calls.append(f"{consumer:#x} waits for {producer:#x}")

    # kvcopy._cuda.dma
    def plan_dma(self, src, dst, sizes, merge):
        self.calls.append(f"check {len(sizes)}")
        if self.bad is not None and len(sizes) == 3:
            raise ValueError(self.bad)

    # kvcopy.engine
    def execute_copies(self, scope, handle, src, dst, sizes, method, merge, access_any, ctas):
        self.calls.append(f"issue {len(sizes)} on {handle:#x}")
        return "batch"


class FakeScope:
    def __init__(self, handle: int = 0) -> None:
        pass

    def __enter__(self) -> "FakeScope":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture
def record(monkeypatch):
    def install(**kw) -> Recorder:
        rec = Recorder(**kw)
        monkeypatch.setattr(both_ways, "driver", rec)
        monkeypatch.setattr(both_ways, "dma", rec)
        monkeypatch.setattr(both_ways.engine, "execute_copies", rec.execute_copies)
        monkeypatch.setattr(both_ways, "ContextScope", FakeScope)
        monkeypatch.setattr(both_ways, "_side_stream", lambda: SIDE)
        monkeypatch.setattr(both_ways, "_fused", lambda *a: rec.fused)
        return rec
    return install


def batch(n: int) -> tuple:
    return (np.arange(n, dtype=np.uint64) + 0x10000, np.arange(n, dtype=np.uint64) + 0x7f0000000,
            np.full(n, 8, dtype=np.uint64))


def test_apart_the_second_side_runs_on_a_forked_and_joined_stream(record):
    rec = record()
    assert both_ways.execute_both(batch(2), batch(3), HANDLE) == ("batch", "batch")
    assert rec.calls == ["check 2", "check 3", f"{SIDE:#x} waits for {HANDLE:#x}",
                         f"issue 2 on {HANDLE:#x}", f"issue 3 on {SIDE:#x}",
                         f"{HANDLE:#x} waits for {SIDE:#x}"]


def test_one_launch_when_both_go_to_the_kernel(record):
    rec = record(fused=("kernel", "kernel"))
    assert both_ways.execute_both(batch(2), batch(3), HANDLE) == ("kernel", "kernel")
    assert rec.calls == []


def test_under_capture_both_stay_on_the_capturing_stream(record):
    rec = record(capturing=1)
    both_ways.execute_both(batch(2), batch(3), HANDLE, "auto")
    assert rec.calls == ["check 2", "check 3", f"issue 2 on {HANDLE:#x}",
                         f"issue 3 on {HANDLE:#x}"]


def test_a_bad_second_side_stops_both_before_either_runs(record):
    rec = record(bad="src_ptrs[1] = 0x2a: not readable")
    with pytest.raises(ValueError, match=r"^load: src_ptrs\[1\] = 0x2a"):
        both_ways.execute_both(batch(2), batch(3), HANDLE, names=("store", "load"))
    assert not any(call.startswith(("issue", "0x")) for call in rec.calls)
