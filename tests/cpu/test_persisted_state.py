"""Files kvcopy keeps on disk survive crashes, concurrent writers and hostile content
(CPU): calibration files and the kernel cache."""

from __future__ import annotations

import json
import multiprocessing
import os
import types
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvcopy import testing
from kvcopy.testing import engine

calibration_file, device, kernels, persist = (
    engine.calibration_file,
    engine.device,
    engine.kernels,
    engine.persist,
)
from kvcopy.policy import DeviceCaps, Thresholds

MiB = 1 << 20
INFO = device.DeviceInfo(0, "Fake GPU", (9, 0), 13000, DeviceCaps())


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(tmp_path))
    calibration_file._bad.clear()
    return tmp_path


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


GOOD = {"batch_min_bytes": {"h2d": 2 * MiB, "d2h": None}, "host_ctas": {"h2d": 6, "d2h": 3}}


def test_a_saved_file_loads_back_with_never_as_null(cache):
    device.save_thresholds(
        INFO,
        {"batch_min_bytes": {"h2d": 2 * MiB, "d2h": float("inf")}, "host_ctas": {"h2d": 6}},
        {"h2d/65536": {"kernel": 50.0}},
    )
    text = device.thresholds_path(INFO).read_text()
    assert "Infinity" not in text and json.loads(text)["batch_min_bytes"]["d2h"] is None
    loaded = device.load_thresholds(INFO)
    assert loaded.batch_min_bytes["h2d"] == 2 * MiB
    assert loaded.batch_min_bytes["d2h"] == float("inf")
    assert loaded.host_ctas == {"h2d": 6, "d2h": Thresholds().host_ctas["d2h"]}


def test_a_file_written_by_an_older_kvcopy_still_loads(cache):
    _write(
        device.thresholds_path(INFO),
        '{"batch_min_bytes": {"h2d": 1048576, "d2h": Infinity}, '
        '"both_ways_batch_min_bytes": Infinity, "measurements": {}}',
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = device.load_thresholds(INFO)
    assert loaded.batch_min_bytes["d2h"] == float("inf")
    assert loaded.both_ways_batch_min_bytes == float("inf")


BAD_FILES = [
    ("", "not valid JSON"),
    ('{"batch_min_bytes": {"h2d": 1e999}}', "overflows"),
    ('{"batch_min_bytes": {"h2d": ' + "9" * 400 + "}}", "400 characters"),
    ('{"batch_min_bytes": {"h2d": NaN}}', "NaN"),
    ("[" * 100000 + "]" * 100000, "nests deeper"),
    ('{"batch_min_bytes": {"h2d": -3}}', "outside"),
    ('{"batch_min_bytes": {"h2d": "1 MiB"}}', "not a number"),
    ('{"batch_min_bytes": {}, "host_ctas": {"h2d": 0}}', "CTA count"),
    ('{"batch_min_bytes": {}, "host_ctas": {"h2d": -3}}', "CTA count"),
    ('{"batch_min_bytes": {}, "host_ctas": {"h2d": 2.5}}', "CTA count"),
    ('{"batch_min_bytes": {}, "host_ctas": {"h2d": true}}', "CTA count"),
    ('{"batch_min_bytes": {}, "host_ctas": {"mixed": 64}}', "unknown key 'mixed'"),
    ('{"batch_min_bytes": {"sideways": 1}}', "unknown key 'sideways'"),
    ('{"batch_min_bytes": {}, "surprise": 1}', "unknown entries"),
    ('{"batch_min_bytes": {}, "device": "Other GPU"}', "Other GPU"),
    ('{"batch_min_bytes": {}, "schema": 99}', "schema 99"),
    ('{"host_ctas": {"h2d": 4}}', "no batch_min_bytes"),
    ("[1, 2]", "not an object"),
    ('{"batch_min_bytes": {}, "measurements": {"x": {"kernel": "fast"}}}', "finite numbers"),
]


@pytest.mark.parametrize("text, fault", BAD_FILES)
def test_a_bad_file_warns_once_names_the_fault_and_the_defaults_serve(cache, text, fault):
    path = device.thresholds_path(INFO)
    _write(path, text)
    with pytest.warns(RuntimeWarning, match="calibration file") as caught:
        assert device.load_thresholds(INFO) is None
    assert str(path) in str(caught[0].message) and fault in str(caught[0].message)
    with warnings.catch_warnings():  # remembered as bad: no second warning, no re-read
        warnings.simplefilter("error")
        assert device.load_thresholds(INFO) is None
    # the device's thresholds fall back to the defaults: a copy never fails over a file
    device._thresholds.pop(0, None)
    assert (device.load_thresholds(INFO) or Thresholds()) == Thresholds()


def test_a_bad_file_rewritten_is_read_again(cache):
    path = device.thresholds_path(INFO)
    _write(path, "{torn")
    with pytest.warns(RuntimeWarning):
        assert device.load_thresholds(INFO) is None
    _write(path, json.dumps(GOOD) + " ")
    assert device.load_thresholds(INFO).host_ctas["h2d"] == 6


def test_a_save_over_a_bad_file_replaces_it(cache):
    path = device.thresholds_path(INFO)
    _write(path, '{"batch_min_bytes": {"h2d": 1e999}}')
    with pytest.warns(RuntimeWarning, match="being replaced"):
        device.save_thresholds(INFO, {"host_ctas": {"h2d": 5}}, {})
    assert device.load_thresholds(INFO).host_ctas["h2d"] == 5


def test_a_save_merges_only_what_it_measured(cache):
    device.save_thresholds(INFO, {"batch_min_bytes": {"p2p 0>1": 4 * MiB}}, {"p2p 0>1/1": {"k": 1.0}})
    device.save_thresholds(INFO, {"batch_min_bytes": {"h2d": 2 * MiB}}, {"h2d/1": {"k": 2.0}})
    data = json.loads(device.thresholds_path(INFO).read_text())
    assert data["batch_min_bytes"] == {"p2p 0>1": 4 * MiB, "h2d": 2 * MiB}
    assert set(data["measurements"]) == {"p2p 0>1/1", "h2d/1"}
    assert [save["measured"] for save in data["saves"]] == [["p2p 0>1/1"], ["h2d/1"]]


def test_a_writer_killed_mid_write_leaves_the_old_file(cache, monkeypatch):
    device.save_thresholds(INFO, {"host_ctas": {"h2d": 6}}, {})
    path = device.thresholds_path(INFO)
    before = path.read_bytes()

    def crash(*args):
        raise KeyboardInterrupt  # as a kill between writing and renaming

    monkeypatch.setattr(persist.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        device.save_thresholds(INFO, {"host_ctas": {"h2d": 7}}, {})
    assert path.read_bytes() == before
    assert sorted(p.name for p in cache.iterdir()) == sorted([path.name, path.name + ".lock"])


def test_a_folder_that_cannot_be_written_raises_oserror_and_leaves_nothing(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(blocker))
    with pytest.raises(OSError):
        device.save_thresholds(INFO, {"host_ctas": {"h2d": 6}}, {})
    assert device.load_thresholds(INFO) is None
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def _saver(folder: str, worker: int, rounds: int) -> None:
    os.environ["KVCOPY_CACHE_DIR"] = folder
    for r in range(rounds):
        device.save_thresholds(
            INFO, {"host_ctas": {"h2d": 1 + worker}}, {f"worker{worker}/round{r}": {"kernel": float(r)}}
        )


def _reader(folder: str, seconds: float, queue) -> None:
    import time

    os.environ["KVCOPY_CACHE_DIR"] = folder
    path = device.thresholds_path(INFO)
    reads = torn = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        reads += 1
        try:
            calibration_file.validate(persist.parse_json(data, allow_infinity=True), INFO.host_key())
        except persist.BadFile:
            torn += 1
    queue.put((reads, torn))


def test_concurrent_saves_lose_no_measurement_and_no_reader_sees_a_torn_file(cache):
    workers, rounds = 6, 40
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    reader = ctx.Process(target=_reader, args=(str(cache), 4.0, queue))
    reader.start()
    savers = [ctx.Process(target=_saver, args=(str(cache), w, rounds)) for w in range(workers)]
    for p in savers:
        p.start()
    for p in savers:
        p.join(60)
        assert p.exitcode == 0
    reader.join(60)
    reads, torn = queue.get(timeout=10)
    assert reads > 0 and torn == 0
    data = json.loads(device.thresholds_path(INFO).read_text())
    assert set(data["measurements"]) == {f"worker{w}/round{r}" for w in range(workers) for r in range(rounds)}
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.dictionaries(st.sampled_from(sorted(calibration_file._TOP_KEYS) + ["x"]), json_values, max_size=6)
)
def test_any_json_either_loads_as_valid_thresholds_or_is_refused(cache, body):
    calibration_file._bad.clear()
    path = device.thresholds_path(INFO)
    _write(path, json.dumps(body))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = device.load_thresholds(INFO)
    if loaded is None:
        return
    for value in loaded.batch_min_bytes.values():
        assert value == float("inf") or 0 <= value <= calibration_file.MAX_THRESHOLD_BYTES
    for table in (loaded.host_ctas, loaded.both_ways_ctas):
        assert set(table) <= {"h2d", "d2h"}
        assert all(type(v) is int and 1 <= v <= calibration_file.MAX_CTAS for v in table.values())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200))
def test_any_bytes_either_parse_or_raise_badfile(data):
    try:
        persist.parse_json(data)
    except persist.BadFile:
        pass


# --- the kernel cache --------------------------------------------------------------------


@pytest.fixture
def compiles(seams) -> list:
    """NVRTC replaced by a stand-in producing a distinct cubin per arch (the cache's
    logic is under test here; tests/cpu/test_kernel_build.py compiles for real), and the
    cache key's NVRTC version fixed so that no NVRTC is needed."""
    made: list = []

    def compile_cubin(arch: int) -> bytes:
        made.append(arch)
        return b"\x7fELF" + f"cubin for sm_{arch}".encode() * 64

    seams.enter_context(testing.fake_compiler(compile_cubin, (13, 0)))
    return made


@pytest.mark.parametrize("damage", ["empty", "truncated", "flipped", "foreign", "old-format"])
def test_a_damaged_cubin_is_rebuilt(cache, compiles, damage):
    good = kernels.cached_cubin(90)
    path = kernels.cubin_path(90)
    data = path.read_bytes()
    damaged = {
        "empty": b"",
        "truncated": data[: len(data) // 2],
        "flipped": data[:-1] + bytes([data[-1] ^ 1]),
        "foreign": b"\x7fELF" + b"\0" * 64,
        "old-format": good,
    }[damage]
    path.write_bytes(damaged)
    assert kernels.cached_cubin(90) == good
    assert compiles == [90, 90]  # found damaged, compiled again
    assert path.read_bytes() == data  # the cache holds an intact copy again
    assert kernels.cached_cubin(90) == good and compiles == [90, 90]


def test_a_cubin_the_driver_refuses_is_compiled_again(cache, compiles, seams):
    from kvcopy.errors import CudaError

    kernels.cached_cubin(90)
    loads = []

    def module_load(cubin):
        loads.append(cubin)
        if len(loads) == 1:
            raise CudaError(200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid")
        return 1234

    seams.enter_context(testing.fake_cuda(types.SimpleNamespace(module_load=module_load), ("launch",)))
    assert kernels._load_module(90) == 1234
    assert compiles == [90, 90] and len(loads) == 2


@pytest.mark.parametrize("where", ["file", "directory-at-cubin", "read-only"])
def test_a_cache_that_cannot_be_written_compiles_in_memory_and_says_so_once(
    tmp_path, monkeypatch, compiles, where
):
    if where == "file":
        folder = tmp_path / "cache"
        folder.write_text("a file, not a folder")
    else:
        folder = tmp_path / "cache"
        folder.mkdir()
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(folder))
    if where == "directory-at-cubin":
        kernels.cubin_path(90).mkdir()
    if where == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        folder.chmod(0o500)
    monkeypatch.setattr(kernels, "_warned_cache", set())
    with pytest.warns(RuntimeWarning, match="compiled in memory"):
        first = kernels.cached_cubin(90)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.cached_cubin(90) == first
    assert first[:4] == b"\x7fELF"
    if folder.is_dir():
        assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_saves_past_the_loaders_cap_on_measurements_keep_the_thresholds(cache):
    cap = calibration_file.MAX_MEASUREMENTS
    device.save_thresholds(
        INFO, {"batch_min_bytes": {"h2d": 2 * MiB}}, {f"h2d/{k}": {"kernel": float(k)} for k in range(cap)}
    )
    device.save_thresholds(INFO, {"host_ctas": {"d2h": 5}}, {f"d2h/{k}": {"kernel": 1.0} for k in range(10)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a refused file would warn)
        loaded = device.load_thresholds(INFO)
    assert loaded.batch_min_bytes["h2d"] == 2 * MiB and loaded.host_ctas["d2h"] == 5
    kept = json.loads(device.thresholds_path(INFO).read_text())["measurements"]
    assert len(kept) == cap and "d2h/9" in kept and "h2d/0" not in kept  # the newest kept
