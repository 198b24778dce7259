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
# The suite runs on every core (pytest-xdist): one test file per worker at a time, so a file's module
# fixtures are built once, handed out in conftest's order (files with slow tests first; xdist's own
# reorder would put the one-test chaos file last, a lone long pole). Most tests spawn CLI processes
# that spend their time importing torch and waiting on files: two workers on the 2-core CI box take
# ~0.75x the serial time (403 s vs 558 s measured).
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
echo "[test] pytest, $what, on ${DFLASH_TEST_WORKERS:-every core} worker(s): the slowest tests are listed at the end"
exec python -m pytest -q -n "${DFLASH_TEST_WORKERS:-auto}" --maxprocesses 4 --dist loadfile --no-loadscope-reorder --durations=15 --durations-min=10 "${tier[@]}" "$@"
