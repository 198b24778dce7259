#!/usr/bin/env bash
# The `fp8` part of device_suite.sh, as written there, on this CPU box at the benches' smoke sizes
# (FP8_SMALL=1), so that a GPU call cannot fail on a trivial bug: the part's own lines are cut out of
# device_suite.sh (the GPU machine's set-up above them needs .whl and nvidia-smi) and run with python3 from
# this checkout's .venv. Usage: bash ops/bench/fp8_cpu_check.sh [OUT]  (default /tmp/fp8-cpu-check)
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${1:-/tmp/fp8-cpu-check} FP8_SMALL=1 FP8_TESTS=${FP8_TESTS:-1} PYTHONUNBUFFERED=1
# a shared CPU box runs the smoke sizes slower than a GPU host runs the real ones: generous bounds
export FP8_PROD_LIMIT=${FP8_PROD_LIMIT:-900} FP8_FEED_LIMIT=${FP8_FEED_LIMIT:-600}
mkdir -p "$OUT" .venv/shim && ln -sf "$PWD/.venv/bin/python" .venv/shim/python3 && export PATH="$PWD/.venv/shim:$PATH"
part=$(sed -n '/^if \[\[ "\$parts" == \*" fp8 "\* \]\]; then/,/^fi$/p' ops/bench/device_suite.sh)
[[ -n "$part" ]] || { echo "fp8_cpu_check: no fp8 part in ops/bench/device_suite.sh"; exit 1; }
parts=" fp8 " bash -c "parts=' fp8 '; $part"
echo "fp8_cpu_check: done; results in $OUT"; ls "$OUT" "$OUT/fp8prod"
