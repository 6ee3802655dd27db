"""Anonymous host memory for a pinned pool, through the C library: mapped with the
pages chosen (explicit huge pages, transparent ones, plain), bound to a NUMA node and
touched first by threads running on that node, so that every page exists where it
should before the driver pins it (pinning faults in what is missing, one page at a
time, under the driver's locks).

Linux only: elsewhere :func:`map_memory` raises OSError. Binding is a preference
(MPOL_PREFERRED): a node without free memory lends its pages from another instead
of failing the pool; :func:`bytes_by_node` says where they landed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
from pathlib import Path

# The kernel's interface numbers (asm-generic; the same on x86-64 and arm64).
PROT_READ, PROT_WRITE = 1, 2
MAP_PRIVATE, MAP_ANONYMOUS, MAP_HUGETLB, MAP_HUGE_SHIFT = 0x02, 0x20, 0x40000, 26
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
MPOL_PREFERRED = 1
SYS_MBIND = {"x86_64": 237, "aarch64": 235}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.memset.restype = ctypes.c_void_p
_libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
_libc.syscall.restype = ctypes.c_long
_MAP_FAILED = ctypes.c_void_p(-1).value


def _os_error(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


def page_size() -> int:
    """The base page size of this host."""
    return os.sysconf("SC_PAGE_SIZE")


def usable_cpus() -> set[int]:
    """The CPUs this process may run on."""
    return set(os.sched_getaffinity(0))


def map_memory(nbytes: int, kind: str, page_bytes: int) -> tuple[int, int]:
    """(address, mapped bytes) of new private anonymous memory holding ``nbytes``,
    rounded up to ``page_bytes``: explicit huge pages of that size (``kind``
    'explicit'), or pages aligned to it with transparent huge pages asked for
    ('transparent'), or plain pages. Nothing is touched yet. OSError where the kernel
    refuses (no explicit pages left, no memory)."""
    mapped = -(-nbytes // page_bytes) * page_bytes
    flags = MAP_PRIVATE | MAP_ANONYMOUS
    if kind == "explicit":
        flags |= MAP_HUGETLB | (page_bytes.bit_length() - 1) << MAP_HUGE_SHIFT
    # a transparent huge page needs an aligned start: map a page more, trim both ends
    extra = page_bytes if kind == "transparent" else 0
    address = _libc.mmap(None, mapped + extra, PROT_READ | PROT_WRITE, flags, -1, 0)
    if address in (None, _MAP_FAILED):
        raise _os_error(f"mmap of {mapped} bytes ({kind} pages of {page_bytes} bytes)")
    if extra:
        start = -(-address // page_bytes) * page_bytes
        if start > address:
            _libc.munmap(address, start - address)
        if address + extra > start:
            _libc.munmap(start + mapped, address + extra - start)
        address = start
        if _libc.madvise(address, mapped, MADV_HUGEPAGE) != 0:
            error = _os_error("madvise(MADV_HUGEPAGE)")
            unmap(address, mapped)
            raise error
    return address, mapped


def unmap(address: int, mapped: int) -> None:
    """Give back what :func:`map_memory` mapped."""
    _libc.munmap(address, mapped)


def bind(address: int, mapped: int, node: int) -> str:
    """Prefer NUMA node ``node`` for the pages of the range; '' where done, else why
    not (no mbind on this kernel or architecture, refused in this container)."""
    number = SYS_MBIND.get(platform.machine())
    if number is None:
        return f"no mbind on {platform.machine()}"
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    status = _libc.syscall(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_ulong(mapped),
        ctypes.c_int(MPOL_PREFERRED),
        mask,
        ctypes.c_ulong(words * 64 + 1),
        ctypes.c_uint(0),
    )
    return "" if status == 0 else f"mbind refused: {os.strerror(ctypes.get_errno())}"


def _touch_slice(address: int, size: int, cpus: tuple[int, ...], errors: list) -> None:
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)  # this thread alone (Linux: 0 is the caller)
        # the kernel faults every page in without writing it from here; kernels before
        # 5.14 lack it (EINVAL): then a write of every byte does (ctypes drops the GIL)
        if _libc.madvise(address, size, MADV_POPULATE_WRITE) != 0:
            if ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS):
                raise _os_error(f"madvise(MADV_POPULATE_WRITE) of {size} bytes")
            _libc.memset(address, 0, size)
    except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
        errors.append(exc)


def touch(address: int, mapped: int, page_bytes: int, cpus: tuple[int, ...], threads: int) -> None:
    """Fault every page of the range in, split among ``threads`` threads each bound to
    ``cpus`` (none: where they run), so that the pages land on those CPUs' node.
    Raises the first thread's error (OSError, MemoryError) after all have ended."""
    pages = mapped // page_bytes
    bounds = [address + pages * i // threads * page_bytes for i in range(threads)] + [address + mapped]
    errors: list = []
    workers = [
        threading.Thread(target=_touch_slice, args=(start, end - start, cpus, errors), daemon=True)
        for start, end in zip(bounds, bounds[1:])
        if end > start
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]


def bytes_by_node(address: int, mapped: int, maps: Path = Path("/proc/self/numa_maps")) -> dict[int, int]:
    """Bytes of the mappings holding the range on each NUMA node, from the kernel's
    ``numa_maps`` (pages present only); {} where it cannot be read."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return {}
    found: dict[int, int] = {}
    starts = [(int(line.split(None, 1)[0], 16), line) for line in lines if line]
    holding = [line for start, line in starts if address <= start < address + mapped]
    before = [(start, line) for start, line in starts if start < address]
    if before and not any(start == address for start, _ in starts):
        holding.append(max(before)[1])  # (the range's start joined an older mapping)
    for line in holding:
        fields = dict(field.split("=", 1) for field in line.split() if "=" in field)
        page = int(fields.get("kernelpagesize_kB", "4")) << 10
        for name, count in fields.items():
            if name[0] == "N" and name[1:].isdigit():
                found[int(name[1:])] = found.get(int(name[1:]), 0) + int(count) * page
    return found
