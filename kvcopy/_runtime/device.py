"""Per-device facts and state, gathered once: capabilities, thresholds (and their
files, written by kvcopy.calibrate), and the copy kernel's availability."""

from __future__ import annotations

import dataclasses
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from kvcopy._runtime import calibration_file, first_use, kernels
from kvcopy._runtime.host_key import HostKey, read_host_key
from kvcopy._cuda import dma, driver
from kvcopy.config import cache_dir
from kvcopy.policy import DeviceCaps, Thresholds


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    cc: tuple[int, int]
    driver_version: int
    caps: DeviceCaps
    key: HostKey | None = None  # (None: the model and driver alone, as a fake device has)

    def host_key(self) -> HostKey:
        """What its calibration is kept under."""
        return self.key if self.key is not None else HostKey(self.name, self.driver_version)


_lock = threading.Lock()
_infos: dict[int, DeviceInfo] = {}
_thresholds: dict[int, Thresholds] = {}
_caps_overrides: dict[str, bool | int] = {}
# Bumped whenever a fact the policy reads changes (thresholds, capabilities),
# so that decisions remembered under an older generation are not reused.
generation = 0


def device_info(ordinal: int) -> DeviceInfo:
    """Capabilities of device ``ordinal`` (the current context must be on it)."""
    info = _infos.get(ordinal)
    if info is not None:
        return info
    with _lock:
        if ordinal in _infos:
            return _infos[ordinal]
        attrs = driver.device_attributes(ordinal)
        cc = (int(attrs["cc_major"]), int(attrs["cc_minor"]))
        driver_version = int(attrs["driver_version"])
        kernel_ok = True
        try:
            kernels.kernel_for_current_context(*cc, driver_version)
        except kernels.KernelUnavailable as exc:
            kernel_ok = False
            warnings.warn(
                f"kvcopy: copy kernel unavailable on device {ordinal}, using DMA only: {exc}",
                RuntimeWarning,
                stacklevel=3,
            )
        caps = DeviceCaps(
            sm_count=int(attrs["sm_count"]),
            unified_addressing=bool(attrs["unified_addressing"]),
            can_map_host_memory=bool(attrs["can_map_host_memory"]),
            batch_available=dma.batch_abi() != 0,
            kernel_available=kernel_ok,
            bulk_copy=kernel_ok and cc >= (9, 0),
        )
        caps = dataclasses.replace(caps, **_caps_overrides)  # type: ignore[arg-type]
        info = DeviceInfo(ordinal, str(attrs["name"]), cc, driver_version, caps, read_host_key(attrs))
        _infos[ordinal] = info
        return info


def override_capabilities(**caps: bool | int) -> None:
    """Make every device report these DeviceCaps fields (no arguments: the real
    ones again). For tests of old drivers and missing features; see kvcopy.testing."""
    global generation
    unknown = set(caps) - {f.name for f in dataclasses.fields(DeviceCaps)}
    if unknown:
        raise TypeError(f"override_capabilities: no such capability {sorted(unknown)}")
    with _lock:
        _caps_overrides.clear()
        _caps_overrides.update(caps)
        _infos.clear()
        generation += 1


def thresholds(ordinal: int) -> Thresholds:
    """Calibrated thresholds of a device, else the built-in defaults (and, where
    config.auto_calibrate is set, its calibration starts in the background:
    kvcopy._runtime.first_use)."""
    found = _thresholds.get(ordinal)
    if found is None:
        info = device_info(ordinal)
        loaded = load_thresholds(info)
        if loaded is None:
            first_use.noticed(ordinal, thresholds_path(info), lambda: _settle(info))
        found = loaded or Thresholds()
        _thresholds[ordinal] = found
    return found


def _settle(info: DeviceInfo) -> bool:
    """Load the device's file into its thresholds; whether there was a usable one."""
    loaded = load_thresholds(info)
    if loaded is not None:
        set_thresholds(info.ordinal, loaded)
    return loaded is not None


def set_thresholds(ordinal: int, value: Thresholds) -> None:
    global generation
    _thresholds[ordinal] = value
    generation += 1


def thresholds_path(info: DeviceInfo) -> Path:
    """The file calibrate() writes for this GPU, host and driver."""
    return calibration_file.path_for(cache_dir(), info.host_key())


def load_thresholds(info: DeviceInfo) -> Thresholds | None:
    """Thresholds saved by calibrate() for this GPU, host and driver, over the
    defaults; None where there is no usable file (a bad one is warned about once)."""
    return calibration_file.load(thresholds_path(info), info.host_key())


def save_thresholds(info: DeviceInfo, updates: dict, measurements: dict) -> Thresholds:
    """Merge what a calibration measured (``updates``: table -> {key: value}, or
    'both_ways_batch_min_bytes' -> value) and the measurements behind it into the
    device's file, under its lock; returns the thresholds the file now holds.

    Raises:
        OSError: the cache folder cannot be written.
    """
    return calibration_file.save(thresholds_path(info), info.host_key(), updates, measurements, info.ordinal)
