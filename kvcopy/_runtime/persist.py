"""Files kvcopy keeps on disk (calibrations, compiled kernels): written whole or not
at all, serialised across processes, and read back strictly.

The rules, said once:

- A writer writes a temporary file in the target's folder and renames it into
  place (``os.replace`` is atomic on POSIX), so a reader sees the old file or the
  new one, never a torn one, and a writer killed mid-write leaves the old file.
  The temporary file is removed on every failure.
- Read-merge-write cycles hold an exclusive ``flock`` on a ``<name>.lock`` file
  beside the target, so concurrent writers (one process per GPU of a node) never
  lose each other's updates. Readers need no lock.
- JSON is parsed strictly: no NaN literals (Infinity only where the caller asks
  for it), no number of more than
  :data:`MAX_NUMBER_CHARS` characters, no nesting deeper than :data:`MAX_DEPTH`,
  no file larger than :data:`MAX_FILE_BYTES`. Anything else is :class:`BadFile`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

try:  # POSIX; elsewhere writes are still atomic, only not serialised
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

MAX_FILE_BYTES = 1 << 20
MAX_NUMBER_CHARS = 40
MAX_DEPTH = 8


class BadFile(ValueError):
    """A file kvcopy keeps is unreadable or malformed; the message says what is wrong."""


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` in one step. Raises OSError (nothing left behind)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the exclusive lock of ``path`` (on ``<path>.lock``) for a read-merge-write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a+b") as lock:
        if fcntl is not None:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def try_locked(path: Path) -> Iterator[bool]:
    """Hold ``path``'s exclusive lock (on ``<path>.lock``) where no one else does, without
    waiting: yields whether it is held. The lock goes with its holder's process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a+b") as lock:
        if fcntl is None:
            yield True
            return
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _constant(allow_infinity: bool) -> Any:
    def parse(name: str) -> Any:
        if name == "Infinity" and allow_infinity:
            return float("inf")
        raise BadFile(f"holds the non-JSON number {name}")

    return parse


def _bounded_number(kind: type) -> Any:
    def parse(text: str) -> Any:
        if len(text) > MAX_NUMBER_CHARS:
            raise BadFile(f"holds a number of {len(text)} characters")
        value = kind(text)
        if kind is float and value in (float("inf"), float("-inf")):
            raise BadFile(f"holds {text}, which overflows a float")
        return value

    return parse


def _depth(value: Any, level: int = 0) -> int:
    if level > MAX_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level + 1)
    return level


def parse_json(data: bytes, *, allow_infinity: bool = False) -> Any:
    """``data`` as strict JSON (see the module's rules); ``allow_infinity`` takes the
    literal Infinity (as Python's json module writes float('inf')). Raises BadFile."""
    if len(data) > MAX_FILE_BYTES:
        raise BadFile(f"is {len(data)} bytes, more than the {MAX_FILE_BYTES} allowed")
    if data.count(b"[") + data.count(b"{") > 0 and _bracket_depth(data) > MAX_DEPTH:
        raise BadFile(f"nests deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(
            data.decode("utf-8"),
            parse_constant=_constant(allow_infinity),
            parse_float=_bounded_number(float),
            parse_int=_bounded_number(int),
        )
    except BadFile:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise BadFile(f"is not valid JSON ({type(exc).__name__}: {exc})") from None
    if _depth(value) > MAX_DEPTH:  # pragma: no cover - _bracket_depth refuses it first
        raise BadFile(f"nests deeper than {MAX_DEPTH} levels")
    return value


def _bracket_depth(data: bytes) -> int:
    """The deepest nesting of brackets outside strings, without recursion (a file of
    a million '[' must not reach the parser's recursion limit)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                return deepest
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def read_json(path: Path, *, allow_infinity: bool = False) -> Any | None:
    """The JSON value in ``path``; None where there is no such file. Raises BadFile
    for a file that cannot be read or parsed."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BadFile(f"cannot be read ({exc.strerror or exc})") from None
    return parse_json(data, allow_infinity=allow_infinity)


def dump_json(value: Any) -> bytes:
    """``value`` as strict JSON bytes (ValueError for NaN or infinities: store those
    as something a strict reader takes)."""
    return json.dumps(value, indent=1, allow_nan=False, sort_keys=True).encode()


__all__ = ["BadFile", "atomic_write", "dump_json", "locked", "parse_json", "read_json"]
