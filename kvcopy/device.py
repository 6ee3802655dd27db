"""Per-device facts and state, gathered once: capabilities, thresholds, kernel."""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

from kvcopy import _driver, kernels
from kvcopy.policy import DeviceCaps, Thresholds


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    cc: tuple[int, int]
    driver_version: int
    caps: DeviceCaps


_lock = threading.Lock()
_infos: dict[int, DeviceInfo] = {}
_thresholds: dict[int, Thresholds] = {}
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
        attrs = _driver.device_attributes(ordinal)
        kernel_ok = True
        try:
            kernels.kernel_for_current_context(attrs["cc_major"], attrs["cc_minor"],
                                               attrs["driver_version"])
        except kernels.KernelUnavailable as exc:
            kernel_ok = False
            warnings.warn(f"kvcopy: copy kernel unavailable on device {ordinal}, "
                          f"using DMA only: {exc}", RuntimeWarning, stacklevel=3)
        caps = DeviceCaps(
            sm_count=attrs["sm_count"],
            unified_addressing=bool(attrs["unified_addressing"]),
            can_map_host_memory=bool(attrs["can_map_host_memory"]),
            batch_available=_driver.batch_abi() != 0,
            kernel_available=kernel_ok,
        )
        info = DeviceInfo(ordinal, attrs["name"], (attrs["cc_major"], attrs["cc_minor"]),
                          attrs["driver_version"], caps)
        _infos[ordinal] = info
        return info


def thresholds(ordinal: int) -> Thresholds:
    """Calibrated thresholds of a device, else the H200 defaults."""
    found = _thresholds.get(ordinal)
    if found is None:
        from kvcopy import calibration

        found = calibration.load(device_info(ordinal)) or Thresholds()
        _thresholds[ordinal] = found
    return found


def set_thresholds(ordinal: int, value: Thresholds) -> None:
    global generation
    _thresholds[ordinal] = value
    generation += 1


def forget_batch_support() -> None:
    """Re-read batch support (after _driver.set_batch_disabled, in tests)."""
    global generation
    with _lock:
        _infos.clear()
        generation += 1
