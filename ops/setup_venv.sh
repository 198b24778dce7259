# Sourced by ops/test.sh and ops/demo.sh: create and activate .venv, install what is missing.
# torch is pinned to the CPU wheel on this machine's disk only when no torch is importable, so an
# existing CUDA build is kept and a fresh machine never downloads a multi-GB CUDA build.
# Every step says what it does, and a long one says it is still at it every 8 s: a first set-up takes a
# few minutes and must not look like a hang.
setup_say() { echo "[setup $(( SECONDS - setup_t0 ))s] $*"; }

setup_run() {  # setup_run WHAT CMD...: run CMD, show pip's "Collecting/Installing" lines, tick while silent
  local what="$1"; shift
  local log; log=$(mktemp)
  "$@" > "$log" 2>&1 &
  local pid=$! shown=0 quiet=0 n
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    n=$(wc -l < "$log")
    local lines=""
    if [ "$n" -gt "$shown" ]; then
      lines=$(sed -n "$((shown + 1)),${n}p" "$log" | grep -E '^(Collecting|Installing collected|Successfully installed|ERROR)' \
        | sed 's/^/  /' | cut -c1-160 || true)
      shown=$n
    fi
    # the tick counts seconds without a SHOWN line: pip's other lines (filtered out) are silence too
    if [ -n "$lines" ]; then
      echo "$lines"; quiet=0
    else
      quiet=$((quiet + 1))
      if [ "$quiet" -ge 8 ]; then setup_say "$what: still working"; quiet=0; fi
    fi
  done
  local rc=0
  wait "$pid" || rc=$?
  if [ "$rc" -ne 0 ]; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" | tail -n 30 >&2
    echo "[setup] $what failed (exit $rc); the lines above say why" >&2
  fi
  rm -f "$log"
  return "$rc"
}

setup_t0=$SECONDS
if [ ! -x .venv/bin/python ]; then
  setup_say "creating .venv (python3 -m venv)"
  python3 -m venv .venv || return 1 2>/dev/null || exit 1
fi
# shellcheck disable=SC1091
source .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" 2>/dev/null; then
  setup_say "installing torch==2.13.0 (the CPU wheel from this machine's disk)"
  setup_run "installing torch" python -m pip install --progress-bar off "torch==2.13.0" || return 1 2>/dev/null || exit 1
fi
stamp=.venv/.dflash-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  setup_say "installing dflash-spool and what it needs (transformers, datasets, zarr, boto3, wandb; tests: pytest, moto, hypothesis, ruff): 1-3 min on a fresh machine"
  setup_run "installing dflash-spool" python -m pip install --progress-bar off -e ".[test]" || return 1 2>/dev/null || exit 1
  touch "$stamp"
fi
setup_say "ready"
