"""Calibration at first use on a GPU (config.auto_calibrate): a process's first copy on
a GPU its host has not measured starts the calibration in the background, the copy
is right meanwhile, the file appears and is used; CUDA graphs captured on another
thread while it measures are neither broken nor joined."""

from __future__ import annotations

from helpers.child import run_child

FIRST_USE_CHILD = r"""
import glob, json, os, threading, time
import numpy as np, torch, kvcopy
from kvcopy.testing import engine
engine.first_use.AUTO_CALIBRATION_QUIET_S = 0.0
torch.cuda.init()
host = torch.from_numpy(np.arange(1 << 20, dtype=np.uint8)).pin_memory()
dev = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
s = torch.cuda.Stream()
mapping = torch.tensor([[i, 255 - i] for i in range(256)])
kvcopy.swap_blocks(host.view(256, 4096), dev.view(256, 4096), mapping, stream=s)
s.synchronize()
ok = bool(torch.equal(dev.view(256, 4096).flip(0).cpu(), host.view(256, 4096)))
workers = [t for t in threading.enumerate() if t.name.startswith("kvcopy-calibration-")]
captures = 0
if os.environ.get("CAPTURE_BESIDE") == "1":
    # graphs captured (global mode, torch's default) on this thread while it measures
    x = torch.ones(1 << 16, device="cuda")
    while workers and workers[0].is_alive():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 2 + 1
        g.replay()
        torch.cuda.synchronize()
        assert bool((y == 3).all())
        captures += 1
for w in workers:
    w.join(300)
files = glob.glob(os.path.join(os.environ["KVCOPY_CACHE_DIR"], "calibration-*.json"))
data = json.load(open(files[0])) if len(files) == 1 else {}
now = engine.device.thresholds(0)
print(json.dumps({"ok": ok, "started": len(workers), "files": len(files), "captures": captures,
                  "host": data.get("host"), "h2d_file": data.get("batch_min_bytes", {}).get("h2d", "none"),
                  "h2d_now": now.batch_min_bytes["h2d"]}))
"""


def _first_use(tmp_path, capture_beside: bool) -> dict:
    env = {
        "KVCOPY_CACHE_DIR": str(tmp_path),
        "KVCOPY_AUTO_CALIBRATE": "1",
        "CAPTURE_BESIDE": "1" if capture_beside else "0",
        "PYTHONWARNINGS": "error::RuntimeWarning",
    }
    return run_child(FIRST_USE_CHILD, env=env, timeout=600)


def test_a_first_copy_starts_the_calibration_and_its_file_is_used(tmp_path):
    found = _first_use(tmp_path, capture_beside=False)
    assert found["ok"] and found["started"] == 1 and found["files"] == 1
    assert found["host"]["gpu"] and found["host"]["device"]  # kept under this GPU's key
    h2d = float("inf") if found["h2d_file"] is None else found["h2d_file"]
    assert found["h2d_now"] == h2d  # the process uses what it measured
    again = _first_use(tmp_path, capture_beside=False)  # the next process finds the file
    assert again["ok"] and again["started"] == 0 and again["files"] == 1


def test_graphs_captured_beside_the_calibration_are_not_broken(tmp_path):
    found = _first_use(tmp_path, capture_beside=True)
    assert found["ok"] and found["files"] == 1 and found["captures"] >= 1
