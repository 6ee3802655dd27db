#!/usr/bin/env bash
# The one GPU check everyone runs on the H200 (device tool): build, the whole
# test suite with the GPU tests, the CPU-overhead probes and the benchmark.
# Results land in $OUT (default ./gpu-out); the device tool brings back at most
# 8 files, so logs are few: pytest.log (GPU name first), patterns.txt (other
# projects' call patterns, bench/patterns.py), cpu_overhead.txt,
# [profile.txt], bench-<mode>/results.{json,csv,png} (with a GPU-to-GPU section
# where two GPUs are present).
#   BENCH=quick (default) | full | quick+full | none
#   BENCH_FLAGS   extra benchmark arguments, e.g. --calibrate
#   PROFILE=1     also profile the calls (cProfile)
#   PYTEST_ARGS   extra pytest arguments
#   TESTS         what pytest runs (default: tests), e.g. half the GPU files where the
#                 whole suite outlasts one device call
#   SHARDS=N      run them in N pytest processes at once (scripts/pytest-shards.sh; 7 on
#                 a 16-core host takes the whole suite from about 12 minutes to 4)
#   ONE_GPU_TOO=1 on a machine of several GPUs, also run the suite with GPU 0 alone
#                 (pytest-1gpu.log)
#   PROBES="..."  parts of experiments/serving_probe.py to run after the benchmark, e.g.
#                 "both_ways_beside d2d_descriptors latency" (serving-probe.txt)
#   SCRIPTS="..." experiments/ to run before the benchmark, each into <name>.txt,
#                 e.g. "bulk_sweep.py"
# Wheels in .whl/ (ignored by git; the device tool's carry) are installed first, for
# what the GPU machine lacks: NIXL's (nixl-cu13 for its Python) runs
# tests/gpu/test_gpu_nixl.py, which skips without it.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export KVCOPY_CACHE_DIR=${KVCOPY_CACHE_DIR:-/tmp/kvcopy-cache}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -m pip install --no-build-isolation --no-deps -e . >/tmp/kvcopy-build.log 2>&1; then
  cp /tmp/kvcopy-build.log "$OUT/build.log"; tail -40 "$OUT/build.log"; exit 1
fi
if [ "${SHARDS:-1}" -gt 1 ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  bash scripts/pytest-shards.sh "$SHARDS" "$OUT/pytest.log" ${TESTS:-tests} ${PYTEST_ARGS:-}
  status=$?
else
  {
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -m pytest ${TESTS:-tests} -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1
  } | tee "$OUT/pytest.log" | grep -v "^\.*$\|PASSED" | tail -60
  status=${PIPESTATUS[0]}
fi
if [ -n "${ONE_GPU_TOO:-}" ]; then
  CUDA_VISIBLE_DEVICES=0 python3 -m pytest ${TESTS:-tests} -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/pytest-1gpu.log" | tail -3
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
python3 bench/patterns.py 2>&1 | tee "$OUT/patterns.txt"
(python3 bench/cpu_overhead.py 1024 4096 && cd experiments && python3 cpu_breakdown.py && python3 cpu_breakdown.py small) 2>&1 | tee "$OUT/cpu_overhead.txt"
[ -n "${PROFILE:-}" ] && python3 experiments/profile_calls.py > "$OUT/profile.txt" 2>&1
for script in ${SCRIPTS:-}; do
  python3 "experiments/$script" 2>&1 | grep -v Warning | tee "$OUT/${script%.py}.txt"
done
for mode in $(echo "${BENCH:-quick}" | tr '+' ' '); do
  [ "$mode" = none ] && continue
  flag=$([ "$mode" = quick ] && echo --quick)
  python3 bench/run.py $flag ${BENCH_FLAGS:-} --out "$OUT/bench-$mode" 2>/dev/null | tail -${BENCH_TAIL:-40}
done
if [ -n "${PROBES:-}" ]; then
  python3 experiments/serving_probe.py $PROBES 2>&1 | grep -v Warning | tee "$OUT/serving-probe.txt"
fi
exit "$status"
