"""Shared fixtures. tests/cpu/ runs anywhere; tests/gpu/ is marked `gpu` as a whole and
skips where no GPU is found; tests/engines/ holds the engines' own tests ported to
kvcopy's drop-ins (on the GPU, and on the CPU through kvcopy.testing.rows_on_host);
tests/helpers/ holds what they share."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

# The benchmark's package lives beside kvcopy (bench/kvcopy_bench), not in its wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

# JAX, where a GPU test imports it, must not take 75% of the GPU's memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# No calibration at first use behind the tests' backs: it would run on a thread of its
# own beside later tests and change what 'auto' decides midway through the suite.
# tests/*/test_first_use.py and tests/gpu/test_gpu_first_use.py turn it on.
os.environ.setdefault("KVCOPY_AUTO_CALIBRATE", "0")

try:
    import kvcopy.testing  # noqa: F401 - the built Cython layer, through the test seam
except ImportError as exc:
    pytest.exit(
        f"kvcopy cannot be imported here ({exc}). Its Cython modules are built at install: run "
        "`bash scripts/test.sh` (builds, installs and runs the tests in .venv-test), or "
        "`pip install -e .` and then pytest. From the repository root an unbuilt kvcopy/ "
        "folder shadows an installed one.",
        returncode=4,
    )

from helpers.gpu import gpu_reason  # noqa: E402 - after the check that kvcopy imports


def pytest_collection_modifyitems(config, items):
    """Every test under tests/gpu/ is marked `gpu`, and skips where no GPU is usable."""
    for item in items:
        if item.path.parent.name == "gpu":
            item.add_marker(pytest.mark.gpu)
    reason = gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def torch_cuda():
    import torch

    torch.cuda.init()
    return torch


@pytest.fixture(autouse=True)
def torch_current_stream_kept():
    """One failure stays one failure: a torch.cuda.graph whose capture fails on exit
    raises before it restores torch's current stream, which would leave the capture
    stream current for every later test (the ordering tests would fail after one
    failed capture). The stream current before the test is put back after it."""
    torch = sys.modules.get("torch")
    before = None
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        before = torch.cuda.current_stream()
    yield
    if before is not None and torch.cuda.current_stream(before.device) != before:
        torch.cuda.set_stream(before)


@pytest.fixture(autouse=True)
def garbage_collected_before_gpu_tests(request):
    """Earlier tests' garbage is collected before a GPU test, not in the middle of it.
    A torch.cuda.CUDAGraph left in a reference cycle (a frame held by a pytest.raises
    traceback) destroys its graph when collected, and that call, made while another
    graph is being captured in the default (global) mode, invalidates the capture.
    torch's graph context no longer collects on entry, so the collector could run
    inside a test's capture, at a point that depends on every test before it."""
    if "gpu" in request.keywords:
        gc.collect()
    yield


@pytest.fixture(autouse=True)
def settings_kept():
    """A test assigns kvcopy.config's settings as a user would; each one it changed is
    put back after it."""
    from kvcopy.config import config

    before = {name: getattr(config, name) for name in config.__dict__}
    yield
    for name, value in before.items():
        if getattr(config, name) != value:
            setattr(config, name, value)


@pytest.fixture
def plans(monkeypatch):
    """How many copy_rows calls were planned (the rest repeated)."""
    import kvcopy.rows

    count = [0]
    plan_rows = kvcopy.rows.plan_rows

    def counted(*args):
        count[0] += 1
        return plan_rows(*args)

    monkeypatch.setattr(kvcopy.rows, "plan_rows", counted)
    return count


@pytest.fixture
def seams():
    """Where a test enters kvcopy.testing's seams (fake_cuda, fake_runtime, ...): each
    is left when the test ends."""
    import contextlib

    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture(autouse=True)
def device_thresholds_kept():
    """A test that calibrates (or sets thresholds) leaves the process's thresholds as it
    found them: a calibration measured on a small budget may find, say, that the copy
    engines never keep up both ways, and every later test would be decided by that."""
    from kvcopy.testing import engine

    device = engine.device

    before = dict(device._thresholds)
    yield
    if device._thresholds != before:
        device._thresholds.clear()
        device._thresholds.update(before)
        device.generation += 1  # decisions remembered since are not reused
