#!/usr/bin/env bash
# The test command: creates .venv if missing, installs torch (CPU pin) only when none is importable,
# installs the project with its test extra, runs ruff and pytest. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=ops/setup_venv.sh
source ops/setup_venv.sh
ruff check .
exec python -m pytest -q "$@"
