"""TransferQueue: ordered asynchronous block transfers between two fixed caches."""

from __future__ import annotations

import math
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Hashable, Iterable

import numpy as np

from kvcopy._engine import blocks, both_ways, decide
from kvcopy._cuda import classify, driver
from kvcopy._plans.blocks import BlockGeometry, BlockPlan, block_geometry, crossing_pairs
from kvcopy._runtime.context import ContextScope
from kvcopy.errors import KVCopyError
from kvcopy.interop.arrays import as_list
from kvcopy.interop.streams import (
    STREAM_LEGACY,
    current_framework_streams,
    effective_handle,
    resolve_event,
    resolve_stream,
)
from kvcopy.policy import RequestedMethod, check_method
from kvcopy._runtime.prepare import prepare_current_context

_GPU_KINDS = classify.KIND_DEVICE | classify.KIND_MANAGED | classify.KIND_PEER | classify.KIND_PEER_UNMAPPED


def _seconds(timeout: Any) -> float:
    """``timeout`` as seconds (TypeError or ValueError naming it)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
    if not math.isfinite(timeout) or timeout < 0:
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout}")
    return float(timeout)


def _swap_sides(message: str) -> str:
    """A message about the copy from dst to src, with the tensors named as the queue's."""
    return re.sub(r"\b(src|dst)\b", lambda m: "dst" if m.group(1) == "src" else "src", message)


@dataclass(frozen=True)
class TransferResult:
    """One finished job: its id, bytes moved (both ways for a job with ``back``), GPU
    seconds it took, whether it succeeded, and the method that ran (``back_method``:
    the copy back's, '' for a job without one)."""

    job_id: Hashable
    bytes: int
    seconds: float
    ok: bool
    method: str = ""
    error: str = ""
    back_method: str = ""


@dataclass
class _Job:
    job_id: Hashable
    nbytes: int
    method: str
    start: int
    end: int
    back_method: str = ""
    waiters: int = 0  # threads in wait() on this job's end event, outside the lock
    finished: bool = False  # reported; its events go with the last waiter


class TransferQueue:
    """Ordered, asynchronous transfers from ``src`` caches to ``dst`` caches.

    Jobs run in submission order on the queue's own stream; ``submit`` never
    waits for the GPU. When either cache is GPU memory (however it is
    described: tensor, BlockView, cuda.core Buffer), a job first waits (on the
    GPU) for the work already queued on the caller's current stream, so a
    store issued right after the compute that wrote the blocks copies the
    final bytes, and a load does not overwrite blocks that queued work still
    reads; ``submit(..., after=...)`` names other streams or events instead.
    Completion is tracked with CUDA events.

    Args:
        src, dst: tensors or equal-length sequences of tensors, as for
            :func:`kvcopy.swap_blocks`. Their addresses and shapes are read
            once, here: the caches must stay where they are (no resize or
            reallocation) while the queue is open.
        method: passed to swap_blocks for every job.
        split_blocks: as for swap_blocks.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self, src: Any, dst: Any, *, method: RequestedMethod = "auto", split_blocks: bool = False
    ) -> None:
        check_method(method)
        self.src, self.dst = as_list(src), as_list(dst)
        self.method = method
        self.split_blocks = split_blocks
        # the caches are fixed: read their geometry once, not on every submit
        self._geometry = geometry = block_geometry(self.src, self.dst, split_blocks=split_blocks)
        self._back_geometry: BlockGeometry | None = None  # read at the first job with back
        caller = effective_handle(self._caller_streams()[0][0])
        with ContextScope(caller) as scope:
            src_kinds, src_device = classify.classify_pointers(
                geometry.src_base, geometry.src_extent, np.empty_like(geometry.src_base)
            )
            dst_kinds, dst_device = classify.classify_pointers(
                geometry.dst_base, geometry.dst_extent, np.empty_like(geometry.dst_base)
            )
        # The queue's stream lives on the device that holds the caches; between two
        # GPUs, on the source's, whose kernel then reads locally and writes remotely.
        owner = decide.memory_owner(src_device, dst_device)
        home = src_device if owner == -2 and src_device >= 0 else owner
        with ContextScope(caller if home < 0 else STREAM_LEGACY) as scope:
            scope.follow_memory(home)
            self._ctx = driver.current_context()
            self._stream = driver.stream_create(non_blocking=True)
            # a queue is made at startup: load the kernel now, not in the first step
            # (loading a module waits for all work on the GPU)
            prepare_current_context()
        self._pending: deque[_Job] = deque()
        self._lock = threading.Lock()
        self._closed = False
        # Jobs that read or write GPU memory are ordered after the caller's work:
        # decided from the memory itself, whatever object describes it.
        self._touches_gpu = bool((src_kinds | dst_kinds) & _GPU_KINDS)

    def _push(self) -> None:
        driver.push_context(self._ctx)

    def _caller_streams(self) -> list[tuple[int, int]]:
        """The caller's current stream on each device holding the caches (see
        current_framework_streams): the first source and destination tensors say."""
        return current_framework_streams(self.src[0] if self.src else None, self.dst[0] if self.dst else None)

    def _dependencies(self, after: Any) -> list[tuple[str, int, int]]:
        """What a job waits for: ('event', handle, -1) or ('stream', handle, device)
        entries (device -1: the handle means a stream of the queue's context)."""
        if after is None:
            if not self._touches_gpu:
                return []
            # streams that array-interface producers declared are waited for by
            # submit, for every job, whatever ``after`` says
            streams = [(effective_handle(h), d) for h, d in self._caller_streams()]
            return [("stream", h, d) for i, (h, d) in enumerate(streams) if (h, d) not in streams[:i]]
        items = list(after) if isinstance(after, (list, tuple)) else [after]
        found = []
        for index, item in enumerate(items):
            where = f"after[{index}]" if isinstance(after, (list, tuple)) else "after"
            event = resolve_event(item)
            if event is not None:
                if event:  # a torch Event never recorded has no handle: nothing to wait for
                    found.append(("event", event, -1))
                continue
            try:
                found.append(("stream", effective_handle(resolve_stream(item)), -1))
            except (TypeError, ValueError) as exc:
                detail = str(exc).removeprefix("stream: ")
                raise type(exc)(f"{where}: expected a stream or an event; {detail}") from None
        return found

    def submit(self, job_id: Hashable, block_mapping: Any, *, back: Any = None, after: Any = None) -> None:
        """Queue the copy of ``block_mapping`` pairs; returns without waiting for the GPU.

        Args:
            job_id: any hashable; :meth:`wait` and the results name the job by it.
            block_mapping: (n, 2) [source block, destination block] pairs.
            back: (m, 2) [destination block, source block] pairs copied the other
                way, from the ``dst`` caches back into the ``src`` caches, in the
                same job: a step's stores and loads at once. Both go out together
                as swap_blocks_both_ways sends them (below 128 KiB blocks one
                kernel launch with CTAs split by direction, which two queues on
                two streams cannot share; from there the copy engines, both
                started at once). The two are not ordered with each other, so a
                block one of them writes must not be one the other reads, nor,
                in a queue between a set of caches and itself, one the other
                writes (ValueError); submit two jobs to order them. Needs
                ``src`` writable.
            after: what the job waits for on the GPU before it starts: a stream
                (anything :func:`kvcopy.resolve_stream` accepts; the work queued
                on it so far), an event (torch, CuPy, cuda.core, CUevent), or a
                list of them. None (default): when either cache is GPU memory,
                the caller's current stream (the current stream of the caches'
                framework, else the default stream), so that a store copies
                the final bytes and a load does not overwrite blocks that
                queued work still reads. ``after=[]`` waits for nothing but
                what the caches' protocols require: a stream that an
                array-interface producer declared (CuPy, Numba) is waited for
                by every job, whatever ``after`` says.

        Raises:
            TypeError, ValueError: bad ids, ``back`` or ``after``, before anything is
                queued.
        """
        try:
            hash(job_id)
        except TypeError:
            raise TypeError(
                f"job_id must be hashable (wait() and the results name the job "
                f"by it); got a {type(job_id).__name__}"
            ) from None
        with self._lock:
            if self._closed:
                raise KVCopyError("TransferQueue is closed")
            plan = self._geometry.with_mapping(block_mapping)
            back_plan = None if back is None else self._plan_back(plan, back)
            dependencies = self._dependencies(after)
            self._push()
            start = end = 0
            try:
                start, end = driver.event_create(timing=True), driver.event_create(timing=True)
                for kind, handle, device in dependencies:
                    if kind == "event":
                        driver.stream_wait_event(self._stream, handle)
                    else:
                        driver.stream_wait_stream(self._stream, handle, device)
                for producer in self._geometry.producer_streams:  # the protocol's, always
                    driver.stream_wait_stream(self._stream, producer)
                # the start event after every wait: a job's seconds are its copy's alone
                driver.event_record(start, self._stream)
                method, back_method = self._execute(plan, back_plan)
                driver.event_record(end, self._stream)
            except BaseException:
                for event in (start, end):
                    if event:
                        driver.event_destroy(event)
                raise
            finally:
                driver.pop_context()
            nbytes = plan.total_bytes + (back_plan.total_bytes if back_plan else 0)
            self._pending.append(_Job(job_id, nbytes, method, start, end, back_method))

    def _plan_back(self, plan: BlockPlan, back: Any) -> BlockPlan:
        """``back`` checked against the caches read the other way, and against ``plan``."""
        # (messages about the other way's geometry name the queue's caches as the caller does)
        if self._back_geometry is None:
            try:
                self._back_geometry = block_geometry(self.dst, self.src, split_blocks=self.split_blocks)
            except (TypeError, ValueError) as exc:
                raise type(exc)(
                    "back: the caches cannot be copied the other way: " + _swap_sides(str(exc))
                ) from None
        try:
            back_plan = self._back_geometry.with_mapping(back)
        except (TypeError, ValueError) as exc:
            raise type(exc)(_swap_sides(str(exc)).replace("block_mapping", "back")) from None
        clash = crossing_pairs(plan, back_plan)
        if clash:
            raise ValueError(
                f"{clash}: a job's two ways run at once, in no order; submit them as two jobs to order them"
            )
        return back_plan

    def _execute(self, plan: BlockPlan, back_plan: BlockPlan | None) -> tuple[str, str]:
        """Issue a job's copies on the queue's stream: the methods that ran each way."""
        if back_plan is None:
            return blocks.execute_blocks(plan, self._stream, self.method, wait_for_producers=False), ""
        return both_ways.execute_plans_both(
            plan, back_plan, self._stream, self.method, ("block_mapping", "back")
        )

    @staticmethod
    def _release(job: _Job) -> None:
        for event in (job.start, job.end):
            try:
                driver.event_destroy(event)
            except KVCopyError:
                pass

    def _finish(self, job: _Job) -> TransferResult:
        ok, error, seconds = True, "", 0.0
        try:
            seconds = driver.event_elapsed_ms(job.start, job.end) / 1e3
        except KVCopyError as exc:
            ok, error = False, str(exc)
        job.finished = True
        if not job.waiters:  # (else the last thread waiting on its end event releases them)
            self._release(job)
        return TransferResult(job.job_id, job.nbytes, seconds, ok, job.method, error, job.back_method)

    def poll(self) -> list[TransferResult]:
        """Results of the jobs that have finished since the last call, in submission order."""
        done: list[TransferResult] = []
        with self._lock:
            if not self._pending:
                return done
            self._push()
            try:
                while self._pending:
                    try:
                        finished = driver.event_query(self._pending[0].end)
                    except KVCopyError:
                        finished = True  # a failed job is reported, not retried
                    if not finished:
                        break
                    done.append(self._finish(self._pending.popleft()))
            finally:
                driver.pop_context()
        return done

    def wait(
        self, job_ids: Iterable[Hashable] | None = None, *, timeout: float | None = None
    ) -> list[TransferResult]:
        """Block until the given jobs (default: all) are done; returns every finished job's
        result. The queue's lock is not held while the GPU works: other threads submit and
        poll meanwhile.

        Args:
            timeout: seconds to wait at most (None: as long as it takes); past it
                TimeoutError is raised and the jobs stay pending.

        Raises:
            TypeError: ``job_ids`` is a single string or bytes (pass ``[job_id]``)
                or not iterable; ``timeout`` is not a number.
            ValueError: a negative or non-finite ``timeout``.
            KeyError: a job id that is not pending.
            TimeoutError: the jobs were not done within ``timeout``.
        """
        if isinstance(job_ids, (str, bytes)):
            raise TypeError(
                f"job_ids: expected a collection of job ids, got the {type(job_ids).__name__} "
                f"{job_ids!r}; pass [{job_ids!r}] to wait for that one job"
            )
        if job_ids is not None and not isinstance(job_ids, Iterable):
            raise TypeError(
                f"job_ids: expected a collection of job ids or None, got {type(job_ids).__name__}"
            )
        deadline = None if timeout is None else time.monotonic() + _seconds(timeout)
        with self._lock:
            wanted = None if job_ids is None else set(job_ids)
            last = None
            for job in self._pending:
                if wanted is None or job.job_id in wanted:
                    last = job
            if wanted is not None:
                unknown = wanted - {job.job_id for job in self._pending}
                if unknown:
                    raise KeyError(f"TransferQueue.wait: no pending job with id {sorted(map(repr, unknown))}")
            if last is not None:
                last.waiters += 1  # (its events outlive a poll that reports it meanwhile)
        if last is not None:
            try:
                self._wait_for(last, deadline)  # jobs finish in order
            finally:
                with self._lock:
                    last.waiters -= 1
                    if last.finished and not last.waiters:
                        self._push()
                        try:
                            self._release(last)
                        finally:
                            driver.pop_context()
        return self.poll()

    def _wait_for(self, job: _Job, deadline: float | None) -> None:
        """Until ``job``'s end event has completed (or failed), or TimeoutError past
        ``deadline``; without the queue's lock."""
        self._push()
        try:
            if deadline is None:
                try:
                    driver.event_synchronize(job.end)
                except KVCopyError:
                    pass  # (a failed job is reported by poll)
                return
            pause = 20e-6
            while True:
                try:
                    if driver.event_query(job.end):
                        return
                except KVCopyError:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"TransferQueue.wait: job {job.job_id!r} was not done "
                        "within the timeout; it is still pending"
                    )
                time.sleep(min(pause, left))
                pause = min(pause * 2, 1e-3)
        finally:
            driver.pop_context()

    def close(self) -> list[TransferResult]:
        """Refuse new jobs, wait for every job submitted before, then release the stream
        and events; returns the results of the jobs it saw finish (every job whose submit
        returned is reported by poll, wait or this). Safe to call twice."""
        with self._lock:
            if self._closed:
                return []
            self._closed = True  # (first: a submit racing close is refused, never lost)
        results = self.wait()
        with self._lock:
            self._push()
            try:
                driver.stream_synchronize(self._stream)
                driver.stream_destroy(self._stream)
            finally:
                driver.pop_context()
        return results

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "TransferQueue":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
