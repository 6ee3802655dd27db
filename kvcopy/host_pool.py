"""Pinned host pools at scale: hundreds of GiB of page-locked memory that are usable
soon, sit on the NUMA node of the GPU they serve, use huge pages where the host has
them, are exactly the size asked and do not stall other processes' CUDA calls.

A pool is built in four steps: map anonymous memory (kvcopy.policy.host_pool chooses
the pages), bind it to the node (a preference: a full node lends pages from
another), fault every page in from threads running on that node, and register it
with the driver in chunks of a few hundred MiB with a pause between them (one
registration holds driver-wide locks for its whole length). The first chunk is
touched and registered alone, before any other page is touched (a registration
beside the touch of the rest waits on it: 1.55 s for the first 256 MiB of a 64 GiB
pool on an H100 host), so that the pool's first bytes are usable at once; the rest
is registered once touched (policy.POOL_TOUCH_WAVE_BYTES: registering beside the
touch slows both). Chunks end on a block
when ``block_bytes`` is given, so that no block lies across two registrations (the
copy engines refuse such a copy).

Only registered memory is handed out: :meth:`HostPool.view` returns an array over a
range once every byte of it is registered (waiting for it, up to a timeout), so a
copy never reads or writes the pool as pageable memory. ``background=True`` returns
at once; the rest runs on a thread and :attr:`HostPool.registered_bytes` grows from
the start of the pool.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

from kvcopy._cuda import driver, memory
from kvcopy._runtime import host_pages, kept_memory, numa
from kvcopy._runtime.context import ContextScope, relaxed_capture
from kvcopy.arguments import require_int
from kvcopy.policy.defaults import POOL_CHUNK_PAUSE_S
from kvcopy.policy.host_pool import HUGE_PAGES, choose_pages, registration_chunks, touch_threads, touch_waves

Progress = Callable[[int, int], None]
Touch = Callable[[int, int], None]  # touch(offset, size): fault a range of the pool in


@dataclasses.dataclass(frozen=True)
class PoolReport:
    """What a pool got. ``bytes_by_node``: where its pages are (the kernel's
    ``numa_maps``; empty where unreadable); ``notes``: every fallback taken."""

    nbytes: int
    mapped_bytes: int
    node: int | None
    bytes_by_node: dict[int, int]
    pages: str  # 'explicit', 'transparent' or 'plain'
    page_bytes: int
    registered_bytes: int
    registrations: int
    touch_s: float
    register_s: float
    notes: tuple[str, ...]


class _Memory:
    """The mapping and its registrations. ``release()`` (at most once) stops the
    thread that builds, unregisters and unmaps; it runs by itself once the pool and
    every array over it are gone, and at exit."""

    def __init__(self, address: int, mapped: int) -> None:
        self.address, self.mapped = address, mapped
        self.registered: list[int] = []  # the start of each registration, in order
        self.stop = threading.Event()
        self.workers: list[threading.Thread] = []
        self.arrays: weakref.WeakSet = weakref.WeakSet()  # what view() handed out, alive
        self.release = weakref.finalize(
            self, _give_back, address, mapped, self.registered, self.stop, self.workers
        )


def _give_back(address: int, mapped: int, registered: list, stop: threading.Event, workers: list) -> None:
    stop.set()
    for worker in workers:
        if worker is not threading.current_thread():
            worker.join()
    try:
        with ContextScope(), relaxed_capture():
            while registered:
                memory.host_unregister(registered.pop())
    except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
        pass
    host_pages.unmap(address, mapped)


class _ArrayOver(kept_memory.HeldMemory):
    """Hands NumPy a range of a pool; the arrays keep the pool's memory alive."""

    __slots__ = ("holder", "__array_interface__")

    def __init__(self, holder: _Memory, address: int, nbytes: int) -> None:
        super().__init__(address, nbytes)
        self.holder = holder
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }
        holder.arrays.add(self)


class HostPool:
    """A pinned host pool (see the module's docstring); made by :func:`pinned_pool`.

    Attributes:
        ptr: the pool's first byte. Bytes below ``ptr + registered_bytes`` are
            pinned; take arrays through :meth:`view`, which holds to that.
        nbytes: the pool's size, exactly as asked.
        node: the NUMA node it was placed on (None: the host names none).
    """

    def __init__(
        self, memory_: _Memory, nbytes: int, node: int | None, chunks: list[tuple[int, int]]
    ) -> None:
        self._memory: _Memory | None = memory_
        self.ptr, self.nbytes, self.node = memory_.address, nbytes, node
        self._chunks = chunks
        self._registered = 0
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._report: PoolReport | None = None

    @property
    def registered_bytes(self) -> int:
        """Bytes from the start of the pool registered so far."""
        return self._registered

    @property
    def done(self) -> bool:
        """Whether building ended, registered whole or failed."""
        return self._report is not None or self._error is not None

    def wait(self, timeout: float | None = None) -> PoolReport:
        """The report once the whole pool is registered; TimeoutError after
        ``timeout`` seconds, or the error that stopped it."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.done, timeout):
                raise TimeoutError(
                    f"pinned pool: {self._registered} of {self.nbytes} bytes registered after {timeout} s"
                )
        if self._error is not None:
            raise self._error
        assert self._report is not None
        return self._report

    def view(self, offset: int = 0, nbytes: int | None = None, *, timeout: float | None = None) -> np.ndarray:
        """A uint8 array over ``nbytes`` of the pool from ``offset`` (default: to its
        end), once that range is registered: waits up to ``timeout`` seconds (None:
        as long as it takes), then TimeoutError. The pool's memory lives as long as
        any such array does."""
        offset = require_int(offset, "view: offset", minimum=0)
        nbytes = self.nbytes - offset if nbytes is None else require_int(nbytes, "view: nbytes", minimum=0)
        if self._memory is None:
            raise ValueError("view: the pool is closed")
        if offset + nbytes > self.nbytes:
            raise ValueError(f"view: {nbytes} bytes from offset {offset} run past the pool's {self.nbytes}")
        end = offset + nbytes
        with self._changed:
            ready = self._changed.wait_for(
                lambda: self._registered >= end or self._error is not None, timeout
            )
        if self._error is not None:
            raise self._error
        if not ready:
            raise TimeoutError(
                f"view: bytes up to {end} are not registered after {timeout} s "
                f"({self._registered} of {self.nbytes} are)"
            )
        memory_ = self._memory
        if memory_ is None:  # (closed while it waited)
            raise ValueError("view: the pool is closed")
        return np.asarray(_ArrayOver(memory_, self.ptr + offset, nbytes))

    @property
    def report(self) -> PoolReport:
        """What the pool got (as :meth:`wait` returns it), waiting for the end."""
        return self.wait()

    def close(self) -> None:
        """Stop building; the memory goes back now where no array over it is left,
        else with the last of them."""
        memory_, self._memory = self._memory, None
        if memory_ is None:
            return
        memory_.stop.set()
        for worker in memory_.workers:
            if worker is not threading.current_thread():
                worker.join()
        if not memory_.arrays:
            memory_.release()

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(
        self, prepare: Callable[[], list[str]], touch: Touch, facts: dict, progress: Progress | None
    ) -> None:
        """Touch in waves (policy.touch_waves) on a thread of its own and register each
        chunk once its wave is touched; on an error, give back everything."""
        memory_ = self._memory
        assert memory_ is not None  # (close() waits for this to end before dropping it)
        toucher: _Toucher | None = None
        try:
            notes = prepare()
            toucher = _Toucher(touch, touch_waves(self._chunks, memory_.mapped), memory_.stop)
            toucher.start()
            registered, register_s = memory_.registered, 0.0
            with ContextScope(), relaxed_capture():
                for offset, size in self._chunks:
                    if memory_.stop.is_set():
                        raise RuntimeError("pinned pool: closed before it was registered")
                    toucher.wait_for(offset + size)
                    started = time.perf_counter()
                    memory.host_register(self.ptr + offset, size)
                    registered.append(self.ptr + offset)
                    register_s += time.perf_counter() - started
                    toucher.first_registered.set()
                    with self._changed:
                        self._registered = offset + size
                        self._changed.notify_all()
                    if progress is not None:
                        progress(self._registered, self.nbytes)
                    if offset + size < self.nbytes:
                        time.sleep(POOL_CHUNK_PAUSE_S)
            toucher.join()
            report = PoolReport(
                registered_bytes=self._registered,
                registrations=len(registered),
                bytes_by_node=host_pages.bytes_by_node(self.ptr, memory_.mapped),
                touch_s=toucher.seconds,
                register_s=register_s,
                notes=tuple(notes),
                node=self.node,
                nbytes=self.nbytes,
                mapped_bytes=memory_.mapped,
                **facts,
            )
        except BaseException as exc:
            if toucher is not None:  # (no thread may touch memory that is given back)
                toucher.halt.set()
                toucher.first_registered.set()
                toucher.join()
            released = not memory_.arrays  # (arrays handed out keep what they cover)
            if released:
                memory_.release()
            with self._changed:
                self._error = exc
                self._registered = 0 if released else self._registered
                self._changed.notify_all()
            raise
        with self._changed:
            self._report = report
            self._changed.notify_all()


class _Toucher(threading.Thread):
    """Touches a pool's waves in order, saying how far it has come; the second wave only
    once the builder says the first chunk is registered (``first_registered``); stops
    between two waves where the pool is closed (``stop``) or its build failed
    (``halt``)."""

    def __init__(self, touch: Touch, waves: list[tuple[int, int]], stop: threading.Event) -> None:
        super().__init__(name="kvcopy-pool-touch", daemon=True)
        self.touch, self.waves, self.stop = touch, waves, stop
        self.halt = threading.Event()
        self.first_registered = threading.Event()
        self.touched = 0  # bytes from the start of the pool touched so far
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.ended = False
        self.changed = threading.Condition()

    def run(self) -> None:
        try:
            for k, (offset, size) in enumerate(self.waves):
                if k == 1:
                    self.first_registered.wait()
                if self.stop.is_set() or self.halt.is_set():
                    break
                started = time.perf_counter()
                self.touch(offset, size)
                self.seconds += time.perf_counter() - started
                with self.changed:
                    self.touched = offset + size
                    self.changed.notify_all()
        except BaseException as exc:  # noqa: BLE001 - raised by wait_for in the builder
            self.error = exc
        finally:
            with self.changed:
                self.ended = True
                self.changed.notify_all()

    def wait_for(self, end: int) -> None:
        """Return once the first ``end`` bytes are touched; raise the touch's error, or
        RuntimeError where it stopped first (the pool closed)."""
        with self.changed:
            self.changed.wait_for(lambda: self.touched >= end or self.ended)
        if self.touched >= end:
            return
        if self.error is not None:
            raise self.error
        raise RuntimeError("pinned pool: closed before it was registered")


def _node_for(device: int | None, node: int | None, known: dict[int, numa.Node]) -> tuple[int | None, str]:
    """The node the pool goes on, and a note where none could be chosen."""
    if node is not None:
        node = require_int(node, "pinned_pool: node", minimum=0)
        if node not in known:
            raise ValueError(f"pinned_pool: node {node} is not one of this host's NUMA nodes {sorted(known)}")
        return node, ""
    if len(known) == 1:
        return next(iter(known)), ""
    if device is None:
        device = driver.context_device() if driver.current_context() else 0
    attrs = driver.device_attributes(device)
    address = numa.pci_address(int(attrs["pci_domain"]), int(attrs["pci_bus"]), int(attrs["pci_device"]))
    found = numa.node_of_pci(address)
    if found is None or found not in known:
        return None, f"device {device} ({address}) is on no NUMA node: pages land where they are touched"
    return found, ""


def pinned_pool(
    nbytes: int,
    *,
    device: int | None = None,
    node: int | None = None,
    block_bytes: int | None = None,
    huge_pages: str = "auto",
    chunk_bytes: int | None = None,
    background: bool = False,
    on_progress: Progress | None = None,
) -> HostPool:
    """A pinned host pool of exactly ``nbytes`` (see the module's docstring).

    Args:
        device: the GPU it serves (default: the current context's, else 0), whose
            NUMA node it goes on; ``node`` names one instead.
        block_bytes: what callers address as one block: no registration splits one.
        huge_pages: 'auto' (explicit huge pages where enough are free on the node,
            else transparent ones where the kernel grants them, else plain pages),
            'explicit', 'transparent' (ValueError where not there) or 'none'.
        chunk_bytes: about how much one registration holds (kvcopy.policy's
            POOL_CHUNK_BYTES by default).
        background: return at once and build on a thread (:meth:`HostPool.wait`).
        on_progress: called with (registered bytes, nbytes) after each
            registration, on the thread that builds.

    Raises TypeError or ValueError naming a bad argument before anything is mapped;
    NoDriverError without a CUDA driver; OSError or kvcopy's CudaError where the host
    refuses the memory, after giving back what was taken.
    """
    nbytes = require_int(nbytes, "pinned_pool: nbytes", minimum=1, maximum=2**63 - 1)
    if device is not None:
        device = require_int(device, "pinned_pool: device", minimum=0)
    if block_bytes is not None:
        block_bytes = require_int(block_bytes, "pinned_pool: block_bytes", minimum=1)
    if chunk_bytes is not None:
        chunk_bytes = require_int(chunk_bytes, "pinned_pool: chunk_bytes", minimum=1)
    if not isinstance(huge_pages, str) or huge_pages not in HUGE_PAGES:
        raise ValueError(
            f"pinned_pool: huge_pages must be one of {', '.join(HUGE_PAGES)}, got {huge_pages!r}"
        )
    if not isinstance(background, bool):
        raise TypeError(f"pinned_pool: background must be a bool, got {type(background).__name__}")
    if on_progress is not None and not callable(on_progress):
        raise TypeError(f"pinned_pool: on_progress must be callable, got {type(on_progress).__name__}")
    driver.init()
    known = numa.nodes()
    where, note = _node_for(device, node, known)
    place = known.get(where if where is not None else -1)
    free = place.free_huge_pages if place is not None else {}
    pages = choose_pages(
        nbytes,
        huge_pages,
        free,
        numa.transparent_huge_pages(),
        numa.transparent_page_bytes(),
        host_pages.page_size(),
    )
    chunks = registration_chunks(nbytes, pages.page_bytes, block_bytes, chunk_bytes)
    address, mapped = host_pages.map_memory(nbytes, pages.kind, pages.page_bytes)
    held = _Memory(address, mapped)
    pool = HostPool(held, nbytes, where, chunks)
    cpus = (
        tuple(sorted(set(place.cpus) & host_pages.usable_cpus()))
        if place is not None and where is not None
        else ()
    )

    def prepare() -> list[str]:
        notes = [n for n in (note, pages.note) if n]
        if where is not None:
            refused = host_pages.bind(address, mapped, where)
            if refused:
                notes.append(f"{refused}: pages land where they are touched")
        return notes

    threads = touch_threads(len(cpus) or len(host_pages.usable_cpus()), mapped, pages.page_bytes)

    def touch(offset: int, size: int) -> None:
        host_pages.touch(address + offset, size, pages.page_bytes, cpus, threads)

    facts = {"pages": pages.kind, "page_bytes": pages.page_bytes}
    if not background:
        pool._build(prepare, touch, facts, on_progress)
        return pool
    worker = threading.Thread(
        target=_quiet, args=(pool._build, prepare, touch, facts, on_progress), daemon=True
    )
    held.workers.append(worker)
    worker.start()
    return pool


def _quiet(build: Callable, *args: Any) -> None:
    """A background build: its error is kept for HostPool.wait, not printed."""
    try:
        build(*args)
    except BaseException:  # noqa: BLE001 - kept on the pool
        pass
