"""Code run in a fresh interpreter, for GPU tests whose faults could poison the test
process's CUDA context."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# The children run from here, so that `import kvcopy` finds the installed package and
# not the repository root's unbuilt kvcopy/ folder.
CHILD_CWD = os.path.dirname(os.path.abspath(__file__))


def run_child(code: str, env: dict | None = None, timeout: int = 120) -> dict:
    """Run ``code`` in a fresh interpreter and return the JSON of its last line of output;
    fails the test with the child's stderr where it exits non-zero."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=CHILD_CWD,
        env=dict(os.environ, **(env or {})),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
