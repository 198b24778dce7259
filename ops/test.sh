#!/usr/bin/env bash
# The test command: creates .venv if missing, installs torch (CPU pin) only when none is importable,
# installs the project with its test extra, runs ruff and pytest. Extra args go to pytest.
# The suite runs on every core (pytest-xdist, one test file per worker at a time, so a file's module
# fixtures are built once): most tests spawn CLI processes that spend their time importing torch and
# waiting on files, so two workers on the 2-core CI box finish in ~0.8x the serial time.
# DFLASH_TEST_WORKERS=0 runs it serially.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=ops/setup_venv.sh
source ops/setup_venv.sh
ruff check .
exec python -m pytest -q -n "${DFLASH_TEST_WORKERS:-auto}" --maxprocesses 4 --dist loadfile "$@"
