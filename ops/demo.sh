#!/usr/bin/env bash
# The README's first command: set up .venv if needed, then run the whole pipeline on the CPU on the
# embedded default (tiny target, bundled chat data, local S3 server). Extra args go to dflash-demo.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=ops/setup_venv.sh
source ops/setup_venv.sh
exec python -m dflash.tools.demo.cli "$@"
