"""kvcopy runs on the lowest cuda-core it declares (CPU).

scripts/test.sh installs that version into a separate folder and names it in
KVCOPY_CUDA_CORE_MIN_PATH; a child interpreter puts it first on sys.path and
reads a DLPack producer's layout through cuda.core's StridedMemoryView, the
part of cuda.core that kvcopy's own code uses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

CHILD = r"""
import json, numpy as np, cuda.core
from kvcopy.interop.tensors import block_layout
arr = np.arange(64, dtype=np.float32).reshape(4, 16)

class Producer:   # DLPack only, so that kvcopy must ask cuda.core
    def __dlpack__(self, **kw): return arr.__dlpack__(**kw)
    def __dlpack_device__(self): return arr.__dlpack_device__()

lay = block_layout(Producer(), "src")
print(json.dumps({"version": cuda.core.__version__, "ptr_ok": lay.ptr == arr.ctypes.data,
                  "blocks": lay.num_blocks, "block_bytes": lay.block_bytes}))
"""


def declared_minimum() -> str:
    match = re.search(r'"cuda-core>=([0-9.]+)"', PYPROJECT.read_text())
    assert match, "pyproject.toml declares no cuda-core minimum"
    return match.group(1)


@pytest.mark.skipif(
    not os.environ.get("KVCOPY_CUDA_CORE_MIN_PATH"),
    reason="KVCOPY_CUDA_CORE_MIN_PATH not set (scripts/test.sh sets it)",
)
def test_lowest_declared_cuda_core_reads_dlpack_producers():
    env = dict(os.environ, PYTHONPATH=os.environ["KVCOPY_CUDA_CORE_MIN_PATH"])
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__)
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["version"].startswith(declared_minimum()), res
    assert res["ptr_ok"] and res["blocks"] == 4 and res["block_bytes"] == 64


def test_current_cuda_core_reads_dlpack_producers():
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=os.path.dirname(__file__)
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["ptr_ok"] and res["blocks"] == 4 and res["block_bytes"] == 64
