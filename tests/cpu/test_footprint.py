"""The copy kernel's footprint over PCIe (CPU): the fewest CTAs calibrate keeps, the
CTAs each direction gets alone and beside the other, and calibration files."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

from kvcopy.testing import engine

decide, dispatch = engine.decide, engine.dispatch
device = engine.device
from kvcopy.config import config
from kvcopy.policy import (
    BOTH_WAYS_BATCH_MIN_BYTES,
    BOTH_WAYS_CTAS,
    HOST_CTAS,
    CopyRequest,
    Decision,
    DeviceCaps,
    Thresholds,
    choose_method,
    dma_crossover,
    fewest_ctas,
)

MiB = 1 << 20


def test_fewest_ctas_that_reach_the_floor():
    # fractions of the shape one GPU gave host-to-GPU at 4 KiB and 256 KiB
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


def _target(direction: str, thresholds: Thresholds) -> decide.Target:
    info = device.DeviceInfo(0, "Fake GPU", (9, 0), 13000, DeviceCaps())
    request = CopyRequest(direction, 64, 64 * MiB, True, "created")
    return decide.Target(
        7,
        info,
        request,
        Decision("kernel", "test"),
        thresholds.ctas_for(direction),
        thresholds.ctas_for(direction, both_ways=True),
    )


def test_config_host_ctas_overrides_the_device_default(monkeypatch):
    target = _target("d2h", Thresholds(host_ctas={"h2d": 4, "d2h": 2}))
    config.host_ctas = None
    assert target.ctas(None) == 2
    assert target.ctas(None, both_ways=True) == BOTH_WAYS_CTAS["d2h"]
    assert target.ctas(9) == 9
    config.host_ctas = 12
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
    device.save_thresholds(info, {"host_ctas": {"h2d": 4, "d2h": 2}}, {"h2d/ctas": {"4": 0.91}})
    device.save_thresholds(info, {}, {"p2p 0>1/65536": {"kernel": 300.0}})
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
def test_calibration_file_round_trip_keeps_the_both_ways_crossover(tmp_path, monkeypatch, both_ways):
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(tmp_path))
    info = device.DeviceInfo(0, "Fake GPU", (9, 0), 13000, DeviceCaps())
    device.save_thresholds(info, {"both_ways_batch_min_bytes": both_ways}, {})
    assert device.load_thresholds(info).both_ways_batch_min_bytes == both_ways


def test_crossover_is_where_dma_keeps_up_from_then_on():
    steps = {
        32 << 10: {"kernel": 70.0, "batch": 40.0},  # engines CPU-bound: kernel
        64 << 10: {"kernel": 70.0, "batch": 69.0},  # within 2%: from here
        128 << 10: {"kernel": 70.0, "batch": 90.0},
    }
    assert dma_crossover(steps) == 64 << 10
    # a larger size where the engines fall behind again starts over
    assert dma_crossover({**steps, 256 << 10: {"kernel": 70.0, "batch": 60.0}}) == float("inf")
    # only one path measured: the engines where no kernel could run, never otherwise
    assert dma_crossover({4096: {"batch": 1.0}}) == 4096
    assert dma_crossover({4096: {"kernel": 1.0}}) == float("inf")
    assert dma_crossover({}) == float("inf")


# GB/s host to GPU by block size, as two H100 hosts of one model measured them: one whose
# SMs read pinned host memory at about 33 GB/s, one whose SMs keep the link's rate.
SLOW_SM_READS = {
    4 << 10: {"kernel": 33.0, "batch": 21.0},
    16 << 10: {"kernel": 33.0, "batch": 49.0},
    64 << 10: {"kernel": 33.5, "batch": 54.0},
    256 << 10: {"kernel": 33.5, "batch": 55.0},
    1 << 20: {"kernel": 33.5, "batch": 55.0},
    4 << 20: {"kernel": 33.5, "batch": 55.0},
}
FAST_SM_READS = {
    4 << 10: {"kernel": 49.5, "batch": 21.0},
    16 << 10: {"kernel": 50.0, "batch": 45.0},
    64 << 10: {"kernel": 50.0, "batch": 47.0},
    256 << 10: {"kernel": 50.5, "batch": 48.5},
    1 << 20: {"kernel": 50.5, "batch": 52.0},
    4 << 20: {"kernel": 50.5, "batch": 54.0},
}


@pytest.mark.parametrize(
    "measured, crossover, kernel_blocks, engine_blocks",
    [
        (SLOW_SM_READS, 16 << 10, [4 << 10], [16 << 10, 64 << 10, 256 << 10]),
        (FAST_SM_READS, 1 << 20, [4 << 10, 16 << 10, 64 << 10, 256 << 10], [1 << 20]),
    ],
)
def test_a_host_whose_sms_read_slowly_gets_the_copy_engines_where_they_win(
    measured, crossover, kernel_blocks, engine_blocks
):
    found = dma_crossover(measured)
    assert found == crossover
    thresholds = Thresholds(batch_min_bytes={"h2d": found, "d2h": 1 << 20})
    for block, method in [(b, "kernel") for b in kernel_blocks] + [(b, "batch") for b in engine_blocks]:
        req = CopyRequest("h2d", 4096, 4096 * block, True, "created")
        assert choose_method(req, DeviceCaps(), thresholds).method == method, block


def _fake_both_ways(
    monkeypatch, batch_ms: dict, kernel_ms: float = 1.0, fail_at=None, engines_reached: bool = True
):
    """calibrate's both-ways measurement against a faked engine: 'kernel' runs the
    pair, 'auto' runs the engines only where the thresholds passed set the crossover
    to 0 (never, without ``engines_reached``: the crossover ignored); times per block
    from ``batch_ms``. Returns the calls seen (method, the crossover passed, the
    device's crossover meanwhile)."""
    calibrate = importlib.import_module("kvcopy.calibrate")  # the package re-exports the function

    seen = []

    def execute_both(store, load, stream, method, thresholds=None):
        current["block"] = int(store[2][0])  # (every copy of a scattered plan is one block)
        if not engines_reached:
            seen.append((method, None, None))
            return "kernel", "kernel"
        crossover = (thresholds or device.thresholds(0)).both_ways_batch_min_bytes
        seen.append((method, crossover, device.thresholds(0).both_ways_batch_min_bytes))
        if fail_at is not None and int(store[2][0]) == fail_at:
            raise RuntimeError("device lost")
        if method == "kernel":
            return "kernel", "kernel"
        return ("batch", "batch") if crossover == 0 else ("kernel", "kernel")

    def median_ms(run, stream, start, end, repeats):
        method = seen[-1][0]
        run()
        block = current["block"]
        return kernel_ms if method == "kernel" else batch_ms[block]

    current = {}
    monkeypatch.setattr(calibrate, "execute_both", execute_both)
    monkeypatch.setattr(calibrate, "_median_ms", median_ms)
    return seen


def test_both_ways_crossover_from_faked_timings_and_thresholds_restored(monkeypatch):
    calibrate = importlib.import_module("kvcopy.calibrate")  # the package re-exports the function

    before = Thresholds(both_ways_batch_min_bytes=128 << 10)
    device.set_thresholds(0, before)
    # engines slower than the kernel pair at 32 KiB, as fast or faster from 64 KiB
    seen = _fake_both_ways(monkeypatch, {32 << 10: 1.5, 64 << 10: 1.01, 128 << 10: 0.9, 256 << 10: 0.8})
    try:
        found, measured = calibrate._both_ways_threshold(
            0, 1 << 30, 2 << 30, 8 * MiB, 7, (1, 2), 3, np.random.default_rng(0)
        )
        assert found == 64 << 10
        assert set(measured) == {f"both_ways/{b}" for b in calibrate.BOTH_WAYS_BLOCKS}
        assert measured["both_ways/32768"]["batch"] < measured["both_ways/32768"]["kernel"]
        # the engines were measured with a crossover of 0 passed to each call, the pair
        # as 'kernel'; the device's own crossover never changed (other threads' copies)
        assert set(seen) == {("kernel", 0, 128 << 10), ("auto", 0, 128 << 10)}
        assert device.thresholds(0) == before
    finally:
        device.set_thresholds(0, Thresholds())


def test_both_ways_measurement_that_fails_leaves_the_thresholds_as_they_were(monkeypatch):
    calibrate = importlib.import_module("kvcopy.calibrate")  # the package re-exports the function

    before = Thresholds(both_ways_batch_min_bytes=128 << 10)
    device.set_thresholds(0, before)
    _fake_both_ways(monkeypatch, {b: 1.0 for b in calibrate.BOTH_WAYS_BLOCKS}, fail_at=64 << 10)
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            calibrate._both_ways_threshold(
                0, 1 << 30, 2 << 30, 8 * MiB, 7, (1, 2), 3, np.random.default_rng(0)
            )
        assert device.thresholds(0) == before
    finally:
        device.set_thresholds(0, Thresholds())


def test_both_ways_engines_unavailable_keep_the_kernel_pair(monkeypatch):
    calibrate = importlib.import_module("kvcopy.calibrate")  # the package re-exports the function

    device.set_thresholds(0, Thresholds())
    # 'auto' that does not reach the engines (here: the crossover ignored) is not timed
    _fake_both_ways(monkeypatch, {}, engines_reached=False)
    try:
        found, measured = calibrate._both_ways_threshold(
            0, 1 << 30, 2 << 30, 8 * MiB, 7, (1, 2), 3, np.random.default_rng(0)
        )
        assert found == float("inf")
        assert all(set(gbps) == {"kernel"} for gbps in measured.values())
    finally:
        device.set_thresholds(0, Thresholds())


def test_the_footprint_is_measured_on_the_register_copier():
    """calibrate's footprint sizes lie outside the bulk copier's window, so the CTAs it
    keeps (host_ctas) are those of the copier they are used for."""
    from kvcopy.calibrate import FOOTPRINT_BLOCKS
    from kvcopy.policy import BULK_MAX_BYTES, BULK_MIN_BYTES, kernel_variant

    for block in FOOTPRINT_BLOCKS:
        request = CopyRequest("d2h", 64, 64 * block, True, "created")
        assert kernel_variant(request, DeviceCaps(bulk_copy=True)) == "registers"
        assert not BULK_MIN_BYTES <= block <= BULK_MAX_BYTES
