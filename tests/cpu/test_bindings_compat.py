"""One build of kvcopy._cuda imports and runs under cuda-bindings 12.9 as well as 13.x.

scripts/test.sh installs cuda-bindings 12.9 into a separate folder and names it
in KVCOPY_CB12_PATH; this test puts that folder first on sys.path in a child
interpreter, so the module built against 13.x headers meets 12.9 bindings.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = r"""
import cuda.bindings, kvcopy
from kvcopy.testing import cuda as layer
classify, describe, dma, d, launch = (layer.classify, layer.describe, layer.dma, layer.driver,
                                      layer.launch)
testing = layer.testing
print("bindings", cuda.bindings.__version__)
try:
    d.init()
    print("driver", d.driver_version(), "batch_abi", dma.batch_abi())
except kvcopy.NoDriverError as exc:
    print("nodriver", exc)
"""


@pytest.mark.skipif(
    not os.environ.get("KVCOPY_CB12_PATH"), reason="KVCOPY_CB12_PATH not set (scripts/test.sh sets it)"
)
def test_driver_module_imports_under_cuda_bindings_12_9():
    env = dict(os.environ, PYTHONPATH=os.environ["KVCOPY_CB12_PATH"])
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__)
    )
    assert out.returncode == 0, out.stderr
    assert "bindings 12.9." in out.stdout
    assert ("nodriver no CUDA driver was found" in out.stdout) or ("driver " in out.stdout)


def test_driver_module_under_current_bindings():
    import cuda.bindings

    # the imports themselves check every cimported signature
    from kvcopy.testing import cuda as layer

    modules = (layer.classify, layer.describe, layer.dma, layer.driver, layer.launch, layer.testing)
    assert all(m is not None for m in modules)

    assert int(cuda.bindings.__version__.split(".")[0]) in (12, 13)
