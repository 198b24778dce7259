#!/usr/bin/env bash
# The whole pipeline on one node: producers (dflash-produce, one process per GPU) and consumers
# (dflash-consume, one process per GPU, one torch.distributed group), a log per process, clean stop.
#
#   ops/run_all.sh --model PATH --dataset PATH [--producers 0-4] [--consumers 5-7] [options]
#   ops/run_all.sh --producers cpu:1 --consumers cpu:1 --model ... --dataset ...     # CPU run
#
# Ctrl-C / SIGTERM: consumers get SIGTERM first (they finish the step and checkpoint), then producers.
# Exit status: 0 when every consumer finished; otherwise non-zero, naming the failed process and the
# tail of its log.
set -uo pipefail

die() { echo "run_all.sh: error: $*" >&2; exit 2; }
usage() {
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  cat <<'USAGE'
Options:
  --producers LIST      GPUs for producers: 0-4 | 0,1,2 | cpu:N            (default 0-4)
  --consumers LIST      GPUs for consumers: 5-7 | 5 | cpu:N                 (default 5-7)
  --model PATH|ID       target model (required)
  --dataset PATH|ID     chat dataset (required)
  --run NAME            run name (default: run-YYYYmmdd-HHMMSS)
  --run-dir DIR         logs, metrics, plots (default: runs/NAME)
  --spool DIR           spool directory (default: /dev/shm/dflash/NAME)
  --checkpoint URL      s3://bucket/prefix or a local folder (default: RUN_DIR/checkpoints)
  --max-steps N         consumers stop after N steps
  --epochs N            passes over the dataset, each in its own shuffled order (default 1; recorded
                        in the spool's run record: a later launch of the run must say the same)
  --producer-args "..." extra flags for dflash-produce
  --consumer-args "..." extra flags for dflash-consume
  --fresh-spool         discard the spool's contents first, even if it belongs to another run
  --keep-spool          leave the spool as the processes left it (default: a finished run's spool is
                        removed; a stopped or failed run's shards are discarded, the RAM they hold, and
                        its records kept for the next launch; a spool this launch created is removed)
  --restarts N          after a process dies, restart the whole pipeline from the latest checkpoint up
                        to N times (not after a user or input error: exit status 2) (the spool's leftovers are discarded: producers re-produce what the
                        checkpoint has not trained)

Re-running the same command after Ctrl-C or a crash continues the run from its latest checkpoint,
each sample trained once (docs/reliability.md). A spool belongs to one run: another run, or a second
live launch of this one, is refused with one line.
  -h, --help            this text
USAGE
}

producers="0-4"; consumers="5-7"; model=""; dataset=""; run=""; run_dir=""; spool=""; checkpoint=""
max_steps=""; epochs=1; producer_args=""; consumer_args=""; fresh_spool=0; keep_spool=0; restarts=0
while [ $# -gt 0 ]; do
  case "$1" in
    --producers|--consumers|--model|--dataset|--run|--run-dir|--spool|--checkpoint|--max-steps|--epochs|--producer-args|--consumer-args|--restarts)
      [ $# -ge 2 ] || die "$1 needs a value"
      v="$2"
      case "$1" in
        --producers) producers="$v";; --consumers) consumers="$v";; --model) model="$v";;
        --dataset) dataset="$v";; --run) run="$v";; --run-dir) run_dir="$v";; --spool) spool="$v";;
        --checkpoint) checkpoint="$v";; --max-steps) max_steps="$v";; --epochs) epochs="$v";;
        --producer-args) producer_args="$v";; --consumer-args) consumer_args="$v";;
        --restarts) restarts="$v";;
      esac
      shift 2;;
    --fresh-spool) fresh_spool=1; shift;;
    --keep-spool) keep_spool=1; shift;;
    -h|--help) usage; exit 0;;
    *) die "unknown argument '$1' (see --help)";;
  esac
done
[ -n "$model" ] || die "--model is required (a model folder or hub id)"
[ -n "$dataset" ] || die "--dataset is required (a dataset folder, file or hub id)"
[ -z "$max_steps" ] || [[ "$max_steps" =~ ^[1-9][0-9]*$ ]] || die "--max-steps must be a positive integer, got '$max_steps'"
[[ "$epochs" =~ ^[1-9][0-9]*$ ]] || die "--epochs must be a positive integer, got '$epochs'"
[[ "$restarts" =~ ^[0-9]+$ ]] || die "--restarts must be a non-negative integer, got '$restarts'"

# expand "0-4" / "0,2,3" / "cpu:N" into a list of device words ("0" ... or "cpu" ...)
expand() {
  local spec="$1" flag="$2" out=() part a b
  if [[ "$spec" =~ ^cpu:([1-9][0-9]*)$ ]]; then
    for ((i = 0; i < ${BASH_REMATCH[1]}; i++)); do out+=(cpu); done
  elif [[ "$spec" =~ ^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$ ]]; then
    IFS=, read -ra parts <<< "$spec"
    for part in "${parts[@]}"; do
      if [[ "$part" == *-* ]]; then
        a=${part%-*}; b=${part#*-}
        [ "$a" -le "$b" ] || die "$flag '$spec': range $part runs backwards"
        for ((i = a; i <= b; i++)); do out+=("$i"); done
      else out+=("$part"); fi
    done
  else
    die "$flag '$spec': expected GPU indices like 0-4 or 0,1,2, or cpu:N"
  fi
  echo "${out[@]}"
}
read -ra prod_devs <<< "$(expand "$producers" --producers)" || exit 2
read -ra cons_devs <<< "$(expand "$consumers" --consumers)" || exit 2
[ ${#prod_devs[@]} -gt 0 ] && [ ${#cons_devs[@]} -gt 0 ] || exit 2

# GPUs must exist before anything starts
need_gpu=0; max_gpu=-1
for d in "${prod_devs[@]}" "${cons_devs[@]}"; do
  if [ "$d" != cpu ]; then need_gpu=1; [ "$d" -gt "$max_gpu" ] && max_gpu=$d; fi
done
if [ "$need_gpu" = 1 ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  else
    n_gpus=0
  fi
  if [ "$n_gpus" -le "$max_gpu" ]; then
    die "GPU $max_gpu requested but this machine has $n_gpus GPU(s) (nvidia-smi -L); use e.g. --producers cpu:1 --consumers cpu:1 for a CPU run"
  fi
  for d in "${prod_devs[@]}"; do
    for c in "${cons_devs[@]}"; do [ "$d" = "$c" ] && die "GPU $d is listed for both producers and consumers"; done
  done
fi
command -v dflash-produce >/dev/null 2>&1 || die "dflash-produce not on PATH (activate the project's .venv: source .venv/bin/activate)"

# CPU processes share the cores: split them evenly (OpenMP spinning across oversubscribed threads makes a
# CPU run many times slower), unless the caller chose.
n_cpu_procs=0
for d in "${prod_devs[@]}" "${cons_devs[@]}"; do [ "$d" = cpu ] && n_cpu_procs=$((n_cpu_procs + 1)); done
if [ "$n_cpu_procs" -gt 0 ] && [ -z "${OMP_NUM_THREADS:-}" ]; then
  threads=$(( $(nproc) / n_cpu_procs )); [ "$threads" -ge 1 ] || threads=1
  export OMP_NUM_THREADS=$threads
fi

# One compile cache for every process and every launch on this machine: a consumer restarted by
# --restarts (or a plain re-run) finds its compiled kernels and reaches its first step in seconds, not a
# minute (docs/training.md). Point TORCHINDUCTOR_CACHE_DIR at a persistent disk to keep it across reboots.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash-spool/inductor}

run=${run:-run-$(date +%Y%m%d-%H%M%S)}
run_dir=${run_dir:-runs/$run}
spool=${spool:-/dev/shm/dflash/$run}
checkpoint=${checkpoint:-$run_dir/checkpoints}
# One launch per spool at a time: an flock on $spool/lock-launch, held by this script and inherited by
# every command it starts, so it stays held while any of them lives and the kernel drops it when the last
# one dies (no stale lock after kill -9). Taken before anything is written. This script waits for its
# commands before it exits; the log pipes (start) close it, so the lock is free once this script has
# exited and the same command run again at once is not refused.
mkdir -p "$spool" && chmod 700 "$spool" || die "cannot create spool $spool"
exec 9>>"$spool/lock-launch" || die "cannot open $spool/lock-launch"
if ! flock -n 9; then
  # the holder writes its line right after it took the lock: a launch started at the same moment waits
  # for it (2 s at most) to say whose launch it is
  for _ in $(seq 20); do holder=$(head -n 1 "$spool/lock-launch" 2>/dev/null); [ -n "$holder" ] && break; sleep 0.1; done
  holder=${holder:-a launch that is starting up}
  die "spool $spool is in use by a live launch of $holder; this is run '$run': stop that launch first, or use another --spool"
fi
echo "run '$run' (ops/run_all.sh pid $$, since $(date +%H:%M:%S))" > "$spool/lock-launch"
# The spool belongs to one run; what a previous launch left in its flow is discarded (producers
# re-produce what the checkpoint has not trained): see docs/reliability.md, "Re-running a run".
spool_was_new=1; [ -e "$spool/state/run.json" ] && spool_was_new=0
prep_args=(); [ "$fresh_spool" = 1 ] && prep_args+=(--fresh)
dflash-spool prepare "$spool" --run "$run" "${prep_args[@]}" || exit $?
mkdir -p "$run_dir/logs" "$run_dir/metrics" || die "cannot create run directory $run_dir"
cat > "$run_dir/run.json" <<JSON
{"run": "$run", "spool": "$spool", "checkpoint": "$checkpoint", "model": "$model", "dataset": "$dataset",
 "producers": "$producers", "consumers": "$consumers", "started": $(date +%s)}
JSON

declare -A name_of=()
pids=(); consumer_pids=()
start() {  # start NAME LOG CMD...: background process with its own log (appended across restarts)
  # A command's own one-line reports ("dflash-produce: 237 trainable rows; dropped ...", "...: done",
  # "...: error: ...") also reach this terminal; everything else is in the log. The tee ignores Ctrl-C
  # and SIGTERM (it ends when the command closes its output): killed with the process group, it would
  # take the log lines of a consumer's clean stop with it. It ends when every process holding the
  # command's output has: the command, and also its children that are still going away after run_all.sh
  # exits (a worker killed with its parent, multiprocessing's resource tracker). So it closes the launch
  # lock (fd 9) first: holding it, it would refuse the user's re-run of the same command for that while.
  local name="$1" logf="$2"; shift 2
  "$@" > >(exec 9>&-; trap '' INT TERM; tee -a "$logf" | grep --line-buffered -E '^dflash-(produce|consume): ' >&2) 2>&1 &
  local pid=$!
  name_of[$pid]=$name; pids+=("$pid")
  echo "$name $pid" >> "$run_dir/pids"
  echo "started $name (pid $pid), log $logf"
}

launch_all() {
  pids=(); consumer_pids=(); name_of=()
  : > "$run_dir/pids"
  # producers: one dflash-produce, which spawns one worker per listed device
  # shellcheck disable=SC2086
  start producer "$run_dir/logs/producer.log" dflash-produce --gpus "$producers" --model "$model" \
    --dataset "$dataset" --spool "$spool" --run "$run" --run-dir "$run_dir" --checkpoint "$checkpoint" --epochs "$epochs" $producer_args
  # consumers: one torch.distributed group over env://
  local port world rank dev extra
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  world=${#cons_devs[@]}
  for rank in "${!cons_devs[@]}"; do
    dev=${cons_devs[$rank]}
    extra=()
    [ -n "$max_steps" ] && extra+=(--max-steps "$max_steps")
    # shellcheck disable=SC2086
    RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      start "consumer-$rank" "$run_dir/logs/consumer-$rank.log" dflash-consume --gpu "$dev" --spool "$spool" \
      --target "$model" --run "$run" --run-dir "$run_dir" --checkpoint "$checkpoint" "${extra[@]}" $consumer_args
    consumer_pids+=("${pids[-1]}")
  done
}

stop_all() {  # consumers first (they checkpoint on SIGTERM), then producers. $1: seconds of grace.
  # A group that lost a member cannot checkpoint (its collectives hang), so failures use a short grace.
  local grace=${1:-120} waited=0 alive p
  for p in "${consumer_pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  while [ $waited -lt $((grace * 2)) ]; do
    alive=0
    for p in "${consumer_pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.5; waited=$((waited + 1))
  done
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  sleep 1
  for p in "${pids[@]}"; do pkill -KILL -P "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
  wait 2>/dev/null
}
leave_spool() {  # $1: finished | stopped | failed. What a launch leaves in /dev/shm (docs/reliability.md).
  [ "$keep_spool" = 1 ] && { echo "kept the spool $spool (--keep-spool)"; return; }
  # only what is a spool and nothing else (a --spool pointed at a folder of the user's own is kept)
  local others
  others=$(ls -A "$spool" 2>/dev/null | grep -vE '^(tmp|ready|claimed|acked|quarantine|state|eval|lock-.*)$' || true)
  if ! [ -d "$spool/state" ] || [ -n "$others" ]; then
    echo "run_all.sh: kept $spool: it holds more than a spool (${others//$'\n'/ })" >&2; return
  fi
  if [ "$1" = finished ] || [ "$spool_was_new" = 1 ]; then  # nothing in it a later launch reads
    rm -rf "$spool" && echo "removed the spool $spool (the run $1; --keep-spool keeps it)"
  else  # the shards go (the next launch discards them anyway); the run's records stay for its next launch
    dflash-spool free "$spool" || echo "run_all.sh: the spool $spool keeps its shards (dflash-spool gc removes abandoned spools)" >&2
  fi
}
trap 'echo "run_all.sh: stopping (signal)"; stop_all; leave_spool stopped; exit 130' INT TERM

attempt=0
while :; do
  launch_all
  status=0; failed=""
  remaining=${#consumer_pids[@]}
  while [ "$remaining" -gt 0 ]; do
    wait -n -p done_pid; rc=$?
    [ -n "${done_pid:-}" ] || continue
    name=${name_of[$done_pid]:-}
    [ -n "$name" ] || continue
    if [ "$rc" -eq 130 ]; then
      # interrupted (Ctrl-C reaches every process of the group): a clean stop, not a failure — also when
      # the child's exit is seen before this shell's own INT trap has run
      echo "run_all.sh: stopping ($name was interrupted)"; stop_all; leave_spool stopped; exit 130
    fi
    if [ "$rc" -ne 0 ]; then
      status=$rc; failed=$name
      echo "run_all.sh: $name (pid $done_pid) failed with exit code $rc; last lines of its log:" >&2
      tail -n 20 "$run_dir/logs/$name.log" >&2
      break
    fi
    echo "$name finished"
    [[ "$name" == consumer-* ]] && remaining=$((remaining - 1))
  done
  if [ -n "$failed" ]; then stop_all 3; else stop_all 120; fi
  if [ -n "$failed" ] && [ "$status" -eq 2 ] && [ "$attempt" -lt "$restarts" ]; then
    echo "run_all.sh: not restarting: $failed reported a user or input error (exit 2), see above" >&2
  elif [ -n "$failed" ] && [ "$attempt" -lt "$restarts" ]; then
    attempt=$((attempt + 1))
    echo "run_all.sh: restart $attempt of $restarts from the latest checkpoint" >&2
    dflash-spool prepare "$spool" --run "$run" >&2 || exit $?
    continue
  fi
  break
done
echo "run dir: $run_dir  (logs in $run_dir/logs, metrics in $run_dir/metrics, status: dflash-status $run_dir)"
if [ -n "$failed" ]; then
  leave_spool failed
  echo "run_all.sh: FAILED: $failed" >&2
  exit "$status"
fi
leave_spool finished
python3 -c "import dflash.tools.plots as p; p.write_plots('$run_dir')" 2>/dev/null || true
exit 0
