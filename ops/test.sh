#!/usr/bin/env bash
# The test command: creates .venv if missing, installs torch (CPU pin) only when none is importable,
# installs the project with its test extra, runs ruff (lint, and the formatter's check) and pytest. Extra
# args go to pytest.
#   bash ops/test.sh          the whole suite (CI; before a merge): every guarantee, ~10 min on 2 cores
#   bash ops/test.sh --unit   the unit tier (while editing): the tests that start no child process
#                             (-m "not pipeline"), <= 2 min on 2 cores. tests/conftest.py marks a test
#                             pipeline when it is slow or uses a process fixture (the moto server, a
#                             producer run), and fails an unmarked test that starts a process, so the
#                             tier cannot slowly fill with process start-ups.
# The suite runs on one more worker than the box has cores (pytest-xdist, at most 4): one test file per
# worker at a time, so a file's module fixtures are built once, handed out in conftest's order (file_order:
# the longest files first; xdist's own reorder would put the one-test chaos file last, a lone long pole). Most
# tests spawn CLI processes that spend their time importing torch and waiting on files and children: two
# workers on the 2-core CI box used 1.16 cores (a profiled run: 1,528 CPU-s over 1,437 s), so a third
# worker fills the waits.
# DFLASH_TEST_WORKERS=0 runs it serially. The slowest tests are listed at the end (--durations), so a slow
# run says where its time went.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=ops/setup_venv.sh
source ops/setup_venv.sh
tier=(); what="the whole suite"
if [[ "${1:-}" == "--unit" ]]; then
  shift; tier=(-m "not pipeline"); what="the unit tier (no child processes)"
fi
echo "[test] ruff check . && ruff format --check ."
ruff check .
ruff format --check .
workers=${DFLASH_TEST_WORKERS:-$(( $(nproc) + 1 ))}
echo "[test] pytest, $what, on $workers worker(s): the slowest tests are listed at the end"
exec python -m pytest -q -n "$workers" --maxprocesses 4 --dist loadfile --no-loadscope-reorder --durations=15 --durations-min=10 "${tier[@]}" "$@"
