#!/usr/bin/env bash
# Everything that needs the GPU machine, in few calls (device time is scarce). Parts (any order, several per
# call; default all):
#   tests      GPU tests (flex fwd+bwd vs SDPA, three consumers compiling on one GPU, producer on CUDA)
#   ref        the reference consumer step (needs .bench/ref: a copy of ../shared/bench)
#   feed32     the data path alone at 32B-class width (claim, decode, pack, pinned copy; no step)
#   feedsweep  feed32 with --decode-threads 2, 4, 8 (FEED_THREADS), each in a process of its own under
#              FEED_LIMIT s (~60 s each with its pre-fill): context tok/s and each data thread's ms per step
#              by stage; not in `all`
#   trainer32  the real Trainer over a real spool, 32B-class drafter, default precision (amp) and bf16
#   ckpt32     trainer32 with background checkpoints every 60 steps (stall per save; warm first step)
#   warm32     a fresh process on the warm compile cache: time to first step
#   trainer8   the real Trainer, 8B-class drafter, default flags
#   trainer32x3  the full-streams acceptance: the real Trainer, 32B-class, default flags, three runs (seeds 0-2:
#              the same data, a fresh Trainer each, warm compile cache after the first), 150 measured steps
#              each; the first run saves one background checkpoint (its last step's)
#   learning   a learnable spool trained 500 steps with each of LEARN_PRECISIONS ("mixed amp") x LEARN_SEEDS ("0"),
#              the loss curves in $OUT/learning.json
#   ab         the 32B-class real loop, A/B (ops/bench/consumer_ab.py): the reference step (at the preset's
#              shape: REF_SHAPE), one spool filled
#              once, then each variant of dflash-consume flags in a fresh process on a hard-linked copy of
#              it, sharing one inductor cache; 10 warm-up + 80 measured steps each, no saves. AB_VARIANTS
#              ("NAME=FLAGS;NAME=FLAGS", default below), AB_BUDGET (s, default 470), AB_STEPS (80),
#              AB_WARMUP (10), AB_MIN_VARIANT (s, 45: start no variant with less left) and AB_PRESET (32b;
#              another preset writes $OUT/ab-<preset>/) set it; run it ALONE
#              in a call (~8 min: setup 20 s, reference ~60, prefill ~35, the first variant ~110 with a cold
#              compile, each later one ~50-70; results in $OUT/ab/ab.jsonl as each finishes)
#   optim      the optimizer step alone at the drafter's width (ops/bench/optim_bench.py; OPTIM_PRESET, 32b;
#              OPTIM_VARIANTS; OPTIM_LIMIT s, 120): ms per step, bytes per parameter, TB/s per precision;
#              not in `all`; ao8bit needs torchao in .whl (wheels.sh torchao)
#   gpusel     the GPU tests of the loss, optimizer and attention kernels only (liger loss kernel vs the torch row pass, compiled
#              MasterAdamW, flex vs SDPA incl. sliding; liger-kernel in .whl)
#   producer   the producer's runbook, in this order (~8 min on one H200 from cold compile caches; to
#              stay well inside one call's 10 minutes, run `prod8 prod32 hybrid` and `pipeline1 plan` as two
#              calls on the same warm machine):
#     prod8      8B-shaped target (15 batches: the last shard's encode is a fixed tail, 1.23x at 5 batches
#                and 1.33x at 15, same machine): bare eager full forward vs the producer eager, compiled (per layer,
#                dynamic shapes: the default), compiled with static shapes, and its own forward alone (~2 min)
#     prod32     32B-class target (64 layers): bare eager full forward vs the compiled producer (~1.5 min)
#     hybrid     hybrid-27B-shaped target at full depth (64 layers, 54 GB; HYBRID_LAYERS=8 for the slice): fla
#                and the reference kernels (bf16) checked against an fp32 forward on an 8-layer slice
#                (HYBRID_CHECK_LAYERS; ops/bench/kernel_check.py), then the producer as shipped (fla), on the
#                reference kernels, and eager; first-shard times; HYBRID_PROFILE=FIRST:COUNT writes kernel
#                tables of those batches of each variant and of its own forward (needs fla-core in .whl)
#     pipeline1  pipeline_bench.py: 8B-shaped, one producer + one consumer sharing GPU 0 (~3 min: the
#                consumer's cold compile, the 16 GB target saved and loaded twice)
#     pipelineh  pipeline_bench.py: the hybrid-27B slice (8 layers), one producer + one consumer sharing GPU 0
#     plan       dflash-plan --bench over the suite's own producer_bench, pipeline_bench and consumer_bench
#                JSONs and ab/ab.jsonl (8-GPU node split per shape with both rates measured; seconds)
#   prodscope  8B-shaped: compiled per layer vs the whole truncated trunk (not in `producer`; ~1.5 min)
#   fp8        FP8 vs bf16 shards, each part under its own timeout, JSON in $OUT as each finishes (~3-4 min;
#              not in `all`): the 8B-shaped producer with codec bf16 and fp8 (tok/s, host bytes per token,
#              pinned MB: $OUT/fp8prod/), then the consumer's data path alone at 32B-class width on a spool of
#              each codec ($OUT/feed32_bf16.json, feed32_fp8.json: context tok/s, host bytes per token), then
#              the producer's GPU test on both codecs (FP8_TESTS=0 skips it); FP8_SMALL=1: the same at the
#              benches' CPU smoke sizes (ops/bench/fp8_cpu_check.sh runs it on a CPU box before a GPU call)
#   fp8target  the FP8 target (--target-precision fp8) against bf16, one call (~6 min, not in `all`): the
#              hybrid-27B producer at full depth (64 layers; FP8T_LAYERS) as shipped and with the FP8 target,
#              the FP8 one with its own forward alone (FP8T_FORWARD=full,fp8target: both), the per-layer
#              error of the FP8 target's captures against the bf16 target's
#              ($OUT/producer_bench_hybrid27b.json), then FP8 vs bf16 matmuls at that
#              target's linear shapes ($OUT/fp8_matmul.json: torch._scaled_mm rowwise eager / compiled, block
#              scales where cuBLAS has them); FP8T_8B=1 adds the 8B-shaped producer (a second call's worth)
# Run from the repo root on the device with `.whl` carried: `bash ../shared/device/wheels.sh fla-core`
# (zarr, zstandard, numcodecs, boto3, datasets + fla-core: ~26 MB). Every bench writes JSON + markdown to
# $OUT with the producer's thresholds checked (PASS/FAIL lines).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/dflash-inductor-cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ ! -f /tmp/site/.installed ]; then  # once per machine: a second suite call in the same command skips it
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
  touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD
export PATH="/tmp/site/bin:$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, zarr; print(torch.__version__, transformers.__version__, zarr.__version__)" | tee -a "$OUT/gpu.txt"

parts=" ${*:-all} "
[[ "$parts" == *" producer "* ]] && parts+=" prod8 prod32 hybrid pipeline1 plan "
want() { [[ "$parts" == *" all "* || "$parts" == *" $1 "* ]]; }
pbench() {  # name, timeout, args...: the producer benchmark
  local name=$1 limit=$2; shift 2
  echo "== producer bench: $name"
  timeout "$limit" python3 ops/bench/producer_bench.py --out "$OUT" "$@" > "$OUT/$name.log" 2>&1
  echo "exit $?"; grep -E "^\| |PASS|FAIL|n/a" "$OUT/$name.log" | cut -c1-220
}
bench() {  # name, args...
  local name=$1; shift
  echo "== consumer bench: $name"
  python3 ops/bench/consumer_bench.py --workdir /tmp/bench-work --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1
  grep -v "^W1\|warn\|Writing" "$OUT/$name.log" | tail -4 | cut -c1-1500
}
if want tests; then
  echo "== GPU tests"
  # the files that hold GPU tests (the others import packages the device lacks: moto, hypothesis)
  timeout "${GPU_TESTS_LIMIT:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=20 -rA \
    $(grep -l "pytest.mark.gpu" tests/test_*.py) 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if want ref; then bench ref --mode reference --reference .bench/ref; fi
if want feed32; then bench feed32 --mode feed --preset 32b --steps 60 --warmup 0; fi
if [[ "$parts" == *" feedsweep "* ]]; then  # not in `all`: the data path alone per decode-thread count
  for n in ${FEED_THREADS:-2 4 8}; do
    timeout "${FEED_LIMIT:-90}" python3 ops/bench/consumer_bench.py --workdir /tmp/bench-work --mode feed \
      --preset 32b --steps 80 --warmup 0 --decode-threads "$n" --json "$OUT/feed32_t$n.json" \
      > "$OUT/feed32_t$n.log" 2>&1
    echo "exit $? (decode threads $n)"; grep "^{" "$OUT/feed32_t$n.log" | cut -c1-900
  done
fi
if want trainer32; then  # no checkpoints: the loop alone; py-spy samples every thread for 12 s
  DFLASH_BENCH_PYSPY="${PYSPY_DELAY:-75}:12:$OUT/pyspy32.txt" \
    bench trainer32 --mode trainer --preset 32b --steps 120 --save-every 0 --precision auto --precision bf16
fi
if want ckpt32; then  # background checkpoints every 50 steps (warm compile cache after trainer32)
  bench ckpt32 --mode trainer --preset 32b --steps 100 --save-every 60
fi
if want warm32; then bench warm32 --mode trainer --preset 32b --steps 10 --warmup 2 --save-every 0; fi
if want trainer32x3; then
  # one save (at the last step, 170): two 30.8 GB checkpoints do not fit the device's 64 GB disk
  bench trainer32x3 --mode trainer --preset 32b --steps 150 --warmup 20 --save-every 170 --save-runs 1 \
    --seed 0 --seed 1 --seed 2
fi
if [[ "$parts" == *" ab "* ]]; then  # never part of `all`: it takes a whole call
  abp=${AB_PRESET:-32b}; abdir=ab; [[ "$abp" != 32b ]] && abdir=ab-$abp
  echo "== consumer A/B ($abp): reference at the same shape, one spool, a fresh process per variant"
  IFS=';' read -ra ab <<< "${AB_VARIANTS:-default=--profile-steps 1:5;old-defaults=--gc-mode python --no-expandable-segments;liger=--loss-impl liger;mixed=--precision mixed}"
  args=(); for v in "${ab[@]}"; do args+=(--variant "$v"); done
  timeout -k 10 "$(( ${AB_BUDGET:-470} + 20 ))" python3 ops/bench/consumer_ab.py --preset "$abp" --reference .bench/ref \
    --steps "${AB_STEPS:-80}" --warmup "${AB_WARMUP:-10}" --out "$OUT/$abdir" --workdir /tmp/bench-work \
    --budget-s "${AB_BUDGET:-470}" --min-variant-s "${AB_MIN_VARIANT:-45}" "${args[@]}" > "$OUT/$abdir.log" 2>&1
  echo "exit $?"; grep -E '^\{|^\|' "$OUT/$abdir.log" | cut -c1-2500
fi
if [[ "$parts" == *" optim "* ]]; then  # not in `all`: the optimizer step alone per precision (~1 min)
  echo "== the optimizer step alone (${OPTIM_PRESET:-32b}): ms, bytes per parameter, TB/s"
  timeout -k 10 "${OPTIM_LIMIT:-120}" python3 ops/bench/optim_bench.py --preset "${OPTIM_PRESET:-32b}" --out "$OUT" \
    --variants "${OPTIM_VARIANTS:-amp,mixed,bf16sr,bf16sr-fp32m,bf16,ao8bit}" > "$OUT/optim.log" 2>&1
  echo "exit $?"; grep '^{' "$OUT/optim.log" | cut -c1-400
fi
if want trainer8; then bench trainer8 --mode trainer --preset 8b --steps "${TRAINER8_STEPS:-200}"; fi
if want learning; then
  lp=(); for x in ${LEARN_PRECISIONS:-mixed amp}; do lp+=(--precision "$x"); done
  for x in ${LEARN_SEEDS:-0}; do lp+=(--seed "$x"); done
  bench learning --mode learning --preset small --steps 500 --warmup 0 --context-tokens 2048 --num-anchors 128 "${lp[@]}"
fi
if want gpusel; then
  echo "== GPU tests of the loss, optimizer and attention kernels"
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_loss.py tests/test_optim.py \
    tests/test_attention.py tests/test_drafter.py 2>&1 | tee "$OUT/gpusel.log" | tail -8
fi
if want prod8; then pbench prod8 300 --preset 8b --variants "${PROD8_VARIANTS:-eager,full,static}" --tokens "${PROD8_TOKENS:-491520}"; fi
if [[ "$parts" == *" fp8 "* ]]; then  # never part of `all`: it is the FP8 call
  prod=(--preset 8b --tokens "${FP8_TOKENS:-491520}"); feed=(--preset 32b --steps 60)
  if [[ -n "${FP8_SMALL:-}" ]]; then  # the same part at CPU smoke sizes: the check before a GPU call
    prod=(--small); feed=(--preset tiny --steps 20 --device cpu --producers 2 --context-tokens 1024 --num-anchors 32)
  fi
  echo "== FP8 vs bf16: the producer (${prod[*]})"
  timeout "${FP8_PROD_LIMIT:-200}" python3 ops/bench/producer_bench.py --out "$OUT/fp8prod" --variants bf16,fp8 \
    --no-bare --no-forward "${prod[@]}" > "$OUT/fp8prod.log" 2>&1
  echo "exit $?"; grep -E "^\| |PASS|FAIL|n/a" "$OUT/fp8prod.log" | cut -c1-220
  for codec in bf16 fp8; do
    echo "== FP8 vs bf16: the consumer's data path alone, $codec shards (${feed[*]})"
    timeout "${FP8_FEED_LIMIT:-100}" python3 ops/bench/consumer_bench.py --mode feed --warmup 0 "${feed[@]}" \
      --codec "$codec" --workdir /tmp/bench-work --json "$OUT/feed32_$codec.json" > "$OUT/feed32_$codec.log" 2>&1
    echo "exit $?"; grep "^{" "$OUT/feed32_$codec.log" | cut -c1-600
  done
  if [[ "${FP8_TESTS:-1}" != 0 ]]; then
    echo "== the producer on CUDA with each codec (pinned buffers, D2H, shards)"
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_producer_gpu.py -k produce_on_cuda 2>&1 \
      | tee "$OUT/fp8_tests.log" | tail -4
  fi
fi
if [[ "$parts" == *" fp8target "* ]]; then  # never part of `all`: it is the FP8-target call
  python3 -c "import fla.ops.gated_delta_rule" 2>/dev/null || echo "warning: fla does not import (carry fla-core in .whl)"
  pbench fp8target_hybrid "${FP8T_HYBRID_LIMIT:-290}" --preset hybrid27b --layers "${FP8T_LAYERS:-64}" \
    --variants full,fp8target --forward-variants "${FP8T_FORWARD:-fp8target}" --no-bare --tokens "${FP8T_TOKENS:-98304}"
  grep -A12 "^FP8 target" "$OUT/fp8target_hybrid.log" | cut -c1-200
  echo "== FP8 vs bf16 matmuls at the hybrid-27B linear shapes"
  timeout "${FP8T_MM_LIMIT:-45}" python3 ops/bench/fp8_matmul.py --iters 10 --out "$OUT" > "$OUT/fp8_matmul.log" 2>&1
  echo "exit $?"; grep "^{" "$OUT/fp8_matmul.log" | cut -c1-400
  if [[ -n "${FP8T_8B:-}" ]]; then
    pbench fp8target_8b "${FP8T_8B_LIMIT:-240}" --preset 8b --variants full,fp8target \
      --forward-variants full,fp8target --no-bare --tokens "${FP8T_8B_TOKENS:-196608}"
  fi
fi
if want prodscope; then pbench prodscope 240 --preset 8b --variants full,trunk --no-bare --tokens 196608; fi
if want prod32; then pbench prod32 240 --preset 32b --variants full --tokens 163840 --no-forward; fi
if want hybrid; then
  python3 -c "import fla.ops.gated_delta_rule" 2>/dev/null || echo "warning: fla does not import (carry fla-core in .whl): 'full' runs on the reference kernels"
  pbench hybrid "${HYBRID_LIMIT:-420}" --preset hybrid27b --layers "${HYBRID_LAYERS:-64}" \
    --variants "${HYBRID_VARIANTS:-full,reference,eager}" --no-bare --tokens "${HYBRID_TOKENS:-98304}" \
    --forward-variants "${HYBRID_FORWARD:-full}" --kernel-check-layers "${HYBRID_CHECK_LAYERS:-8}" \
    ${HYBRID_PROFILE:+--profile-batches "$HYBRID_PROFILE"} ${HYBRID_FORWARD_TOKENS:+--forward-tokens "$HYBRID_FORWARD_TOKENS"} \
    ${HYBRID_VARIANT_TOKENS:+--variant-tokens "$HYBRID_VARIANT_TOKENS"}
fi
if want pipeline1; then
  echo "== pipeline bench: one producer + one consumer sharing GPU 0"
  timeout 420 python3 ops/bench/pipeline_bench.py --preset 8b --producer-gpus 0 --consumer-gpus 0 --chats 300 \
    --workdir /tmp/dflash-pipeline-bench --out "$OUT/pipeline" > "$OUT/pipeline1.log" 2>&1
  echo "exit $?"; tail -12 "$OUT/pipeline1.log" | cut -c1-300
fi
if want pipelineh; then
  echo "== pipeline bench: hybrid-27B slice (8 layers), one producer + one consumer sharing GPU 0"
  timeout "${PIPEH_LIMIT:-300}" python3 ops/bench/pipeline_bench.py --preset hybrid27b --layers 8 --producer-gpus 0 \
    --consumer-gpus 0 --chats "${PIPEH_CHATS:-200}" --workdir /tmp/dflash-pipeline-bench --out /tmp/pipeh \
    > "$OUT/pipelineh.log" 2>&1
  echo "exit $?"; tail -12 "$OUT/pipelineh.log" | cut -c1-300; cp /tmp/pipeh/pipeline_bench_*.json "$OUT/" 2>/dev/null
fi
if want plan; then
  echo "== dflash-plan over the figures"
  # measured rates only: the producer's from producer_bench / pipeline_bench, the consumer's from
  # pipeline_bench, consumer_bench (trainer8, trainer32, trainer32x3) and consumer_ab (ab/ab.jsonl); a shape
  # that lacks one is a line of the plan, not planned
  files=$(ls "$OUT"/pipeline/pipeline_bench_*.json "$OUT"/pipeline_bench_*.json "$OUT"/producer_bench_*.json \
    "$OUT"/trainer*.json "$OUT"/ab*/ab.jsonl 2>/dev/null | paste -sd, -)
  dflash-plan --gpus 8 --bench "$files" --json > "$OUT/plan.json" 2> "$OUT/plan.err" || cat "$OUT/plan.err"
  dflash-plan --gpus 8 --bench "$files" 2>&1 | tail -8
fi
