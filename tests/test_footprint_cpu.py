"""The copy kernel's footprint over PCIe (CPU): the fewest CTAs calibrate keeps, the
CTAs each direction gets alone and beside the other, and calibration files."""
from __future__ import annotations

import json

import pytest

from kvcopy import device, engine
from kvcopy.config import config
from kvcopy.calibrate import _next_threshold
from kvcopy.policy import (BOTH_WAYS_BATCH_MIN_BYTES, BOTH_WAYS_CTAS, HOST_CTAS, CopyRequest, Decision, DeviceCaps,
                           Thresholds, fewest_ctas)

MiB = 1 << 20


def test_fewest_ctas_that_reach_the_floor():
    # H200 host-to-GPU at 4 KiB and 256 KiB (bench/results/h200-serving-probe.txt)
    assert fewest_ctas({1: 0.35, 2: 0.63, 4: 0.90, 8: 0.90, 16: 0.91}) == 4
    assert fewest_ctas({1: 0.60, 2: 0.93, 4: 0.94, 8: 0.94}) == 2


def test_fewest_ctas_where_none_reaches_the_floor_takes_the_closest():
    assert fewest_ctas({1: 0.4, 2: 0.7, 4: 0.86, 8: 0.86, 16: 0.85}) == 4


def test_fewest_ctas_needs_measurements():
    with pytest.raises(ValueError, match="no measurements"):
        fewest_ctas({})


def test_ctas_per_direction_alone_and_both_ways():
    t = Thresholds(host_ctas={"h2d": 4, "d2h": 2}, both_ways_ctas={"h2d": 32, "d2h": 16})
    assert (t.ctas_for("h2d"), t.ctas_for("d2h")) == (4, 2)
    assert (t.ctas_for("h2d", both_ways=True), t.ctas_for("d2h", both_ways=True)) == (32, 16)
    assert t.ctas_for("mixed") == 4 and t.ctas_for("mixed", both_ways=True) == 32
    assert Thresholds().ctas_for("h2d") == HOST_CTAS["h2d"]
    assert Thresholds().both_ways_ctas == BOTH_WAYS_CTAS


def _target(direction: str, thresholds: Thresholds) -> engine.Target:
    info = device.DeviceInfo(0, "Fake GPU", (9, 0), 13000, DeviceCaps())
    request = CopyRequest(direction, 64, 64 * MiB, True, "created")
    return engine.Target(7, info, request, Decision("kernel", "test"),
                         thresholds.ctas_for(direction),
                         thresholds.ctas_for(direction, both_ways=True))


def test_config_host_ctas_overrides_the_device_default(monkeypatch):
    target = _target("d2h", Thresholds(host_ctas={"h2d": 4, "d2h": 2}))
    monkeypatch.setattr(config, "host_ctas", None)
    assert target.ctas(None) == 2
    assert target.ctas(None, both_ways=True) == BOTH_WAYS_CTAS["d2h"]
    assert target.ctas(9) == 9
    monkeypatch.setattr(config, "host_ctas", 12)
    assert target.ctas(None) == 12


def test_host_ctas_from_the_environment(monkeypatch):
    from kvcopy.config import Config

    monkeypatch.setenv("KVCOPY_HOST_CTAS", "6")
    assert Config().host_ctas == 6
    monkeypatch.delenv("KVCOPY_HOST_CTAS")
    assert Config().host_ctas is None


def test_calibration_file_round_trip_keeps_ctas_and_measurements(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(tmp_path))
    info = device.DeviceInfo(0, "Fake GPU", (9, 0), 13000, DeviceCaps())
    saved = Thresholds(host_ctas={"h2d": 4, "d2h": 2})
    device.save_thresholds(info, saved, {"h2d/ctas": {"4": 0.91}})
    device.save_thresholds(info, saved, {"p2p 0>1/65536": {"kernel": 300.0}})
    data = json.loads(device.thresholds_path(info).read_text())
    assert set(data["measurements"]) == {"h2d/ctas", "p2p 0>1/65536"}
    loaded = device.load_thresholds(info)
    assert loaded.host_ctas == {"h2d": 4, "d2h": 2}
    assert loaded.both_ways_ctas == BOTH_WAYS_CTAS


def test_old_calibration_file_keeps_the_default_footprint(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(tmp_path))
    info = device.DeviceInfo(0, "Fake GPU", (9, 0), 13000, DeviceCaps())
    device.thresholds_path(info).parent.mkdir(parents=True, exist_ok=True)
    device.thresholds_path(info).write_text(json.dumps({"batch_min_bytes": {"h2d": 2 * MiB}}))
    loaded = device.load_thresholds(info)
    assert loaded.host_ctas == HOST_CTAS
    assert loaded.batch_min_bytes["h2d"] == 2 * MiB
    assert loaded.both_ways_batch_min_bytes == BOTH_WAYS_BATCH_MIN_BYTES


@pytest.mark.parametrize("both_ways", [64 << 10, float("inf")])
def test_calibration_file_round_trip_keeps_the_both_ways_crossover(tmp_path, monkeypatch,
                                                                    both_ways):
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(tmp_path))
    info = device.DeviceInfo(0, "Fake GPU", (9, 0), 13000, DeviceCaps())
    device.save_thresholds(info, Thresholds(both_ways_batch_min_bytes=both_ways), {})
    assert device.load_thresholds(info).both_ways_batch_min_bytes == both_ways


def test_crossover_is_where_dma_keeps_up_from_then_on():
    found = float("inf")
    steps = [(32 << 10, {"kernel": 70.0, "batch": 40.0}),   # engines CPU-bound: kernel
             (64 << 10, {"kernel": 70.0, "batch": 69.0}),   # within 2%: from here
             (128 << 10, {"kernel": 70.0, "batch": 90.0})]
    for block, gbps in steps:
        found = _next_threshold(found, block, gbps)
    assert found == 64 << 10
    # a larger size where the engines fall behind again starts over
    assert _next_threshold(found, 256 << 10, {"kernel": 70.0, "batch": 60.0}) == float("inf")
    # only one path measured: the engines where no kernel could run, never otherwise
    assert _next_threshold(float("inf"), 4096, {"batch": 1.0}) == 4096
    assert _next_threshold(float("inf"), 4096, {"kernel": 1.0}) == float("inf")
