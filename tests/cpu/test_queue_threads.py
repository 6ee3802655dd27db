"""TransferQueue under several threads, with the driver faked through the seam: a
thread waiting for the GPU holds no lock that submit needs, a wait can be bounded, and
close refuses what comes after it while reporting every job submitted before it, each
job's events released once."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvcopy
from kvcopy.testing import fake_cuda


class FakeEvents:
    """The driver calls a queue makes, with events the test completes by hand."""

    def __init__(self) -> None:
        self.done: dict[int, threading.Event] = {}
        self.destroyed: list[int] = []
        self.next = 1
        self.lock = threading.Lock()

    def event_create(self, timing: bool = False) -> int:
        with self.lock:
            handle, self.next = self.next, self.next + 1
        self.done[handle] = threading.Event()
        return handle

    def event_record(self, event: int, stream: int) -> None:
        pass

    def event_synchronize(self, event: int) -> None:
        assert event not in self.destroyed, "waited on a destroyed event"
        self.done[event].wait()

    def event_query(self, event: int) -> bool:
        assert event not in self.destroyed, "queried a destroyed event"
        return self.done[event].is_set()

    def event_elapsed_ms(self, start: int, end: int) -> float:
        return 1.0

    def event_destroy(self, event: int) -> None:
        assert event not in self.destroyed, "destroyed twice"
        self.destroyed.append(event)

    def complete_all(self) -> None:
        for flag in self.done.values():
            flag.set()

    def push_context(self, ctx: object) -> None:
        pass

    def pop_context(self) -> None:
        pass

    def stream_synchronize(self, stream: int) -> None:
        pass

    def stream_destroy(self, stream: int) -> None:
        pass


def queue_without_gpu() -> kvcopy.TransferQueue:
    """A TransferQueue whose copies are stood in for (its jobs' events are the fake's)."""
    queue = object.__new__(kvcopy.TransferQueue)
    src, dst = np.zeros((8, 16), np.uint8), np.zeros((8, 16), np.uint8)
    from kvcopy._plans.blocks import block_geometry

    queue.src, queue.dst, queue.split_blocks, queue.method = [src], [dst], False, "auto"
    queue._geometry = block_geometry(queue.src, queue.dst)
    queue._back_geometry = None
    queue._ctx, queue._stream, queue._touches_gpu = 1, 2, False
    from collections import deque

    queue._pending, queue._lock, queue._closed = deque(), threading.Lock(), False
    queue._execute = lambda plan, back: ("kernel", "")  # type: ignore[method-assign]
    return queue


@pytest.fixture
def events():
    fake = FakeEvents()
    with fake_cuda(fake, ("driver",)):
        yield fake


def test_submit_does_not_wait_behind_another_threads_wait(events):
    queue = queue_without_gpu()
    queue.submit("first", [[0, 1]])
    reported: list = []
    waiting = threading.Thread(target=lambda: reported.extend(queue.wait()))
    waiting.start()
    submitted = threading.Thread(target=queue.submit, args=("second", [[2, 3]]))
    submitted.start()
    submitted.join(timeout=10)
    assert not submitted.is_alive(), "submit waited for the GPU behind wait()"
    assert [job.job_id for job in queue._pending] == ["first", "second"]
    events.complete_all()
    waiting.join(timeout=10)
    assert not waiting.is_alive()
    reported += queue.wait()
    assert [r.job_id for r in reported] == ["first", "second"]  # each once, in order


def test_wait_is_bounded_by_its_timeout_and_the_job_stays_pending(events):
    queue = queue_without_gpu()
    queue.submit("slow", [[0, 1]])
    with pytest.raises(TimeoutError, match="job 'slow' was not done within the timeout"):
        queue.wait(timeout=0.01)
    assert [job.job_id for job in queue._pending] == ["slow"]
    events.complete_all()
    results = queue.wait(timeout=5)
    assert [(r.job_id, r.ok) for r in results] == [("slow", True)]
    assert sorted(events.destroyed) == sorted(events.done)  # each event released once


@pytest.mark.parametrize(
    "timeout, error", [("1", TypeError), (True, TypeError), (-1, ValueError), (float("nan"), ValueError)]
)
def test_a_bad_timeout_is_named(events, timeout, error):
    queue = queue_without_gpu()
    with pytest.raises(error, match="timeout must be"):
        queue.wait(timeout=timeout)


def test_close_reports_every_job_submitted_before_it_and_refuses_later_ones(events):
    queue = queue_without_gpu()
    for k in range(3):
        queue.submit(k, [[k, k]])
    events.complete_all()
    assert [r.job_id for r in queue.close()] == [0, 1, 2]
    with pytest.raises(kvcopy.KVCopyError, match="TransferQueue is closed"):
        queue.submit("late", [[0, 1]])
    assert queue.close() == []
    assert sorted(events.destroyed) == sorted(events.done)


def test_a_job_reported_by_poll_while_another_thread_waits_on_it_is_released_once(events):
    queue = queue_without_gpu()
    queue.submit("job", [[0, 1]])
    waiting = threading.Thread(target=queue.wait)
    waiting.start()
    while not queue._pending[0].waiters:  # (the waiter holds the job's end event)
        threading.Event().wait(0.001)
    events.complete_all()
    assert [r.job_id for r in queue.poll()] == ["job"]  # reported here, events kept
    waiting.join(timeout=10)
    assert not waiting.is_alive()
    assert sorted(events.destroyed) == sorted(events.done)
