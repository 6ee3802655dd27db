#!/usr/bin/env bash
# Installs kvcopy and what its tests need into a fresh virtual environment, then
# runs the whole test suite (GPU tests skip where no GPU is found). On the way it
# builds kvcopy's wheel once with CUDA_HOME pointing at the system's CUDA toolkit
# (whose headers may be older or newer than the cuda-bindings the build uses),
# checks that the wheel ships no generated C++, type-checks the package with
# mypy, lints it (ruff, cython-lint, clang-format), and puts cuda-bindings 12.9
# and the lowest declared cuda-core in side folders for the tests that prove
# kvcopy runs under them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVCOPY_TEST_VENV:-.venv-test}
PY=${PYTHON:-python3}
"$PY" -m venv "$VENV"
VPY="$PWD/$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip

# torch (CPU tests use it): a CPU build only. A plain `torch` from PyPI is a CUDA
# build of several GB, so: a local +cpu wheel where the machine has one, else
# PyTorch's CPU index, else none (the torch tests skip).
if ! "$VPY" -c "import torch" 2>/dev/null; then
  "$VPY" -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
    || "$VPY" -m pip install -q --timeout 20 --retries 0 \
         --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" 2>/dev/null \
    || echo "scripts/test.sh: no CPU build of torch could be installed; its tests will skip"
fi

# Build the wheel once, against the system toolkit's CUDA_HOME where there is one.
WHEELS=$(mktemp -d)
if [ -f /usr/local/cuda/include/cuda.h ]; then export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}; fi
"$VPY" -m pip wheel -q --no-deps -w "$WHEELS" .
WHEEL=$(ls "$WHEELS"/kvcopy_cuda-*.whl)
"$VPY" - "$WHEEL" <<'PYCHECK'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
generated = [n for n in names if n.endswith((".cpp", ".c"))]
assert not generated, f"the wheel ships generated sources: {generated}"
assert any(n.endswith("copy_kernel.cuh") for n in names), "the wheel lacks the kernel source"
print(f"wheel: {sys.argv[1].rsplit('/', 1)[-1]}, {len(names)} files, no generated C++")
PYCHECK
"$VPY" -m pip install -q --force-reinstall --no-deps "$WHEEL"
"$VPY" -m pip install -q "$WHEEL[test,cu13,typecheck,lint]"
# NIXL (kvcopy.nixl's two-process tests): its wheel alone, torch and numpy being here
"$VPY" -m pip install -q --no-deps "nixl-cu13==1.5.1" 2>/dev/null \
  || echo "scripts/test.sh: no NIXL wheel for this Python here; its two-process tests will skip"

# Type-check the package (its source; the .pyi stubs describe the Cython modules), and
# lint: ruff (lint and format) for the Python, cython-lint for the Cython, clang-format
# for the C and CUDA sources (settings in pyproject.toml and .clang-format).
"$VPY" -m mypy -p kvcopy
"$VPY" -m ruff check -q .
"$VPY" -m ruff format --check -q .
PATH="$(dirname "$VPY"):$PATH" "$(dirname "$VPY")/cython-lint" kvcopy/_cuda/*.pyx kvcopy/_cuda/*.pxd
"$(dirname "$VPY")/clang-format" --dry-run --Werror include/kvcopy/*.h include/kvcopy/*.cuh \
  kvcopy/_cuda/*.h

# cuda-bindings 12.9 and the lowest declared cuda-core, each in a side folder.
CB12="$PWD/$VENV/cuda-bindings-12.9"
"$VPY" -m pip install -q --target "$CB12" "cuda-bindings==12.9.*" >/dev/null
export KVCOPY_CB12_PATH="$CB12"
CORE_MIN=$(sed -n 's/.*"cuda-core>=\([0-9.]*\)".*/\1/p' pyproject.toml)
CCMIN="$PWD/$VENV/cuda-core-$CORE_MIN"
"$VPY" -m pip install -q --no-deps --target "$CCMIN" "cuda-core==$CORE_MIN" >/dev/null
export KVCOPY_CUDA_CORE_MIN_PATH="$CCMIN"

cd tests  # import the installed kvcopy, not the source folder
"$VPY" -m pytest -q -p no:cacheprovider "$@" .
