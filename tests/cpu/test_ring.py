"""The descriptor ring's reuse rules, with a faked driver (CPU).

A slot the GPU may still read (fenced, event not complete) is never handed
out: the ring moves on, and waits only when the next slot is in flight too.
An unfenced slot, or one whose event has completed, is handed out again at
once; slots grow by powers of two, keeping the buffers they outgrow, and the lock
is released even when staging fails.
"""

from __future__ import annotations

import threading
import types

import pytest

from kvcopy import testing

from kvcopy import policy
from kvcopy.testing import engine

ring = engine.ring


class FakeRingDriver:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.next_address = 0x10000
        self.fail_alloc = False
        self.fail_mem_alloc = False
        self.completed: set[int] = set()  # events the GPU has passed

    def event_query(self, event: int) -> bool:
        self.log.append(f"query {event:#x}")
        return event in self.completed

    def _address(self) -> int:
        self.next_address += 0x100000
        return self.next_address

    def event_create(self) -> int:
        return self._address()

    def event_record(self, event: int, stream: int) -> None:
        self.log.append(f"record {event:#x} on {stream}")
        self.completed.discard(event)

    def event_synchronize(self, event: int) -> None:
        self.log.append(f"wait {event:#x}")

    def host_alloc(self, nbytes: int) -> int:
        if self.fail_alloc:
            raise MemoryError("fake: out of pinned memory")
        self.log.append(f"host_alloc {nbytes}")
        return self._address()

    def host_device_pointer(self, ptr: int) -> int:
        return ptr + 0x1  # anything but the host address, to tell the two apart

    def mem_alloc(self, nbytes: int) -> int:
        if self.fail_mem_alloc:
            raise MemoryError("fake: out of device memory")
        self.log.append(f"mem_alloc {nbytes}")
        return self._address()

    def host_free(self, ptr: int) -> None:
        self.log.append("host_free")

    def mem_free(self, ptr: int) -> None:
        self.log.append("mem_free")


@pytest.fixture
def driver(seams) -> FakeRingDriver:
    return seams.enter_context(testing.fake_cuda(FakeRingDriver(), ("driver", "memory")))


def test_unfenced_slot_is_handed_out_again_without_waiting(driver):
    r = ring.DescriptorRing(slots=2)
    with r.reserve(1000) as first:
        pass
    with r.reserve(1000) as second:
        pass
    assert first is second
    assert not any(line.startswith("wait") for line in driver.log)


def test_slots_in_flight_rotate_and_are_waited_for_before_reuse(driver):
    r = ring.DescriptorRing(slots=2)
    seen = []
    for stream in (7, 8, 9):
        with r.reserve(1000) as slot:
            seen.append(slot)
            ring.DescriptorRing.fence(slot, stream)
    assert seen[0] is not seen[1] and seen[2] is seen[0]
    waits = [line for line in driver.log if line.startswith("wait")]
    assert waits == [f"wait {seen[0].event:#x}"]  # only the reuse of a slot in flight waits
    assert f"record {seen[0].event:#x} on 9" in driver.log


def test_a_slot_the_gpu_is_done_with_is_reused_at_once(driver):
    r = ring.DescriptorRing(slots=2)
    with r.reserve(1000) as first:
        ring.DescriptorRing.fence(first, 7)
    driver.completed.add(first.event)
    with r.reserve(1000) as second:
        ring.DescriptorRing.fence(second, 7)
    assert second is first
    assert not any(line.startswith("wait") for line in driver.log)
    with r.reserve(1000) as third:  # still in flight now: the ring moves on
        pass
    assert third is not first


def test_slots_grow_by_powers_of_two_and_keep_the_old_buffers(driver):
    r = ring.DescriptorRing(slots=1)
    with r.reserve(1000) as slot:
        assert slot.capacity == policy.RING_MIN_CAPACITY_BYTES
        old = (slot.host, slot.device)
    with r.reserve(policy.RING_MIN_CAPACITY_BYTES + 1) as slot:
        assert slot.capacity == 2 * policy.RING_MIN_CAPACITY_BYTES
        assert slot.mapped == slot.host + 0x1  # the device's view of the new pinned buffer
        assert (slot.host, slot.device) != old and slot.outgrown == [old]
    # (freeing them would wait for all work on the device)
    assert "host_free" not in driver.log and "mem_free" not in driver.log
    with r.reserve(10) as slot:  # never shrinks
        assert slot.capacity == 2 * policy.RING_MIN_CAPACITY_BYTES


def test_a_failed_growth_keeps_the_slot_as_it_was(driver):
    r = ring.DescriptorRing(slots=1)
    with r.reserve(1000) as slot:
        before = (slot.host, slot.mapped, slot.device, slot.capacity)
    driver.fail_mem_alloc = True
    with pytest.raises(MemoryError):
        with r.reserve(policy.RING_MIN_CAPACITY_BYTES + 1):
            pass
    assert driver.log.count("host_free") == 1  # the new pinned buffer, not the old
    assert (slot.host, slot.mapped, slot.device, slot.capacity) == before
    assert slot.outgrown == []
    driver.fail_mem_alloc = False
    with r.reserve(1000) as again:  # the lock was released
        assert again is slot


def test_a_failure_inside_or_while_staging_releases_the_lock(driver):
    r = ring.DescriptorRing(slots=1)
    with pytest.raises(RuntimeError):
        with r.reserve(1000):
            raise RuntimeError("launch failed")
    driver.fail_alloc = True
    with pytest.raises(MemoryError):
        with r.reserve(10 * policy.RING_MIN_CAPACITY_BYTES):
            pass
    driver.fail_alloc = False
    done = threading.Event()

    def other_thread() -> None:
        with r.reserve(1000):
            done.set()

    t = threading.Thread(target=other_thread)
    t.start()
    t.join(timeout=5)
    assert done.is_set()


def test_threads_racing_on_first_use_share_one_per_context(seams):
    """PerContext (rings, the side stream): one creation per context even when many
    threads ask first at once; another context gets its own."""
    from kvcopy.testing import engine

    context = engine.context

    current = threading.local()
    seams.enter_context(
        testing.fake_cuda(
            types.SimpleNamespace(current_context_key=lambda: getattr(current, "ctx", 7)), ("driver",)
        )
    )
    made: list[int] = []
    gate = threading.Barrier(8)

    def create() -> int:
        made.append(len(made))
        return len(made)

    table = context.PerContext(create)
    slow = context.PerContext(create)
    seen: list[int] = []

    def first_use() -> None:
        gate.wait()
        seen.append(table.current())

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [0] and seen == [1] * 8
    current.ctx = 9
    assert table.current() == 2 and slow.current() == 3 and table.current() == 2
    current.ctx = 7
    assert table.current() == 1 and len(made) == 3


def test_a_slot_owner_frees_the_buffers_the_slot_has_and_has_outgrown(driver):
    slot = ring.Slot()
    slot.ensure(1000)
    slot.ensure(policy.RING_MIN_CAPACITY_BYTES + 1)
    slot.ensure(4 * policy.RING_MIN_CAPACITY_BYTES + 1)
    assert len(slot.outgrown) == 2
    driver.log.clear()
    slot.free()
    assert driver.log.count("host_free") == 3 and driver.log.count("mem_free") == 3
    assert (slot.host, slot.mapped, slot.device, slot.capacity, slot.outgrown) == (0, 0, 0, 0, [])
    slot.free()  # nothing left: nothing freed twice
    assert driver.log.count("host_free") == 3
