"""A calibration is kept per GPU, PCIe link, host and driver: the key is read from
the driver's facts and the host's /sys and machine id, names the file, and a file of
another key is not used."""

from __future__ import annotations

import json
import warnings

import pytest

from kvcopy import testing
from kvcopy.policy import DeviceCaps, Thresholds

device, calibration_file = testing.engine.device, testing.engine.calibration_file
host_key = testing.engine.host_key
ATTRS = {
    "name": "NVIDIA H100 80GB HBM3",
    "driver_version": 13000,
    "uuid": "5f1c0a9e" * 4,
    "pci_domain": 0,
    "pci_bus": 0x1B,
    "pci_device": 0,
}


def _sysfs(root, speed="32.0 GT/s PCIe", width="16"):
    folder = root / "bus" / "pci" / "devices" / "0000:1b:00.0"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "current_link_speed").write_text(speed + "\n")
    (folder / "current_link_width").write_text(width + "\n")
    return root


def test_the_key_names_the_gpu_its_link_the_host_and_the_driver(tmp_path):
    machine = tmp_path / "machine-id"
    machine.write_text("0123456789abcdef\n")
    key = host_key.read_host_key(ATTRS, _sysfs(tmp_path / "sys"), machine)
    assert key.as_dict() == {
        "device": "NVIDIA H100 80GB HBM3",
        "driver_version": 13000,
        "gpu": "5f1c0a9e" * 4,
        "pci": "0000:1b:00.0",
        "link": "32.0 GT/s PCIe x16",
        "host": "0123456789abcdef",
    }
    assert key.file_name().startswith("calibration-NVIDIA-H100-80GB-HBM3-driver13000-")
    # a link that trained narrower, another host, another GPU: each another file
    narrow = host_key.read_host_key(ATTRS, _sysfs(tmp_path / "narrow", width="8"), machine)
    other_machine = tmp_path / "other-id"
    other_machine.write_text("fedcba\n")
    elsewhere = host_key.read_host_key(ATTRS, _sysfs(tmp_path / "sys"), other_machine)
    other_gpu = host_key.read_host_key({**ATTRS, "uuid": "00" * 16}, _sysfs(tmp_path / "sys"), machine)
    names = {k.file_name() for k in (key, narrow, elsewhere, other_gpu)}
    assert len(names) == 4


def test_a_key_that_cannot_be_read_is_less_specific_not_an_error(tmp_path):
    key = host_key.read_host_key({"name": "GPU", "driver_version": 12080}, tmp_path, tmp_path / "absent")
    assert (key.gpu, key.pci, key.link) == ("", "", "") and key.host  # (the host name)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(tmp_path))
    calibration_file._bad.clear()
    return tmp_path


def test_a_file_measured_under_another_key_is_not_used(cache, tmp_path):
    machine = tmp_path / "machine-id"
    machine.write_text("host-a\n")
    key_a = host_key.read_host_key(ATTRS, _sysfs(tmp_path / "sys"), machine)
    machine.write_text("host-b\n")
    key_b = host_key.read_host_key(ATTRS, _sysfs(tmp_path / "sys"), machine)
    on_a = device.DeviceInfo(0, ATTRS["name"], (9, 0), 13000, DeviceCaps(), key_a)
    on_b = device.DeviceInfo(0, ATTRS["name"], (9, 0), 13000, DeviceCaps(), key_b)
    device.save_thresholds(on_a, {"batch_min_bytes": {"h2d": 16 << 10}}, {})
    assert device.load_thresholds(on_a).batch_min_bytes["h2d"] == 16 << 10
    assert device.load_thresholds(on_b) is None  # host b has measured nothing
    written = json.loads(device.thresholds_path(on_a).read_text())
    assert written["host"] == key_a.as_dict() and written["schema"] == calibration_file.SCHEMA
    # host a's file copied to where host b looks: refused by its key, defaults serve
    device.thresholds_path(on_b).write_text(json.dumps(written))
    with pytest.warns(RuntimeWarning, match="was measured on another GPU or host"):
        assert device.load_thresholds(on_b) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (device.load_thresholds(on_b) or Thresholds()) == Thresholds()  # (warned once)
