"""kvcopy.pinned_pool on the CPU: real host memory mapped, bound and touched, with the
driver's registration faked through kvcopy.testing.fake_cuda; and the pure parts
(page choice, registration chunks, the host's NUMA facts) with faked facts."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcopy
from kvcopy import testing
from kvcopy.testing import engine
from kvcopy.errors import CudaError
from kvcopy.policy.defaults import POOL_MAX_CHUNK_BYTES, POOL_TOUCH_WAVE_BYTES
from kvcopy.policy.host_pool import choose_pages, registration_chunks, touch_threads, touch_waves

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 1 << 20


class FakeDriver:
    """What a pool asks of the driver and of kvcopy._cuda.memory: registrations are
    recorded (and may fail at one, or wait for ``gate``)."""

    def __init__(self, fail_at: int | None = None, gate: threading.Event | None = None) -> None:
        self.registered: dict[int, int] = {}
        self.untouched: list[int] = []  # registrations that found a page not yet touched
        self.calls: list[tuple[str, int, int]] = []
        self.fail_at, self.gate = fail_at, gate
        self.inits = 0

    # kvcopy._cuda.driver
    def init(self) -> None:
        self.inits += 1

    def current_context(self) -> int:
        return 1

    def context_device(self) -> int:
        return 0

    def device_attributes(self, ordinal: int) -> dict:
        return {"pci_domain": 0, "pci_bus": 0x1B, "pci_device": 0}

    CAPTURE_MODE_RELAXED = 2
    mode = 0  # the thread's capture mode, as the driver keeps it

    def exchange_capture_mode(self, mode: int) -> int:
        previous, self.mode = self.mode, mode
        return previous

    # kvcopy._cuda.memory
    def host_register(self, ptr: int, nbytes: int, read_only: bool = False) -> None:
        assert self.mode == self.CAPTURE_MODE_RELAXED  # (a capture elsewhere forbids none)
        if self.gate is not None:
            self.gate.wait()
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            raise CudaError(2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")
        if not _resident(ptr, nbytes):
            self.untouched.append(ptr)
        self.registered[ptr] = nbytes
        self.calls.append(("register", ptr, nbytes))

    def host_unregister(self, ptr: int) -> None:
        del self.registered[ptr]
        self.calls.append(("unregister", ptr, 0))


@pytest.fixture
def fake():
    driver = FakeDriver()
    with testing.fake_cuda(driver, ("driver", "memory")):
        yield driver


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(part, 16) for part in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


def _resident(ptr: int, nbytes: int) -> bool:
    """Whether every page of the range is in memory (mincore): touched."""
    start = ptr // PAGE * PAGE
    pages = -(-(ptr + nbytes - start) // PAGE)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(start, pages * PAGE, vector) == 0, os.strerror(ctypes.get_errno())
    return all(v & 1 for v in vector)


def _registrations(fake: FakeDriver) -> list[tuple[int, int]]:
    return [(ptr, size) for what, ptr, size in fake.calls if what == "register"]


def test_a_pool_is_exactly_the_size_asked_registered_whole_and_holds_bytes(fake):
    nbytes = 3 * MiB + 12345
    with kvcopy.pinned_pool(nbytes, huge_pages="none", chunk_bytes=MiB) as pool:
        report = pool.wait()
        array = pool.view()
        assert array.nbytes == pool.nbytes == report.nbytes == nbytes
        assert report.mapped_bytes == -(-nbytes // PAGE) * PAGE
        assert (report.pages, report.page_bytes) == ("plain", PAGE)
        spans = _registrations(fake)
        assert spans[0][0] == pool.ptr and sum(size for _, size in spans) == nbytes
        assert all(a + s == b for (a, s), (b, _) in zip(spans, spans[1:]))  # back to back, in order
        assert report.registrations == len(spans) == 4 and report.registered_bytes == nbytes
        assert fake.mode == 0  # the thread's own capture mode back after registering
        assert fake.untouched == []  # every chunk touched before it was registered
        pattern = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
        array[:] = pattern
        assert np.array_equal(pool.view(MiB, 100), pattern[MiB : MiB + 100])
        # (a view holds its range: layouts over it are classified once, as over tensors)
        part = pool.view(MiB, 4096).reshape(16, 256)[4:]
        assert engine.kept_memory.held_span(part) == (pool.ptr + MiB, pool.ptr + MiB + 4096)
        del array, part


def test_registrations_end_on_blocks_and_pages(fake):
    block = 3 * PAGE * 5  # not a power of two
    pool = kvcopy.pinned_pool(40 * block, huge_pages="none", block_bytes=block, chunk_bytes=7 * block + 1)
    spans = _registrations(fake)
    assert [size for _, size in spans] == [7 * block] * 5 + [5 * block]
    assert all((ptr - pool.ptr) % block == 0 and (ptr - pool.ptr) % PAGE == 0 for ptr, _ in spans)
    pool.close()


def test_first_touch_puts_every_page_on_the_chosen_node(fake):
    pool = kvcopy.pinned_pool(8 * MiB, node=0, huge_pages="none")
    report = pool.wait()
    assert report.node == pool.node == 0
    # every page present on node 0, as the kernel's numa_maps lists it
    assert report.bytes_by_node.get(0, 0) >= 8 * MiB
    assert sum(report.bytes_by_node.values()) - report.bytes_by_node[0] < 8 * MiB
    assert report.touch_s >= 0 and report.register_s >= 0
    pool.close()


def test_transparent_huge_pages_align_the_pool_where_the_kernel_grants_them(fake):
    mode = testing.host.numa.transparent_huge_pages()
    if mode not in ("always", "madvise"):
        with pytest.raises(ValueError, match="huge_pages='transparent'"):
            kvcopy.pinned_pool(8 * MiB, huge_pages="transparent")
        return
    pool = kvcopy.pinned_pool(8 * MiB, huge_pages="transparent")
    report = pool.wait()
    assert report.pages == "transparent" and pool.ptr % report.page_bytes == 0
    assert report.mapped_bytes == 8 * MiB
    pool.close()


def test_a_failed_registration_midway_gives_back_everything(fake):
    fake.fail_at = 2
    seen = []
    with pytest.raises(CudaError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        kvcopy.pinned_pool(4 * MiB, huge_pages="none", chunk_bytes=MiB, on_progress=lambda *a: seen.append(a))
    registered = _registrations(fake)
    assert len(registered) == 2 and fake.registered == {}  # both unregistered
    assert seen == [(MiB, 4 * MiB), (2 * MiB, 4 * MiB)]
    assert not _mapped(registered[0][0])  # and unmapped


def test_close_gives_back_the_memory_once_no_array_is_left(fake):
    pool = kvcopy.pinned_pool(2 * MiB, huge_pages="none", chunk_bytes=MiB)
    array = pool.view(0, 64)
    pool.close()
    assert fake.registered and _mapped(pool.ptr)  # an array still covers it
    array[:] = 7
    with pytest.raises(ValueError, match="view: the pool is closed"):
        pool.view()
    del array
    assert fake.registered == {} and not _mapped(pool.ptr)


def test_in_the_background_a_view_waits_for_its_bytes_and_progress_is_reported():
    gate = threading.Event()
    fake = FakeDriver(gate=gate)
    seen: list[tuple[int, int]] = []
    with testing.fake_cuda(fake, ("driver", "memory")):
        pool = kvcopy.pinned_pool(
            3 * MiB,
            huge_pages="none",
            chunk_bytes=MiB,
            background=True,
            on_progress=lambda *a: seen.append(a),
        )
        assert not pool.done and pool.registered_bytes == 0
        with pytest.raises(TimeoutError, match=r"view: bytes up to 1048576 are not registered"):
            pool.view(0, MiB, timeout=0.05)
        with pytest.raises(TimeoutError, match="0 of 3145728 bytes registered"):
            pool.wait(timeout=0.01)
        gate.set()
        first = pool.view(0, MiB, timeout=10)
        assert pool.registered_bytes >= MiB
        report = pool.wait(timeout=10)
        assert report.registered_bytes == 3 * MiB and pool.done
        assert seen == [(MiB, 3 * MiB), (2 * MiB, 3 * MiB), (3 * MiB, 3 * MiB)]
        del first
        pool.close()
        assert fake.registered == {}


def test_a_background_failure_reaches_wait_and_view_and_frees():
    fake = FakeDriver(fail_at=1)
    with testing.fake_cuda(fake, ("driver", "memory")):
        pool = kvcopy.pinned_pool(2 * MiB, huge_pages="none", chunk_bytes=MiB, background=True)
        with pytest.raises(CudaError, match="CUDA_ERROR_OUT_OF_MEMORY"):
            pool.wait(timeout=10)
        with pytest.raises(CudaError):
            pool.view(0, 16, timeout=10)
        assert pool.done and pool.registered_bytes == 0 and fake.registered == {}
        assert not _mapped(pool.ptr)


def test_closing_a_pool_still_registering_stops_it():
    gate = threading.Event()
    fake = FakeDriver(gate=gate)
    with testing.fake_cuda(fake, ("driver", "memory")):
        pool = kvcopy.pinned_pool(4 * MiB, huge_pages="none", chunk_bytes=MiB, background=True)
        threading.Timer(0.05, gate.set).start()
        pool.close()
        assert fake.registered == {} and len(_registrations(fake)) < 4
        with pytest.raises(RuntimeError, match="closed before it was registered"):
            pool.wait(timeout=10)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"nbytes": 0}, ValueError, "pinned_pool: nbytes must be at least 1, got 0"),
        ({"nbytes": 1.5}, TypeError, "pinned_pool: nbytes must be an int"),
        ({"nbytes": True}, TypeError, "pinned_pool: nbytes must be an int"),
        ({"nbytes": 2**63}, ValueError, "pinned_pool: nbytes must be at most"),
        ({"node": 4096}, ValueError, r"pinned_pool: node 4096 is not one of this host's NUMA nodes \["),
        ({"node": -1}, ValueError, "pinned_pool: node must be at least 0"),
        ({"device": "0"}, TypeError, "pinned_pool: device must be an int"),
        ({"block_bytes": 0}, ValueError, "pinned_pool: block_bytes must be at least 1"),
        ({"chunk_bytes": 2.0}, TypeError, "pinned_pool: chunk_bytes must be an int"),
        ({"huge_pages": "big"}, ValueError, "pinned_pool: huge_pages must be one of auto, explicit"),
        ({"huge_pages": None}, ValueError, "pinned_pool: huge_pages must be one of"),
        ({"background": 1}, TypeError, "pinned_pool: background must be a bool"),
        ({"on_progress": 3}, TypeError, "pinned_pool: on_progress must be callable"),
        ({"block_bytes": MiB + 1}, ValueError, "end together only every"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_registered(fake, kwargs, error, message):
    args = {"nbytes": MiB, **kwargs}
    with pytest.raises(error, match=message):
        kvcopy.pinned_pool(args.pop("nbytes"), huge_pages=args.pop("huge_pages", "none"), **args)
    assert fake.calls == []


def test_view_bounds_are_checked(fake):
    pool = kvcopy.pinned_pool(MiB, huge_pages="none")
    with pytest.raises(ValueError, match="view: 16 bytes from offset 1048570 run past the pool's 1048576"):
        pool.view(MiB - 6, 16)
    with pytest.raises(ValueError, match="view: offset must be at least 0"):
        pool.view(-1)
    assert pool.view(MiB).nbytes == 0
    pool.close()


# the pure parts


def test_page_choice_takes_explicit_pages_where_enough_are_free_and_little_is_wasted():
    gib, two = 1 << 30, 2 * MiB
    assert choose_pages(8 * gib, "auto", {gib: 8, two: 10_000}, "madvise", two, PAGE).page_bytes == gib
    # a 1 GiB page would waste most of a 100 MiB pool: 2 MiB pages instead
    assert choose_pages(100 * MiB, "auto", {gib: 8, two: 100}, "madvise", two, PAGE).page_bytes == two
    short = choose_pages(8 * gib, "auto", {gib: 7, two: 10}, "madvise", two, PAGE)
    assert (
        short.kind == "transparent"
        and "no explicit huge pages fit (10 of 2048 KiB, 7 of 1048576 KiB" in short.note
    )
    with pytest.raises(
        ValueError, match="huge_pages='explicit': no explicit huge pages fit \\(none reserved"
    ):
        choose_pages(8 * gib, "explicit", {}, "always", two, PAGE)


def test_page_choice_falls_back_to_plain_pages_and_says_why():
    two = 2 * MiB
    plain = choose_pages(64 * MiB, "auto", {}, "never", two, PAGE)
    assert (plain.kind, plain.page_bytes) == ("plain", PAGE)
    assert "transparent huge pages are 'never'" in plain.note and "none reserved" in plain.note
    small = choose_pages(MiB, "auto", {}, "always", two, PAGE)
    assert small.kind == "plain" and "smaller than a transparent huge page" in small.note
    assert choose_pages(64 * MiB, "none", {two: 100}, "always", two, PAGE).kind == "plain"
    with pytest.raises(ValueError, match="huge_pages='transparent': transparent huge pages are 'never'"):
        choose_pages(64 * MiB, "transparent", {}, "never", two, PAGE)


def test_registration_chunks_cover_the_pool_and_never_split_a_block_or_a_page():
    two = 2 * MiB
    chunks = registration_chunks(10 * two + 5, two, None, 3 * two)
    assert chunks == [(0, 3 * two), (3 * two, 3 * two), (6 * two, 3 * two), (9 * two, two + 5)]
    block = 3 * two  # a block of three pages: chunks of whole blocks
    assert {size for _, size in registration_chunks(30 * block, two, block, 4 * two)} == {block}
    # never above what one registration may hold, whatever is asked
    assert registration_chunks(8 << 30, 4096, None, 8 << 30)[0][1] == POOL_MAX_CHUNK_BYTES
    with pytest.raises(ValueError, match="block_bytes=3 and pages of 1073741824 bytes end together only"):
        registration_chunks(1 << 31, 1 << 30, 3)


def test_touch_threads_follow_the_node_and_the_pool():
    assert touch_threads(64, 1 << 40, PAGE) == 32
    assert touch_threads(8, 1 << 30, PAGE) == 8
    assert touch_threads(8, 3 * PAGE, PAGE) == 3
    assert touch_threads(0, PAGE, PAGE) == 1


def test_numa_facts_are_read_from_sysfs_and_a_host_without_numa_is_one_node(tmp_path):
    numa = testing.host.numa
    assert numa.parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    with pytest.raises(ValueError, match="runs backwards"):
        numa.parse_cpulist("3-1")
    lone = numa.nodes(tmp_path)
    assert list(lone) == [0] and set(lone[0].cpus) == os.sched_getaffinity(0)
    for index, cpus, free in ((0, "0-7", "12"), (1, "8-15", "0")):
        node = tmp_path / "devices" / "system" / "node" / f"node{index}"
        (node / "hugepages" / "hugepages-2048kB").mkdir(parents=True)
        (node / "cpulist").write_text(cpus + "\n")
        (node / "hugepages" / "hugepages-2048kB" / "free_hugepages").write_text(free + "\n")
    found = numa.nodes(tmp_path)
    assert found[1].cpus == tuple(range(8, 16)) and found[0].free_huge_pages == {2 * MiB: 12}
    gpu = tmp_path / "bus" / "pci" / "devices" / numa.pci_address(0, 0x1B, 0)
    gpu.mkdir(parents=True)
    assert numa.node_of_pci("0000:1b:00.0", tmp_path) is None  # no entry
    (gpu / "numa_node").write_text("-1\n")
    assert numa.node_of_pci("0000:1b:00.0", tmp_path) is None
    (gpu / "numa_node").write_text("1\n")
    assert numa.node_of_pci("0000:1b:00.0", tmp_path) == 1
    assert numa.transparent_huge_pages(tmp_path) == "never"
    thp = tmp_path / "kernel" / "mm" / "transparent_hugepage"
    thp.mkdir(parents=True)
    (thp / "enabled").write_text("always [madvise] never\n")
    assert numa.transparent_huge_pages(tmp_path) == "madvise"


def test_pages_by_node_sums_the_kernels_numa_maps(tmp_path):
    maps = tmp_path / "numa_maps"
    maps.write_text(
        "7f0000000000 default anon=3 dirty=3 N0=2 N1=1 kernelpagesize_kB=4\n"
        "7f0000200000 prefer:1 anon=2 N1=2 kernelpagesize_kB=2048\n"
        "7f0000600000 default anon=1 N0=1 kernelpagesize_kB=4\n"
    )
    found = testing.host.pages.bytes_by_node(0x7F0000200000, 0x400000, maps)
    assert found == {1: 2 * 2 * MiB}
    # a range that starts inside an older mapping counts that mapping
    assert testing.host.pages.bytes_by_node(0x7F0000100000, 0x1000, maps) == {0: 8192, 1: 4096}
    assert testing.host.pages.bytes_by_node(0, 1, tmp_path / "absent") == {}


def test_a_device_on_no_numa_node_is_noted_not_refused(fake, monkeypatch):
    numa = testing.host.numa
    two = {0: numa.Node(0, (0,), {}), 1: numa.Node(1, (0,), {})}
    monkeypatch.setattr(numa, "nodes", lambda *a: two)
    pool = kvcopy.pinned_pool(MiB, huge_pages="none")
    report = pool.wait()
    assert pool.node is None and any("is on no NUMA node" in note for note in report.notes)
    pool.close()


def test_a_progress_callback_that_raises_fails_the_pool_and_frees_it(fake):
    def progress(registered: int, total: int) -> None:
        raise KeyError("the caller's bug")

    with pytest.raises(KeyError, match="the caller's bug"):
        kvcopy.pinned_pool(2 * MiB, huge_pages="none", chunk_bytes=MiB, on_progress=progress)
    assert fake.registered == {} and len(_registrations(fake)) == 1
    assert not _mapped(_registrations(fake)[0][0])


def test_odd_sizes_make_sound_pools(fake):
    # a block larger than the pool, chunks smaller than a page, a pool of one byte
    for nbytes, block, chunk in ((PAGE * 3, PAGE * 8, None), (PAGE * 5, None, 1), (1, None, None)):
        pool = kvcopy.pinned_pool(nbytes, huge_pages="none", block_bytes=block, chunk_bytes=chunk)
        spans = _registrations(fake)[-pool.wait().registrations :]
        assert sum(size for _, size in spans) == nbytes
        assert all(size % PAGE == 0 for _, size in spans[:-1])
        assert pool.view().nbytes == nbytes and pool.view(nbytes).nbytes == 0
        pool.close()


@settings(max_examples=200, deadline=None)
@given(
    nbytes=st.integers(1, 1 << 32),
    page=st.sampled_from([4096, 2 << 20, 1 << 30]),
    block=st.one_of(st.none(), st.integers(1, 1 << 22)),
    chunk=st.one_of(st.none(), st.integers(1 << 16, 1 << 33)),  # (at most 65,536 chunks)
)
def test_registration_chunks_always_tile_the_pool_on_page_and_block_ends(nbytes, page, block, chunk):
    import math

    try:
        chunks = registration_chunks(nbytes, page, block, chunk)
    except ValueError as exc:  # (refused only where blocks and pages meet too far apart)
        assert math.lcm(page, block or 1) > POOL_MAX_CHUNK_BYTES and "end together only" in str(exc)
        return
    assert chunks[0][0] == 0 and sum(size for _, size in chunks) == nbytes
    assert all(a + s == b for (a, s), (b, _) in zip(chunks, chunks[1:]))
    step = math.lcm(page, block or 1)
    assert all(offset % step == 0 for offset, _ in chunks)
    assert all(size <= max(POOL_MAX_CHUNK_BYTES, step) for _, size in chunks)


def test_touch_waves_put_the_first_chunk_alone_then_the_rest_or_whole_chunks_of_a_wave_each():
    import kvcopy.policy.host_pool as pool_policy

    chunk = 256 * MiB
    chunks = [(k * chunk, chunk) for k in range(10)]
    # by default the first chunk alone (usable at once), then the rest and the mapping's
    # rounding past the pool
    assert POOL_TOUCH_WAVE_BYTES == 0
    assert touch_waves(chunks, 10 * chunk + 100) == [(0, chunk), (chunk, 9 * chunk + 100)]
    assert touch_waves([(0, 5)], PAGE) == [(0, PAGE)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pool_policy, "POOL_TOUCH_WAVE_BYTES", 4 * chunk)  # waves of four chunks
        waves = touch_waves(chunks, 10 * chunk + 100)
    assert waves == [(0, chunk), (chunk, 4 * chunk), (5 * chunk, 4 * chunk), (9 * chunk, chunk + 100)]


@settings(max_examples=200, deadline=None)
@given(
    nbytes=st.integers(1, 1 << 36),
    chunk=st.one_of(st.none(), st.integers(1 << 20, 1 << 31)),
    wave=st.sampled_from([0, 1 << 20, 1 << 30, 1 << 33]),
)
def test_touch_waves_tile_the_mapping_and_end_where_chunks_end(nbytes, chunk, wave):
    import kvcopy.policy.host_pool as pool_policy

    chunks = registration_chunks(nbytes, PAGE, None, chunk)
    mapped = -(-nbytes // PAGE) * PAGE
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pool_policy, "POOL_TOUCH_WAVE_BYTES", wave)
        waves = touch_waves(chunks, mapped)
    assert waves[0] == (0, chunks[0][1]) or len(chunks) == 1
    assert all(a + s == b for (a, s), (b, _) in zip(waves, waves[1:])) and sum(s for _, s in waves) == mapped
    ends = {offset + size for offset, size in chunks}
    assert all(offset + size in ends for offset, size in waves[:-1])
    if wave == 0:
        assert len(waves) == min(len(chunks), 2)
    else:  # each wave but the first and last: at least a wave's bytes, less than one more chunk
        biggest = max(size for _, size in chunks)
        assert all(wave <= size < wave + biggest for _, size in waves[1:-1])


def test_nothing_past_the_first_chunk_is_touched_before_it_is_registered():
    seen: list[bool] = []

    class SlowFirstRegistration(FakeDriver):
        def host_register(self, ptr: int, nbytes: int, read_only: bool = False) -> None:
            if not self.registered:  # (time for a touch beside it to reach the rest)
                time.sleep(0.2)
                seen.append(_resident(ptr + nbytes, PAGE))
            super().host_register(ptr, nbytes, read_only)

    driver = SlowFirstRegistration()
    with testing.fake_cuda(driver, ("driver", "memory")):
        with kvcopy.pinned_pool(8 * MiB, huge_pages="none", chunk_bytes=MiB) as pool:
            report = pool.wait()
    assert seen == [False]  # the second chunk's first page: untouched while the first registered
    assert report.registrations == 8 and driver.untouched == []


def test_a_pool_of_many_waves_registers_every_chunk_touched(fake, monkeypatch):
    import kvcopy.policy.host_pool as pool_policy

    monkeypatch.setattr(pool_policy, "POOL_TOUCH_WAVE_BYTES", 2 * MiB)  # waves of two chunks
    with kvcopy.pinned_pool(9 * MiB + 5, huge_pages="none", chunk_bytes=MiB) as pool:
        report = pool.wait()
        assert report.registrations == 10 and fake.untouched == []
        assert report.touch_s > 0 and report.register_s >= 0
        pool.view()[:] = 3
