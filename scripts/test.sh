#!/usr/bin/env bash
# Installs kvcopy and what its tests need into a fresh virtual environment, then
# runs the whole test suite (GPU tests skip where no GPU is found). Also shows
# that the built module imports under cuda-bindings 12.9 as well as 13.x.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVCOPY_TEST_VENV:-.venv-test}
PY=${PYTHON:-python3}
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# CPU torch first: an unpinned torch would pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q "torch==2.13.0" || "$VENV/bin/python" -m pip install -q torch
"$VENV/bin/python" -m pip install -q ".[test,nvrtc]"
# The same built module under the other bindings major, in a separate folder.
CB12="$PWD/$VENV/cuda-bindings-12.9"
"$VENV/bin/python" -m pip install -q --target "$CB12" "cuda-bindings==12.9.*" >/dev/null
export KVCOPY_CB12_PATH="$CB12"
cd tests  # import the installed kvcopy, not the source folder
"../$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" .
