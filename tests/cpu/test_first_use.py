"""Calibration at first use (config.auto_calibrate), on the CPU with the measurement
faked: it runs once per key, in the background, after the device is quiet; across
processes one measures and every one loads its file; a failure leaves the defaults."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from kvcopy import testing
from kvcopy.policy import DeviceCaps, Thresholds

first_use, calibration_file = testing.engine.first_use, testing.engine.calibration_file
traffic_window, device = testing.engine.traffic_window, testing.engine.device
HostKey = testing.engine.host_key.HostKey
KEY = HostKey("Fake GPU", 13000, gpu="ab" * 16, pci="0000:1b:00.0", link="32.0 GT/s PCIe x16", host="h")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    first_use.forget()
    traffic_window.forget()
    calibration_file._bad.clear()
    monkeypatch.setattr(first_use, "measure", None)
    yield
    first_use.forget()


def _measure_writing(path: Path, h2d: int, log: Path | None = None, pause: float = 0.0):
    """A measurement that writes ``h2d`` as the host-to-GPU threshold into ``path``."""

    def measure(ordinal: int) -> None:
        if log is not None:
            with open(log, "a") as out:
                out.write(f"{os.getpid()}\n")
        time.sleep(pause)
        calibration_file.save(path, KEY, {"batch_min_bytes": {"h2d": h2d}}, {"h2d/64": {"kernel": 1.0}})

    return measure


def _settler(path: Path, into: list):
    def settle() -> bool:
        loaded = calibration_file.load(path, KEY)
        if loaded is not None:
            into.append(loaded)
        return loaded is not None

    return settle


def test_it_is_on_unless_turned_off():
    env = {k: v for k, v in os.environ.items() if k != "KVCOPY_AUTO_CALIBRATE"}
    code = "from kvcopy.config import config; print(config.auto_calibrate)"
    found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "True"  # (tests/conftest.py turns it off for the suite)


def test_nothing_runs_where_turned_off(tmp_path, monkeypatch):
    monkeypatch.setattr(first_use, "measure", _measure_writing(tmp_path / "c.json", 4096))
    with testing.settings(auto_calibrate=False):
        assert first_use.noticed(0, tmp_path / "c.json", lambda: False) is None
    with testing.settings(auto_calibrate=True):
        monkeypatch.setattr(first_use, "measure", None)  # (kvcopy.calibrate not imported)
        assert first_use.noticed(0, tmp_path / "c.json", lambda: False) is None


def test_a_first_use_measures_once_in_the_background_and_loads_the_result(tmp_path, monkeypatch):
    path, loaded = tmp_path / KEY.file_name(), []
    calls = []
    measure = _measure_writing(path, 16 << 10)
    monkeypatch.setattr(first_use, "measure", lambda ordinal: (calls.append(ordinal), measure(ordinal)))
    with testing.settings(auto_calibrate=True):
        worker = first_use.noticed(3, path, _settler(path, loaded))
        assert worker is not None and worker.daemon
        assert first_use.noticed(3, path, _settler(path, loaded)) is None  # once per key
        assert first_use.wait(10)
        assert not worker.is_alive()
    assert calls == [3] and loaded[-1].batch_min_bytes["h2d"] == 16 << 10


def test_wait_says_where_a_calibration_is_still_running(tmp_path, monkeypatch):
    path, release = tmp_path / KEY.file_name(), threading.Event()
    measure = _measure_writing(path, 8 << 10)
    monkeypatch.setattr(first_use, "measure", lambda ordinal: (release.wait(10), measure(ordinal)))
    with testing.settings(auto_calibrate=True):
        worker = first_use.noticed(2, path, _settler(path, []))
        assert worker is not None
        assert first_use.wait(0.05) is False  # still measuring
        release.set()
        assert first_use.wait(10) is True and not worker.is_alive()


def test_it_waits_until_the_device_has_been_quiet(monkeypatch):
    now = [100.0]
    slept = []
    monkeypatch.setattr(traffic_window, "_clock", lambda: now[0])
    monkeypatch.setattr(first_use, "_sleep", lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    traffic_window.note(0, "h2d", 7, 1 << 20)  # a copy just now
    now[0] += 0.25
    first_use._wait_quiet(0)
    assert slept == [pytest.approx(0.75)] and traffic_window.idle_s(0) >= 1.0
    assert traffic_window.idle_s(1) == float("inf")  # another device never copied
    first_use._wait_quiet(1)
    assert len(slept) == 1


def test_a_failed_measurement_warns_once_and_the_defaults_stay(tmp_path, monkeypatch):
    def broken(ordinal: int) -> None:
        raise MemoryError("no scratch")

    monkeypatch.setattr(first_use, "measure", broken)
    loaded: list = []
    with pytest.warns(
        RuntimeWarning, match=r"calibration at first use of device 0 did not finish \(MemoryError"
    ):
        first_use._calibrate(0, tmp_path / KEY.file_name(), _settler(tmp_path / KEY.file_name(), loaded))
    assert loaded == []


def _first_use_in_a_process(folder: str, h2d: int, die: bool = False) -> None:
    """One process's first use: measure (writing ``h2d``) or wait for another's file,
    then write what it loaded to FOLDER/<pid>.loaded."""
    path, log, loaded = Path(folder) / KEY.file_name(), Path(folder) / "measured", []
    if die:  # takes the lock, then dies without writing the file

        def measure(ordinal: int) -> None:
            (Path(folder) / "dying").touch()
            time.sleep(0.5)  # (holding the lock: the survivor waits on it)
            os._exit(3)

        first_use.measure = measure
    else:
        first_use.measure = _measure_writing(path, h2d, log, pause=0.5)
    first_use.AUTO_CALIBRATION_POLL_S = 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first_use._calibrate(0, path, _settler(path, loaded))
    (Path(folder) / f"{os.getpid()}.loaded").write_text(str(loaded[-1].batch_min_bytes["h2d"]))


def test_concurrent_first_uses_from_several_processes_measure_once_and_agree(tmp_path):
    ctx = multiprocessing.get_context("fork")
    workers = [
        ctx.Process(target=_first_use_in_a_process, args=(str(tmp_path), 1024 * (w + 1))) for w in range(5)
    ]
    for p in workers:
        p.start()
    for p in workers:
        p.join(60)
        assert p.exitcode == 0
    measured = (tmp_path / "measured").read_text().split()
    assert len(measured) == 1  # one process measured
    answers = {p.read_text() for p in tmp_path.glob("*.loaded")}
    assert len(list(tmp_path.glob("*.loaded"))) == 5 and len(answers) == 1  # all loaded its result


def test_a_process_whose_measuring_peer_died_takes_its_place(tmp_path):
    ctx = multiprocessing.get_context("fork")
    dying = ctx.Process(target=_first_use_in_a_process, args=(str(tmp_path), 0, True))
    dying.start()
    while not (tmp_path / "dying").exists():  # it holds the lock and measures
        time.sleep(0.01)
    survivor = ctx.Process(target=_first_use_in_a_process, args=(str(tmp_path), 8192))
    survivor.start()
    dying.join(30)
    survivor.join(30)
    assert dying.exitcode == 3 and survivor.exitcode == 0
    assert (tmp_path / "measured").read_text().split() == [str(survivor.pid)]
    assert [p.read_text() for p in tmp_path.glob("*.loaded")] == ["8192.0"]


def test_a_damaged_file_is_measured_again(tmp_path, monkeypatch):
    path, loaded = tmp_path / KEY.file_name(), []
    path.write_text('{"batch_min_bytes": {"h2d": "lots"}}')
    monkeypatch.setattr(first_use, "measure", _measure_writing(path, 32 << 10))
    with pytest.warns(RuntimeWarning, match="ignoring the calibration file"):
        first_use._calibrate(0, path, _settler(path, loaded))
    assert loaded[-1].batch_min_bytes["h2d"] == 32 << 10


def test_a_device_without_a_file_serves_the_defaults_and_starts_its_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(tmp_path))
    started = []
    monkeypatch.setattr(first_use, "noticed", lambda *args: started.append(args))
    info = device.DeviceInfo(5, "Fake GPU", (9, 0), 13000, DeviceCaps(), KEY)
    monkeypatch.setattr(device, "device_info", lambda ordinal: info)
    device._thresholds.pop(5, None)
    assert device.thresholds(5) == Thresholds()
    (ordinal, path, settle) = started[0]
    assert (ordinal, path) == (5, tmp_path / KEY.file_name())
    assert settle() is False  # no file yet
    device.save_thresholds(info, {"batch_min_bytes": {"h2d": 4096}}, {})
    assert settle() is True and device.thresholds(5).batch_min_bytes["h2d"] == 4096
    device._thresholds.pop(5, None)


def test_a_store_and_a_load_at_once_are_measured_only_with_enough_bytes():
    from kvcopy.calibrate import measures_both_ways
    from kvcopy.policy.defaults import AUTO_CALIBRATION_BYTES, BOTH_WAYS_CALIBRATION_MIN_BYTES

    both = DeviceCaps(kernel_available=True, batch_available=True)
    assert measures_both_ways(both, 64 << 20)  # calibrate()'s default
    assert not measures_both_ways(both, BOTH_WAYS_CALIBRATION_MIN_BYTES - 1)
    # the first use keeps the default crossover unless it measures as much
    assert measures_both_ways(both, AUTO_CALIBRATION_BYTES) == (
        AUTO_CALIBRATION_BYTES >= BOTH_WAYS_CALIBRATION_MIN_BYTES
    )
    for caps in (DeviceCaps(kernel_available=False), DeviceCaps(batch_available=False)):
        assert not measures_both_ways(caps, 1 << 30)  # nothing to compare
