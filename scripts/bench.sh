#!/usr/bin/env bash
# Installs kvcopy and runs its main job: the quick benchmark on this machine's GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "kvcopy: no NVIDIA GPU found on this machine; the benchmark needs one." >&2
  exit 2
fi
VENV=${KVCOPY_BENCH_VENV:-.venv-bench}
python3 -m venv --system-site-packages "$VENV"   # reuse an installed CUDA torch if there is one
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q torch
"$VENV/bin/python" -m pip install -q ".[bench,cu13]"
# (bench/run.py imports kvcopy as installed: its directory, not the checkout, is first on
# the import path)
"$VENV/bin/python" bench/run.py --quick --out bench-out "$@"
