"""kvcopy.prepare with the driver, the device facts and the ring faked (CPU): which
context it prepares, and that a context it pushed is popped whatever happens."""

from __future__ import annotations

import pytest

from kvcopy import testing

import kvcopy
from kvcopy.testing import engine

prepare = engine.prepare


class Fakes:
    """The driver calls prepare makes, and the two things it prepares, logged."""

    def __init__(self, current: int = 0) -> None:
        self.current = current
        self.stack: list[int] = []
        self.log: list[str] = []
        self.fail_device_info = False

    # driver
    def init(self) -> None:
        self.log.append("init")

    def current_context(self) -> int:
        return self.stack[-1] if self.stack else self.current

    def primary_context(self, ordinal: int) -> int:
        return 0x100 + ordinal

    def push_context(self, ctx: int) -> None:
        self.log.append(f"push {ctx:#x}")
        self.stack.append(ctx)

    def pop_context(self) -> None:
        self.log.append(f"pop {self.stack.pop():#x}")

    def context_device(self) -> int:
        return self.current_context() - 0x100 if self.stack else 5

    # device facts and ring
    def device_info(self, ordinal: int) -> None:
        if self.fail_device_info:
            raise RuntimeError("fake: no such device")
        self.log.append(f"device_info {ordinal} in {self.current_context():#x}")

    def ring_for_current_context(self) -> None:
        self.log.append(f"ring in {self.current_context():#x}")


@pytest.fixture
def fakes(monkeypatch, seams) -> Fakes:
    fake = seams.enter_context(testing.fake_cuda(Fakes(), ("driver",)))
    monkeypatch.setattr(prepare.devices, "device_info", fake.device_info)
    monkeypatch.setattr(prepare.ring, "ring_for_current_context", fake.ring_for_current_context)
    return fake


def test_prepare_is_public():
    assert kvcopy.prepare is prepare.prepare and "prepare" in kvcopy.__all__


def test_a_device_is_prepared_in_its_primary_context_which_is_then_popped(fakes):
    kvcopy.prepare(2)
    assert fakes.log == ["init", "push 0x102", "device_info 2 in 0x102", "ring in 0x102", "pop 0x102"]
    assert fakes.stack == []


def test_no_device_means_the_current_context_pushing_nothing(fakes):
    fakes.current = 0x777  # a context the caller made current (device 5 in the fake)
    kvcopy.prepare()
    assert fakes.log == ["init", "device_info 5 in 0x777", "ring in 0x777"]


def test_no_device_and_no_current_context_means_device_0(fakes):
    kvcopy.prepare()
    assert fakes.log == ["init", "push 0x100", "device_info 0 in 0x100", "ring in 0x100", "pop 0x100"]


def test_a_failure_still_pops_the_context_it_pushed(fakes):
    fakes.fail_device_info = True
    with pytest.raises(RuntimeError, match="no such device"):
        kvcopy.prepare(1)
    assert fakes.log == ["init", "push 0x101", "pop 0x101"] and fakes.stack == []
