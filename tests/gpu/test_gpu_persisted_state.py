"""Files kvcopy keeps, on a GPU: a cubin damaged on disk is rebuilt and the kernel runs;
processes calibrating at once leave one valid file holding every process's results."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.child import CHILD_CWD, run_child


COPY_CHILD = r"""
import glob, json, os, numpy as np, torch, kvcopy
torch.cuda.init()
host = torch.from_numpy(np.random.default_rng(3).integers(0, 256, 64 * 4096,
                                                         dtype=np.uint8)).pin_memory()
dev = torch.zeros(64 * 4096, dtype=torch.uint8, device="cuda")
src = np.array([host.data_ptr() + i * 4096 for i in range(64)], dtype=np.uint64)
dst = np.array([dev.data_ptr() + ((i * 7) % 64) * 4096 for i in range(64)], dtype=np.uint64)
s = torch.cuda.Stream()
used = kvcopy.copy_batch(src, dst, np.full(64, 4096, np.uint64), stream=s, method="kernel")
s.synchronize()
want = host.numpy().reshape(64, 4096)
got = dev.cpu().numpy().reshape(64, 4096)
ok = all((got[(i * 7) % 64] == want[i]).all() for i in range(64))
cubins = glob.glob(os.path.join(os.environ["KVCOPY_CACHE_DIR"], "copy_kernel-*.cubin"))
print(json.dumps({"used": used, "ok": bool(ok), "cubins": cubins}))
"""


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_a_cubin_damaged_on_disk_is_rebuilt_and_the_kernel_runs(tmp_path, damage):
    env = {"KVCOPY_CACHE_DIR": str(tmp_path)}
    first = run_child(COPY_CHILD, env=env)
    assert first["used"] == "kernel" and first["ok"] and len(first["cubins"]) == 1
    path = first["cubins"][0]
    data = open(path, "rb").read()
    damaged = {"truncated": data[: len(data) // 3], "empty": b"", "garbage": os.urandom(len(data))}[damage]
    with open(path, "wb") as out:
        out.write(damaged)
    second = run_child(COPY_CHILD, env=env)
    assert second["used"] == "kernel" and second["ok"]
    assert open(path, "rb").read() == data  # rebuilt whole: the next process reads it


CALIBRATE_CHILD = r"""
import json, os, sys, warnings
import kvcopy
from kvcopy.testing import cuda
driver = cuda.driver
warnings.simplefilter("error")   # a torn or refused file would warn
driver.init()
device = int(sys.argv[1]) % driver.device_count()
kvcopy.calibrate(device, total_bytes=8 << 20, repeats=1)
print(json.dumps({"device": device, "pid": os.getpid()}))
"""


def test_two_processes_calibrating_at_once_leave_a_valid_file_with_both_results(tmp_path):
    env = dict(os.environ, KVCOPY_CACHE_DIR=str(tmp_path))
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CALIBRATE_CHILD, str(k)],
            cwd=CHILD_CWD,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(2)
    ]
    results = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    files = sorted(tmp_path.glob("calibration-*.json"))
    assert files and not list(tmp_path.glob("*.tmp"))
    saved_by = set()
    for path in files:
        data = json.loads(path.read_text())  # whole, strict JSON
        assert data["schema"] == 3 and "Infinity" not in path.read_text()
        saved_by |= {(s["pid"], s["ordinal"]) for s in data["saves"]}
        assert any(key.startswith("h2d/") for key in data["measurements"])
        assert any(key.startswith("d2h/") for key in data["measurements"])
    assert {(r["pid"], r["device"]) for r in results} <= saved_by
    check = run_child(LOAD_CHILD, env={"KVCOPY_CACHE_DIR": str(tmp_path)})
    assert check["loaded"] and check["h2d"] > 0


LOAD_CHILD = r"""
import json, warnings
from kvcopy.testing import engine
device = engine.device
from kvcopy.testing import cuda
driver = cuda.driver
warnings.simplefilter("error")
driver.init()
driver.push_context(driver.primary_context(0))
found = device.load_thresholds(device.device_info(0))
print(json.dumps({"loaded": found is not None,
                  "h2d": found.batch_min_bytes["h2d"] if found else 0}))
"""
