# Sourced by ops/test.sh and ops/demo.sh: create and activate .venv, install what is missing.
# torch is pinned to the CPU wheel on this machine's disk only when no torch is importable, so an
# existing CUDA build is kept and a fresh machine never downloads a multi-GB CUDA build.
pip_quiet() {
  # pip warns about every unreachable local index path it is configured with; keep real errors only.
  python -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU)"
  pip_quiet install -q "torch==2.13.0"
fi
stamp=.venv/.dflash-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing dflash-spool and its test extra"
  pip_quiet install -q -e ".[test]"
  touch "$stamp"
fi
