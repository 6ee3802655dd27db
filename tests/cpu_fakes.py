"""Fakes shared by the CPU tests that run kvcopy's issue paths with the driver faked."""
from __future__ import annotations

from kvcopy._runtime import ring


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
