"""Fakes shared by the CPU tests that run kvcopy's issue paths with the driver faked."""
from __future__ import annotations

import importlib

from typing import Any

from kvcopy._engine import decide
from kvcopy._runtime import device, kernels, ring
from kvcopy.policy import DeviceCaps, Thresholds


class FakeRing:
    """A descriptor ring whose every reservation is ``slot`` (too small a request fails)."""

    def __init__(self, slot: ring.Slot) -> None:
        self.slot = slot

    def reserve(self, nbytes: int) -> "FakeRing":
        assert nbytes <= self.slot.capacity
        return self

    def __enter__(self) -> ring.Slot:
        return self.slot

    def __exit__(self, *exc: object) -> None:
        pass


class FakeScope:
    """A context scope that stays put: entering it changes no context, and the memory
    of a batch never asks for another device's context."""

    on_default_stream = False

    def __init__(self, handle: int = 0) -> None:
        self.handle = handle

    def __enter__(self) -> "FakeScope":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def follow_memory(self, ordinal: int) -> bool:
        return False


class FakeCaptureDriver:
    """The driver calls of deciding a batch: device 0's context, and a stream that is
    capturing when ``capturing`` is set."""

    capturing = 0

    def context_device(self) -> int:
        return 0

    def stream_capture_status(self, handle: int) -> int:
        return self.capturing


# The modules that issue a batch (the engine's paths) and the kvcopy._cuda modules
# they call; a CPU test fakes those calls through fake_cuda_calls, not module by module.
ENGINE_MODULES = ("kvcopy._engine.decide", "kvcopy._engine.dispatch", "kvcopy._engine.kernel")
CUDA_LAYERS = ("driver", "describe", "launch")


def fake_cuda_calls(monkeypatch, fake: object, layers: tuple[str, ...] = CUDA_LAYERS) -> None:
    """Every engine module's calls into kvcopy._cuda's ``layers`` go to ``fake`` for the
    test, and the decisions remembered with the real driver are dropped."""
    for name in ENGINE_MODULES:
        module = importlib.import_module(name)
        for layer in layers:
            if hasattr(module, layer):
                monkeypatch.setattr(module, layer, fake)
    monkeypatch.setattr(decide, "_targets", {})


def fake_device(monkeypatch, caps: DeviceCaps | None = None, *, kernel: Any = None,
                slot: ring.Slot | None = None, ring_driver: Any = None) -> None:
    """Device 0 as the engine sees it for the test: a device with ``caps`` (an H200's
    by default) and the default thresholds, no decision remembered; where given,
    ``kernel`` as the copy kernel loaded in the context, every descriptor-ring
    reservation ``slot``, and the ring's fences recorded by ``ring_driver``."""
    info = device.DeviceInfo(0, "fake", (9, 0), 13000, caps or DeviceCaps())
    monkeypatch.setitem(device._infos, 0, info)
    monkeypatch.setitem(device._thresholds, 0, Thresholds())
    monkeypatch.setattr(decide, "_targets", {})
    if kernel is not None:
        monkeypatch.setattr(kernels, "kernel_for_current_context", lambda *args: kernel)
    if slot is not None:
        monkeypatch.setattr(ring, "ring_for_current_context", lambda: FakeRing(slot))
    if ring_driver is not None:
        monkeypatch.setattr(ring, "driver", ring_driver)
