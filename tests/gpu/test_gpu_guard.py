"""The guard on 'auto' on a GPU (config.guard): a host made slow on purpose (the copy
kernel held to one CTA, so that it reads host memory far below what the device's
calibration says) is left for the copy engines after a few sampled batches, with
the reason in last_decision(), every byte right throughout; and tried again after its
hold. Skipped without a GPU."""

from __future__ import annotations

import dataclasses
import time

import pytest
from helpers.gpu import shuffled_upload

import kvcopy
from kvcopy.policy.defaults import GUARD_HOLD_S, GUARD_SAMPLE_EVERY_S, GUARD_SLOW_SAMPLES
from kvcopy.testing import engine, settings

BLOCK, COUNT = 64 << 10, 256  # 16 MiB a batch: sampled, and too many copies to be replayed


@pytest.fixture
def calibrated():
    """Device 0 calibrated as a host whose kernel reads host memory at 50 GB/s and
    whose copy engines reach 54 at 64 KiB blocks; put back after the test."""
    import torch

    # the device's facts are first read under its context, as a copy reads them: a
    # test run alone would otherwise load the copy kernel with no context current
    torch.zeros(1, device="cuda")
    before = engine.device.thresholds(0)
    rates = {"h2d": {BLOCK: {"kernel": 50.0, "batch": 54.0}}}
    engine.device.set_thresholds(0, dataclasses.replace(before, rates=rates))
    engine.guard.forget()
    yield
    engine.device.set_thresholds(0, before)
    engine.guard.forget()


def test_a_kernel_held_to_one_cta_is_left_for_the_copy_engines_and_tried_again(calibrated, monkeypatch):
    import torch

    upload = shuffled_upload(BLOCK, COUNT)
    src, dst, sizes = upload.src, upload.dst, upload.sizes
    stream = torch.cuda.Stream()
    clock = [time.monotonic()]
    monkeypatch.setattr(engine.guard, "_clock", lambda: clock[0])  # (the hold passes at once)
    decisions = []
    with settings(guard=True, host_ctas=1):
        for _ in range(GUARD_SLOW_SAMPLES + 2):
            upload.dev.zero_()
            torch.cuda.synchronize()
            assert kvcopy.copy_batch(src, dst, sizes, stream=stream) in ("kernel", "batch")
            decisions.append(kvcopy.last_decision())
            stream.synchronize()
            assert upload.landed()
            clock[0] += 2 * GUARD_SAMPLE_EVERY_S
        methods = [d.method for d in decisions]
        assert methods[:GUARD_SLOW_SAMPLES] == ["kernel"] * GUARD_SLOW_SAMPLES, methods
        moved = decisions[GUARD_SLOW_SAMPLES]
        assert moved.method == "batch" and moved.reason.startswith("guard: kernel moved"), moved
        clock[0] += GUARD_HOLD_S
        kvcopy.copy_batch(src, dst, sizes, stream=stream)
        assert kvcopy.last_decision().method == "kernel"  # tried again after the hold
        stream.synchronize()
