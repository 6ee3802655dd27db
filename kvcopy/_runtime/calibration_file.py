"""The calibration file: kvcopy.calibrate's thresholds for one GPU of one host under
one driver (kvcopy._runtime.host_key says what tells them apart).

One file per key under kvcopy.config.cache_dir(), shared by every process using that
GPU; the file holds its key, and a file whose key is not the one asked for is not
used. Guarantees:

- Saves are read-merge-write cycles under the file's lock and replace the file
  atomically (kvcopy._runtime.persist): concurrent saves lose no update and a reader never
  sees a torn file. A save merges only the entries its calibration measured.
- Loads validate every field's type and range. A file that fails gives one
  RuntimeWarning naming the file and the fault, is remembered as bad until it
  changes, and the built-in defaults serve: a copy never fails because of a file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

from kvcopy._runtime import persist
from kvcopy._runtime.host_key import HostKey
from kvcopy.policy import Thresholds

SCHEMA = 3
MAX_SAVES_KEPT = 64  # the newest save records kept in the file
MAX_MEASUREMENTS = 4096
MAX_THRESHOLD_BYTES = 1 << 40
MAX_CTAS = 65535

_THRESHOLD_KEY = re.compile(r"^(h2d|d2h|d2d|p2p|p2p \d{1,4}>\d{1,4})$")
_CTA_KEYS = ("h2d", "d2h")
_TOP_KEYS = {
    "schema",
    "host",
    "device",
    "driver_version",
    "batch_min_bytes",
    "host_ctas",
    "both_ways_ctas",
    "both_ways_batch_min_bytes",
    "measurements",
    "saves",
}

_lock = threading.Lock()
_bad: dict[Path, tuple[int, int, int]] = {}  # path -> (mtime_ns, size, inode) when found bad


def path_for(cache: Path, key: HostKey) -> Path:
    return cache / key.file_name()


def _threshold(value: Any, where: str) -> float:
    """A block-size threshold: a number of bytes, or never (null, 'inf', Infinity)."""
    if value is None or value == "inf" or value == float("inf"):
        return float("inf")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise persist.BadFile(f"{where} is {value!r}, not a number of bytes")
    if not 0 <= value <= MAX_THRESHOLD_BYTES:
        raise persist.BadFile(f"{where} is {value}, outside 0..{MAX_THRESHOLD_BYTES}")
    return float(value)


def _ctas(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CTAS:
        raise persist.BadFile(f"{where} is {value!r}, not a CTA count in 1..{MAX_CTAS}")
    return value


def _table(data: Mapping, name: str, keys: Any, check: Any) -> dict:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise persist.BadFile(f"{name} is a {type(table).__name__}, not an object")
    out = {}
    for key, value in table.items():
        if not (keys.match(key) if hasattr(keys, "match") else key in keys):
            raise persist.BadFile(f"{name} has the unknown key {key!r}")
        out[key] = check(value, f"{name}[{key!r}]")
    return out


def _measurements(data: Mapping) -> dict:
    found = data.get("measurements", {})
    if not isinstance(found, dict) or len(found) > MAX_MEASUREMENTS:
        raise persist.BadFile(f"measurements is not an object of at most {MAX_MEASUREMENTS} entries")
    for key, row in found.items():
        if not isinstance(row, dict) or not all(
            isinstance(k, str)
            and not isinstance(v, bool)
            and isinstance(v, (int, float))
            and math.isfinite(v)
            for k, v in row.items()
        ):
            raise persist.BadFile(f"measurements[{key!r}] is not an object of finite numbers")
    return found


def validate(data: Any, key: HostKey) -> dict:
    """The file's content, every field checked; raises persist.BadFile naming the fault.
    Returns the parsed tables: batch_min_bytes, host_ctas, both_ways_ctas,
    both_ways_batch_min_bytes (where present), measurements, saves."""
    if not isinstance(data, dict):
        raise persist.BadFile(f"holds a {type(data).__name__}, not an object")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise persist.BadFile(f"has unknown entries {sorted(unknown)}")
    schema = data.get("schema", 1)
    if schema not in (1, 2, SCHEMA):
        raise persist.BadFile(f"has schema {schema!r}; this kvcopy reads 1 to {SCHEMA}")
    for name, want in (("device", key.device), ("driver_version", key.driver_version)):
        if name in data and data[name] != want:
            raise persist.BadFile(f"is for {name} {data[name]!r}, not {want!r}")
    if "host" in data and data["host"] != key.as_dict():
        raise persist.BadFile(f"was measured on another GPU or host ({data['host']!r})")
    if "batch_min_bytes" not in data:
        raise persist.BadFile("has no batch_min_bytes")
    out: dict[str, Any] = {
        "batch_min_bytes": _table(data, "batch_min_bytes", _THRESHOLD_KEY, _threshold),
        "host_ctas": _table(data, "host_ctas", _CTA_KEYS, _ctas),
        "both_ways_ctas": _table(data, "both_ways_ctas", _CTA_KEYS, _ctas),
        "measurements": _measurements(data),
    }
    if "both_ways_batch_min_bytes" in data:
        out["both_ways_batch_min_bytes"] = _threshold(
            data["both_ways_batch_min_bytes"], "both_ways_batch_min_bytes"
        )
    saves = data.get("saves", [])
    if not isinstance(saves, list) or not all(isinstance(s, dict) for s in saves):
        raise persist.BadFile("saves is not a list of objects")
    out["saves"] = saves[-MAX_SAVES_KEPT:]
    return out


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def _warn_bad(path: Path, fault: str) -> None:
    warnings.warn(
        f"kvcopy: ignoring the calibration file {path}: it {fault}; the built-in "
        "defaults are used (run kvcopy.calibrate() again to rewrite it)",
        RuntimeWarning,
        stacklevel=4,
    )


def load(path: Path, key: HostKey) -> Thresholds | None:
    """The thresholds in ``path`` over the defaults, or None where there is no usable
    file (missing; or bad, with one warning per version of the file)."""
    signature = _signature(path)
    if signature is None:
        return None
    with _lock:
        if _bad.get(path) == signature:
            return None
        try:
            tables = validate(persist.read_json(path, allow_infinity=True), key)
        except persist.BadFile as exc:
            _bad[path] = signature
            _warn_bad(path, str(exc))
            return None
        _bad.pop(path, None)
    return _over_defaults(tables)


def _over_defaults(tables: Mapping) -> Thresholds:
    """The defaults with the file's entries over them (a file written before a direction
    or a table existed keeps the defaults there)."""
    defaults = Thresholds()
    return dataclasses.replace(
        defaults,
        batch_min_bytes={**defaults.batch_min_bytes, **tables["batch_min_bytes"]},
        host_ctas={**defaults.host_ctas, **tables["host_ctas"]},
        both_ways_ctas={**defaults.both_ways_ctas, **tables["both_ways_ctas"]},
        both_ways_batch_min_bytes=tables.get("both_ways_batch_min_bytes", defaults.both_ways_batch_min_bytes),
        rates=rates_of(tables["measurements"]),
    )


def rates_of(measurements: Mapping) -> dict:
    """The block rates among a calibration's measurements ('h2d/4096': {'kernel': GB/s,
    'batch': GB/s}) as Thresholds.rates: direction -> block bytes -> method -> GB/s."""
    rates: dict = {}
    for key, gbps in measurements.items():
        direction, _, block = key.partition("/")
        if direction in ("h2d", "d2h") and block.isdigit():
            methods = {m: float(v) for m, v in gbps.items() if m in ("kernel", "batch") and v > 0}
            if methods:
                rates.setdefault(direction, {})[int(block)] = methods
    return rates


def _encode_threshold(value: float) -> float | None:
    return None if value == float("inf") else value


def save(
    path: Path,
    key: HostKey,
    updates: Mapping[str, Any],
    measurements: Mapping[str, Mapping[str, float]],
    ordinal: int = -1,
) -> Thresholds:
    """Merge ``updates`` (table name -> {key: value}, or both_ways_batch_min_bytes ->
    value) and ``measurements`` into the file under its lock and replace it atomically.
    A bad file is replaced (with a warning). Returns the thresholds the file now holds.

    Raises:
        OSError: the folder cannot be written (nothing is left behind).
    """
    with persist.locked(path):
        try:
            current = validate(persist.read_json(path, allow_infinity=True) or {"batch_min_bytes": {}}, key)
        except persist.BadFile as exc:
            _warn_bad(path, f"{exc} (it is being replaced)")
            current = validate({"batch_min_bytes": {}}, key)
        for name, value in updates.items():
            if name == "both_ways_batch_min_bytes":
                current[name] = float(value)
            else:
                current[name] = {**current[name], **value}
        # the newest MAX_MEASUREMENTS only: a file past the loader's cap would be refused
        # whole at the next load or save, thresholds and all
        merged = {k: v for k, v in current["measurements"].items() if k not in measurements}
        merged.update(measurements)
        current["measurements"] = dict(list(merged.items())[-MAX_MEASUREMENTS:])
        current["saves"] = (
            current["saves"]
            + [
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "ordinal": ordinal,
                    "at": round(time.time(), 3),
                    "measured": sorted(measurements),
                }
            ]
        )[-MAX_SAVES_KEPT:]
        document = {
            "schema": SCHEMA,
            "host": key.as_dict(),
            "device": key.device,
            "driver_version": key.driver_version,
            "batch_min_bytes": {k: _encode_threshold(v) for k, v in current["batch_min_bytes"].items()},
            "host_ctas": current["host_ctas"],
            "both_ways_ctas": current["both_ways_ctas"],
            "measurements": current["measurements"],
            "saves": current["saves"],
        }
        if "both_ways_batch_min_bytes" in current:
            document["both_ways_batch_min_bytes"] = _encode_threshold(current["both_ways_batch_min_bytes"])
        persist.atomic_write(path, persist.dump_json(document))
        with _lock:
            _bad.pop(path, None)
    return _over_defaults(current)


__all__ = ["SCHEMA", "load", "path_for", "save", "validate"]
