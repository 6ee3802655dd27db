#!/usr/bin/env bash
# The one GPU check everyone runs on the H200 (device tool): build, the whole
# test suite with the GPU tests, the CPU-overhead probe and the quick benchmark.
# Results land in $OUT (default ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export KVCOPY_CACHE_DIR=${KVCOPY_CACHE_DIR:-/tmp/kvcopy-cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# $OUT brings back at most 8 files: the build log stays behind unless the build fails
if ! python3 -m pip install --no-build-isolation --no-deps -e . >/tmp/kvcopy-build.log 2>&1; then
  cp /tmp/kvcopy-build.log "$OUT/build.log"; tail -40 "$OUT/build.log"; exit 1
fi
python3 -m pytest tests -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | grep -v "^\.*$\|PASSED" | tail -60
status=${PIPESTATUS[0]}
(cd scripts && python3 cpu_overhead.py && python3 cpu_breakdown.py) 2>&1 | tee "$OUT/cpu_overhead.txt"
[ -n "${PROFILE:-}" ] && python3 scripts/profile_calls.py > "$OUT/profile.txt" 2>&1
if [ "${BENCH:-quick}" != "none" ]; then
  python3 -m kvcopy.bench ${BENCH_ARGS:---quick} --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -${BENCH_TAIL:-80}
fi
exit "$status"
