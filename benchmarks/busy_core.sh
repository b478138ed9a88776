#!/usr/bin/env bash
# paged-kv demo's own "wall time", idle and with one core kept busy by another process,
# interleaved with the same for an older checkout when BASE=/path/to/checkout is given:
#   bash benchmarks/busy_core.sh            # this tree
#   BASE=/tmp/base bash benchmarks/busy_core.sh
set -euo pipefail
repeats=${REPEATS:-3}
wall() { "$@" 2>/dev/null | awk '/wall time/ {print $3}'; }
run() {
  local line="now $(wall python -m paged_kv.cli demo)"
  if [ -n "${BASE:-}" ]; then
    line="base $(cd "$BASE" && PYTHONPATH="$BASE" wall python -m paged_kv.cli demo) | $line"
  fi
  echo "$1: $line"
}
for _ in $(seq "$repeats"); do run idle; done
python -c "
import time
start = time.time()
while time.time() - start < 900:
    pass" &
busy=$!
trap 'kill $busy 2>/dev/null' EXIT
sleep 1
for _ in $(seq "$repeats"); do run "one core busy"; done
