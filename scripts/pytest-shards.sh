#!/usr/bin/env bash
# Runs the tests pytest collects from its arguments in N processes at once, so that the
# whole GPU suite fits one device call (serially it runs about 12 minutes on an H100
# host; in 7 processes about 4).
#
#   bash scripts/pytest-shards.sh N LOG [pytest arguments...]
#
# Run it from the repository root (node ids are relative to it). The collected tests
# are dealt out one at a time (round-robin over their ids, so that a long parametrized
# file is shared out), each process with a KVCOPY_CACHE_DIR of its own. Tests marked `alone` (they read device-wide state, such as the GPU's free
# memory, which the other processes change) run after the others, by themselves.
# MARK (optional) is a marker expression for both, e.g. MARK=gpu. Prints each
# process's summary line; LOG gets every process's log, one after another. Exits 0
# only where every process passed (no tests collected counts as passed).
set -uo pipefail
if [ $# -lt 2 ] || ! [ "$1" -ge 1 ] 2>/dev/null; then
  echo "usage: bash scripts/pytest-shards.sh N LOG [pytest arguments...]" >&2
  exit 2
fi
shards=$1 log=$2
shift 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
others="${MARK:+($MARK) and }not alone"
python3 -m pytest "$@" -m "$others" --collect-only -q -p no:cacheprovider 2>"$work/collect.err" \
  | grep "::" >"$work/ids"
if [ ! -s "$work/ids" ] && [ -s "$work/collect.err" ]; then
  cat "$work/collect.err" >&2
fi

run() {  # name, then pytest arguments
  local name=$1
  shift
  KVCOPY_CACHE_DIR="${KVCOPY_CACHE_DIR:-/tmp/kvcopy-cache}-$name" \
    python3 -m pytest "$@" -q -p no:cacheprovider >"$work/log.$name" 2>&1
  local rc=$?
  [ "$rc" = 5 ] && rc=0  # (nothing collected)
  echo "$rc" >"$work/rc.$name"
}

for ((k = 0; k < shards; k++)); do
  awk -v k="$k" -v n="$shards" 'NR % n == k' "$work/ids" >"$work/ids.$k"
  [ -s "$work/ids.$k" ] || continue
  mapfile -t ids <"$work/ids.$k"
  run "$k" "${ids[@]}" &
done
wait
run alone "$@" -m "${MARK:+($MARK) and }alone"

status=0
: >"$log"
for rc in "$work"/rc.*; do
  name=${rc##*/rc.}
  echo "shard $name rc $(cat "$rc"): $(grep -v "^$" "$work/log.$name" | tail -1)"
  { echo "=== shard $name"; cat "$work/log.$name"; } >>"$log"
  [ "$(cat "$rc")" = 0 ] || status=1
done
exit "$status"
