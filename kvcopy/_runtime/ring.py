"""Reusable descriptor buffers for large kernel launches, one ring per context.

A launch over thousands of copies gets its descriptors from a pinned slot: the
kernel reads them there in place (``Slot.mapped``, its device-side address),
or they are first copied to the slot's device buffer on the caller's stream;
either way the slot's event is recorded behind the kernel. A slot is reused
only after its event has completed, so a slot is never overwritten while a
copy or kernel on any stream may still read it.

A call reuses the slot of the call before when the GPU is done with it: its
cache lines are still in the CPU's cache, and writing 256 KiB of descriptors
into memory that is not costs more than describing them. Only a slot still in
flight makes the ring move on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvcopy._cuda import driver, memory
from kvcopy._runtime.context import PerContext
from kvcopy.policy import RING_MIN_CAPACITY_BYTES, RING_SLOTS


@dataclass
class Slot:
    capacity: int = 0
    host: int = 0
    mapped: int = 0  # where the device sees ``host``
    device: int = 0
    event: int = 0
    used: bool = False
    # buffers outgrown, kept: freeing them (cuMemFreeHost, cuMemFree) waits for all
    # work on the device, a whole model step under serving load, once per slot
    outgrown: list[tuple[int, int]] = field(default_factory=list)

    def ensure(self, nbytes: int) -> None:
        """Room for nbytes of staging (capacity in bytes, grown by powers of two). The
        buffers outgrown are kept, not freed: together smaller than the new ones."""
        if nbytes <= self.capacity:
            return
        capacity = max(RING_MIN_CAPACITY_BYTES, 1 << (nbytes - 1).bit_length())
        host = memory.host_alloc(capacity)
        try:
            device = memory.mem_alloc(capacity)
        except BaseException:
            memory.host_free(host)
            raise
        if self.host:
            self.outgrown.append((self.host, self.device))
        self.host, self.device, self.capacity = host, device, capacity
        self.mapped = memory.host_device_pointer(host)

    def free(self) -> None:
        """Free every buffer, outgrown ones too (the ring never does: only an owner of a
        slot of its own, once the GPU is done with it)."""
        for host, device in [(self.host, self.device), *self.outgrown]:
            if host:
                memory.host_free(host)
            if device:
                memory.mem_free(device)
        self.outgrown.clear()
        self.host = self.mapped = self.device = self.capacity = 0


class DescriptorRing:
    """Slots in the context current at creation: the current one while the GPU is
    done with it, else the next in turn."""

    def __init__(self, slots: int = RING_SLOTS) -> None:
        self._slots = [Slot(event=driver.event_create()) for _ in range(slots)]
        self._current = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> "_Reservation":
        """A free slot with room for nbytes, held until the with-block ends.

        Whoever makes the GPU read the slot calls ``fence(slot, stream)``; an
        unfenced slot, or one whose fence has completed, is handed out again
        by the next reserve.
        """
        return _Reservation(self, nbytes)

    def _acquire(self, nbytes: int) -> Slot:
        self._lock.acquire()
        try:
            slot = self._slots[self._current]
            if slot.used and not driver.event_query(slot.event):
                self._current = (self._current + 1) % len(self._slots)
                slot = self._slots[self._current]
                if slot.used:
                    driver.event_synchronize(slot.event)  # back-pressure: every slot in flight
            slot.used = False
            slot.ensure(nbytes)
        except BaseException:
            self._lock.release()
            raise
        return slot

    def _release(self, slot: Slot) -> None:
        self._lock.release()

    @staticmethod
    def fence(slot: Slot, stream: int) -> None:
        """Mark ``slot`` as read by work queued on ``stream`` up to now."""
        driver.event_record(slot.event, stream)
        slot.used = True


class _Reservation:
    """Context manager of DescriptorRing.reserve (a class: it runs on every call)."""

    __slots__ = ("ring", "nbytes", "slot")

    def __init__(self, ring: DescriptorRing, nbytes: int) -> None:
        self.ring, self.nbytes = ring, nbytes

    def __enter__(self) -> Slot:
        self.slot = self.ring._acquire(self.nbytes)
        return self.slot

    def __exit__(self, *exc: object) -> None:
        self.ring._release(self.slot)


_rings = PerContext(DescriptorRing)


def ring_for_current_context() -> DescriptorRing:
    """The descriptor ring of the calling thread's current context."""
    return _rings.current()
