"""Calibration on a host made slow on purpose: with the copy kernel held to one CTA
(config.host_ctas = 1, so that its SMs read host memory far below what the copy
engines move), kvcopy.calibrate() finds the copy engines faster from a smaller block
than the defaults assume, and 'auto' moves to them there, every byte right before and
after. Skipped without a GPU."""

from __future__ import annotations

from helpers.gpu import shuffled_upload

import kvcopy
from kvcopy.policy import Decision, Thresholds
from kvcopy.testing import engine, settings

# below the defaults' 1 MiB (the kernel's, uncalibrated), and too many copies to be replayed
BLOCK, COUNT = 256 << 10, 256


def test_a_kernel_held_to_one_cta_is_calibrated_away_from(torch_cuda, tmp_path, monkeypatch):
    torch = torch_cuda
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(tmp_path))
    upload = shuffled_upload(BLOCK, COUNT)
    stream = torch.cuda.Stream()

    def copied() -> Decision:
        upload.dev.zero_()
        torch.cuda.synchronize()
        kvcopy.copy_batch(upload.src, upload.dst, upload.sizes, stream=stream)
        decision = kvcopy.last_decision()
        stream.synchronize()
        assert upload.landed()
        return decision

    engine.device.set_thresholds(0, Thresholds())  # the built-in defaults
    with settings(host_ctas=1):
        before = copied()
        found = kvcopy.calibrate(total_bytes=16 << 20, repeats=3, save_result=False)
        after = copied()
    assert before.method == "kernel", before
    assert found.batch_min_bytes["h2d"] <= BLOCK, found.batch_min_bytes
    assert after.method == "batch", after
