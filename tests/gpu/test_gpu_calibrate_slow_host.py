"""Calibration on a host made slow on purpose: with the copy kernel held to one CTA
(config.host_ctas = 1, so that its SMs read host memory far below what the copy
engines move), kvcopy.calibrate() finds the copy engines faster from a smaller block
than the defaults assume, and 'auto' moves to them there, every byte right before and
after. Skipped without a GPU."""

from __future__ import annotations

import numpy as np

import kvcopy
from kvcopy.policy import Decision, Thresholds
from kvcopy.testing import engine, settings

# below the defaults' 1 MiB (the kernel's, uncalibrated), and too many copies to be replayed
BLOCK, COUNT = 256 << 10, 256


def test_a_kernel_held_to_one_cta_is_calibrated_away_from(torch_cuda, tmp_path, monkeypatch):
    torch = torch_cuda
    monkeypatch.setenv("KVCOPY_CACHE_DIR", str(tmp_path))
    host = torch.from_numpy(np.random.default_rng(0).integers(0, 256, BLOCK * COUNT, dtype=np.uint8))
    host = host.pin_memory()
    dev = torch.zeros(BLOCK * COUNT, dtype=torch.uint8, device="cuda")
    order = np.random.default_rng(1).permutation(COUNT).astype(np.uint64)
    src = np.uint64(host.data_ptr()) + order * np.uint64(BLOCK)
    dst = np.uint64(dev.data_ptr()) + np.arange(COUNT, dtype=np.uint64) * np.uint64(BLOCK)
    sizes = np.full(COUNT, BLOCK, dtype=np.uint64)
    expected = host.view(COUNT, BLOCK)[torch.from_numpy(order.astype(np.int64))].cuda()
    stream = torch.cuda.Stream()

    def copied() -> Decision:
        dev.zero_()
        torch.cuda.synchronize()
        kvcopy.copy_batch(src, dst, sizes, stream=stream)
        decision = kvcopy.last_decision()
        stream.synchronize()
        assert torch.equal(dev.view(COUNT, BLOCK), expected)
        return decision

    engine.device.set_thresholds(0, Thresholds())  # the built-in defaults
    with settings(host_ctas=1):
        before = copied()
        found = kvcopy.calibrate(total_bytes=16 << 20, repeats=3, save_result=False)
        after = copied()
    assert before.method == "kernel", before
    assert found.batch_min_bytes["h2d"] <= BLOCK, found.batch_min_bytes
    assert after.method == "batch", after
