"""Calibration at first use (config.auto_calibrate): a GPU of a host that has no
calibration file for its key (kvcopy._runtime.host_key) is measured once, in the
background, by one process of the host, while the built-in defaults serve; every
process using that GPU then loads the file, and a host whose key changes (another
GPU, a link that trained narrower, another driver) is measured again.

How it stays out of the caller's way:

- it runs on a thread of its own, never inside a caller's call, and starts only once
  the device has issued no copy between host and GPU for AUTO_CALIBRATION_QUIET_S;
- that thread relaxes its own stream-capture mode and uses only a stream and memory
  of its own (kvcopy.calibrate), so a CUDA graph another thread captures is neither
  broken by its calls nor joined by its work;
- across processes only one measures: the key's lock is taken without waiting; a
  process that finds it taken waits for the file the other writes and loads it (one
  whose measuring peer died takes its place);
- any failure (no memory for the scratch, a driver error) is warned about once, and
  the defaults stay.
"""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Callable

from kvcopy._engine import traffic_window
from kvcopy._runtime import persist
from kvcopy.config import config
from kvcopy.policy.defaults import (
    AUTO_CALIBRATION_POLL_S,
    AUTO_CALIBRATION_QUIET_S,
    AUTO_CALIBRATION_WAIT_S,
)

# kvcopy.calibrate's measurement of a device (it writes the file), set when that
# module is imported: this layer schedules, the API layer measures.
measure: Callable[[int], None] | None = None

_THREAD_NAME = "kvcopy-calibration-"  # and the device's ordinal
_started: set[Path] = set()  # the files of the keys calibrated from this process
_started_lock = threading.Lock()
_clock: Callable[[], float] = time.monotonic
_sleep: Callable[[float], None] = time.sleep


def noticed(ordinal: int, path: Path, settle: Callable[[], bool]) -> threading.Thread | None:
    """Device ``ordinal``'s thresholds were asked for and ``path`` (its file, named
    for its key) held none: start its calibration, once per key and process, where
    config.auto_calibrate is set. ``settle()`` loads the file into the device's
    thresholds and says whether it could. Returns the thread started, if any."""
    if not config.auto_calibrate or measure is None:
        return None
    with _started_lock:
        if path in _started:
            return None
        _started.add(path)
    worker = threading.Thread(
        target=_calibrate, args=(ordinal, path, settle), name=f"{_THREAD_NAME}{ordinal}", daemon=True
    )
    worker.start()
    return worker


def _wait_quiet(ordinal: int) -> None:
    """Return once the device has issued no copy for AUTO_CALIBRATION_QUIET_S."""
    while True:
        idle = traffic_window.idle_s(ordinal)
        if idle >= AUTO_CALIBRATION_QUIET_S:
            return
        _sleep(AUTO_CALIBRATION_QUIET_S - idle)


def _calibrate(ordinal: int, path: Path, settle: Callable[[], bool]) -> None:
    """Measure (or wait for the process that does), then load the file."""
    deadline = _clock() + AUTO_CALIBRATION_WAIT_S
    try:
        while not settle():
            with persist.try_locked(path.with_name(path.name + ".measuring")) as ours:
                if ours:
                    if settle():  # (written while this process waited for the lock)
                        return
                    _wait_quiet(ordinal)
                    assert measure is not None
                    measure(ordinal)
                    if not settle():
                        raise RuntimeError(f"the calibration wrote no usable {path}")
                    return
            if _clock() > deadline:
                raise TimeoutError(
                    f"another process has measured this GPU for {AUTO_CALIBRATION_WAIT_S:.0f} s "
                    f"without writing {path}"
                )
            _sleep(AUTO_CALIBRATION_POLL_S)
    except Exception as exc:  # noqa: BLE001 - the defaults serve; the caller is not ours to fail
        warnings.warn(
            f"kvcopy: calibration at first use of device {ordinal} did not finish ({type(exc).__name__}: "
            f"{exc}); the built-in defaults stay (kvcopy.calibrate() measures on demand)",
            RuntimeWarning,
            stacklevel=1,
        )


def wait(timeout: float | None = None) -> bool:
    """Wait for the calibrations this process started (at most ``timeout`` seconds in
    all, None: without limit); whether none is still running. A benchmark that times
    'auto' at a first use waits so, rather than measuring beside the calibration."""
    deadline = None if timeout is None else _clock() + timeout
    for worker in threading.enumerate():
        if worker.name.startswith(_THREAD_NAME):
            worker.join(None if deadline is None else max(0.0, deadline - _clock()))
            if worker.is_alive():
                return False
    return True


def forget() -> None:
    """Let every key be calibrated again at its next first use (tests)."""
    with _started_lock:
        _started.clear()
