"""The same-host leg's signals: a page of shared memory that the two processes of one
shared layout map, in which the lender says "lent" and the peer answers "returned" or
"refused" (kvcopy.nixl.same_host).

The two processes are on one host by construction (CUDA IPC maps memory between
processes of one host only), so the signals need no transport: one store each way,
seen by the other process's next look. A NIXL notification between the same two
processes goes through UCX and the agents' progress threads: on a 2-core host about
100 µs at the median and up to 25 ms, against about 12 µs and at most 0.3 ms for this
page (bench/signal_latency.py, docs/nixl.md).

Each signal is one aligned 8-byte word (a sequence number, a state and a digest of
the transfer's tag), stored whole with release order and loaded whole with acquire
order (kvcopy._cuda.shared_words), so that a look never sees half of one, and what the
writer did before it (an event's record, a copy's end) comes before what the reader
does after it, on Arm as on x86; the tag and a refusal's reason are written beside
it, before it, for messages only.
The page lives in /dev/shm (the temporary folder where there is none), readable by
this user only; the peer unlinks it as it maps it, so that a shared layout is opened
once, and the sharing end unlinks it on close where the peer never came.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import struct
import tempfile
import time
import weakref
import zlib
from typing import Callable

from kvcopy._cuda import shared_words
from kvcopy.nixl.transfers import pause

PAGE = 4096
_LENT_AT, _ANSWER_AT, _TAG_AT, _REASON_AT = 0, 64, 128, 512
_TEXT_MAX = 256  # (a tag's bytes kept for messages; the digest decides)
_REASON_MAX = PAGE - _REASON_AT - 2

_WORD_AT = {"lent": _LENT_AT, "answer": _ANSWER_AT}  # (each signal's word)

LENT, WITHDRAWN, RETURNED, REFUSED = 1, 2, 3, 4


def digest(tag: str) -> int:
    """The 24 bits of ``tag`` that a signal carries."""
    return zlib.crc32(tag.encode()) & 0xFFFFFF


def word(sequence: int, state: int, tag: str) -> int:
    """One signal: the transfer's sequence number (32 bits), its state and its tag's digest."""
    return ((sequence & 0xFFFFFFFF) << 32) | (state << 24) | digest(tag)


def fields(value: int) -> tuple[int, int, int]:
    """(sequence, state, digest) of a signal's word."""
    return value >> 32, (value >> 24) & 0xFF, value & 0xFFFFFF


def _folder() -> str:
    return (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    )


class Doorbell:
    """One shared page of signals (see the module). ``create`` makes it in the sharing
    process; ``open`` maps it in the peer and unlinks its name."""

    def __init__(self, path: str, memory: mmap.mmap, owner: bool) -> None:
        self.path = path
        self._memory: mmap.mmap | None = memory
        # (the page's address, for the word loads and stores; dropped before the unmap)
        self._view: ctypes.Array | None = (ctypes.c_char * PAGE).from_buffer(memory)
        self._address = ctypes.addressof(self._view)
        # (a page no peer took is unlinked when its sharer closes, drops or exits)
        self._unlink = weakref.finalize(self, _unlink_quietly, path) if owner else None

    @classmethod
    def create(cls) -> "Doorbell":
        path = os.path.join(_folder(), f"kvcopy-doorbell-{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, PAGE)
            memory = mmap.mmap(fd, PAGE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(path, memory, owner=True)

    @classmethod
    def open(cls, path: str) -> "Doorbell":
        """Map the page at ``path`` and unlink its name (FileNotFoundError where another
        peer opened it first or its sharer closed it)."""
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != PAGE:
                raise ValueError(f"{path!r} is not a kvcopy doorbell ({os.fstat(fd).st_size} bytes)")
            memory = mmap.mmap(fd, PAGE)
        finally:
            os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:  # (another peer took it as this one mapped it)
            memory.close()
            raise
        return cls(path, memory, owner=False)

    def _page(self) -> mmap.mmap:
        if self._memory is None:
            raise ValueError("the doorbell is closed")
        return self._memory

    def read(self, which: str) -> int:
        """The word of the ``lent`` or the ``answer`` signal."""
        self._page()
        return shared_words.load_acquire(self._address + _WORD_AT[which])

    def ring(self, which: str, value: int, tag: str, reason: str = "") -> None:
        """Write the ``lent`` or ``answer`` signal: its tag (and a refusal's reason)
        first, the word last."""
        page = self._page()
        if which == "lent":
            _write_text(page, _TAG_AT, tag, _TEXT_MAX)
        else:
            _write_text(page, _REASON_AT, reason, _REASON_MAX)
        shared_words.store_release(self._address + _WORD_AT[which], value)

    def lent_tag(self) -> str:
        """The tag of the latest lend, as its lender wrote it."""
        return _read_text(self._page(), _TAG_AT)

    def reason(self) -> str:
        """The reason the peer gave with its latest answer."""
        return _read_text(self._page(), _REASON_AT)

    def wait(self, which: str, until: Callable[[int], bool], timeout: float) -> int | None:
        """Look at a signal until ``until(word)`` holds (its word), or None after
        ``timeout`` seconds."""
        started = time.monotonic()
        deadline = started + timeout
        while True:
            value = self.read(which)
            if until(value):
                return value
            if time.monotonic() > deadline:
                return None
            pause(started)

    def close(self) -> None:
        """Unmap the page; the sharing end also unlinks its name where the peer did not."""
        if self._memory is None:
            return
        self._view = None  # (the mapping cannot close while a view of it is alive)
        self._memory.close()
        self._memory = None
        if self._unlink is not None:
            self._unlink()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:  # (the peer unlinked it as it mapped it)
        pass


def _write_text(page: mmap.mmap, at: int, text: str, most: int) -> None:
    data = text.encode(errors="replace")[:most]
    struct.pack_into(f"<H{len(data)}s", page, at, len(data), data)


def _read_text(page: mmap.mmap, at: int) -> str:
    (length,) = struct.unpack_from("<H", page, at)
    return bytes(page[at + 2 : at + 2 + length]).decode(errors="replace")
