"""Which context a copy runs in, with a faked multi-GPU driver (CPU).

Two devices, each with a primary context; created streams belong to one of
them. The real driver calls are replaced, so the logic of ContextScope and
memory_owner is checked without GPUs (two real GPUs: tests marked gpu).
"""

from __future__ import annotations

import pytest

from kvcopy import testing

from kvcopy.testing import engine

context = engine.context
memory_owner = engine.decide.memory_owner
from kvcopy.interop.streams import STREAM_LEGACY, STREAM_PER_THREAD

PRIMARY = {0: 0x1000, 1: 0x2000}
DEVICE_OF = {0x1000: 0, 0x2000: 1, 0x3000: 1}  # 0x3000: a non-primary context on device 1
STREAMS = {0xA0: 0x1000, 0xB1: 0x2000, 0xC1: 0x3000}


class FakeContextDriver:
    def __init__(self, current: int = 0) -> None:
        self.stack = [current] if current else []
        self.log: list[str] = []

    def init(self) -> None:
        pass

    def current_context(self) -> int:
        return self.stack[-1] if self.stack else 0

    def context_device(self) -> int:
        return DEVICE_OF[self.current_context()]

    def stream_context(self, stream: int) -> int:
        return STREAMS[stream]

    def primary_context(self, ordinal: int) -> int:
        return PRIMARY[ordinal]

    def push_context(self, ctx: int) -> None:
        self.log.append(f"push {ctx:#x}")
        self.stack.append(ctx)

    def pop_context(self) -> None:
        self.log.append(f"pop {self.stack[-1]:#x}")
        self.stack.pop()


@pytest.fixture
def fake(seams):
    def make(current: int = 0) -> FakeContextDriver:
        return seams.enter_context(testing.fake_cuda(FakeContextDriver(current), ("driver",)))

    return make


def test_created_stream_runs_in_its_own_context_and_restores_the_callers(fake):
    drv = fake(current=PRIMARY[0])
    with context.ContextScope(0xB1) as scope:
        assert drv.current_context() == PRIMARY[1]
        assert not scope.follow_memory(0)  # a created stream is never moved
    assert drv.stack == [PRIMARY[0]]


def test_created_stream_of_the_current_context_pushes_nothing(fake):
    drv = fake(current=PRIMARY[1])
    with context.ContextScope(0xB1):
        pass
    assert drv.log == []


def test_non_primary_context_of_a_stream_is_used(fake):
    drv = fake(current=PRIMARY[1])
    with context.ContextScope(0xC1):
        assert drv.current_context() == 0x3000
    assert drv.stack == [PRIMARY[1]]


@pytest.mark.parametrize("handle", [STREAM_LEGACY, STREAM_PER_THREAD])
def test_default_stream_follows_memory_on_another_device(fake, handle):
    drv = fake(current=PRIMARY[0])
    with context.ContextScope(handle) as scope:
        assert drv.log == []  # the caller's context serves until memory is known
        assert scope.follow_memory(1)
        assert drv.current_context() == PRIMARY[1]
    assert drv.stack == [PRIMARY[0]]  # caller's context left as it was


def test_default_stream_stays_when_memory_is_on_the_current_device(fake):
    drv = fake(current=PRIMARY[1])
    with context.ContextScope(STREAM_LEGACY) as scope:
        assert not scope.follow_memory(1)
    assert drv.log == []


def test_thread_without_context_gets_device_0_then_the_memorys_device(fake):
    drv = fake(current=0)
    with context.ContextScope(STREAM_LEGACY) as scope:
        assert drv.current_context() == PRIMARY[0]
        assert scope.follow_memory(1)
        assert drv.stack == [PRIMARY[1]]  # device 0's push was undone, not stacked
    assert drv.stack == []


@pytest.mark.parametrize("ordinal", [-1, -2])
def test_no_or_mixed_device_memory_does_not_move(fake, ordinal):
    drv = fake(current=PRIMARY[1])
    with context.ContextScope(STREAM_LEGACY) as scope:
        assert not scope.follow_memory(ordinal)
    assert drv.log == []


def test_context_is_restored_when_the_copy_raises(fake):
    drv = fake(current=PRIMARY[0])
    with pytest.raises(RuntimeError):
        with context.ContextScope(STREAM_LEGACY) as scope:
            scope.follow_memory(1)
            raise RuntimeError("copy failed")
    assert drv.stack == [PRIMARY[0]]


@pytest.mark.parametrize(
    "src, dst, owner",
    [
        (-1, -1, -1),
        (0, -1, 0),
        (-1, 1, 1),
        (1, 1, 1),
        (0, 1, -2),
        (-2, 0, -2),
        (-2, -1, -2),
    ],
)
def test_memory_owner(src, dst, owner):
    assert memory_owner(src, dst) == owner
