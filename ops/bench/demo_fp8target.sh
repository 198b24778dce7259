#!/usr/bin/env bash
# The demo's drafter trained on the FP8 target's hidden states vs the bf16 target's, paired (CPU):
# two spools produced once with the demo's producer flags and --codec bf16 (exact shards), one from the
# demo target as it is (fp32 on the CPU), one with --target-precision fp8 (emulated on the CPU:
# quantize -> dequantize); the FP8 spool's eval/ replaced by the bf16 one (held-out contexts from the real
# target in both), then per seed dflash-consume with the demo's drafter flags and --bucket oldest on a fresh
# copy of each. τ: the consumer's decode-order τ on the held-out documents, verified by the bf16 target.
# Also writes the per-layer error of the FP8 target's captures on the first shard.
# Usage: [EPOCHS=12] [PRECS="bf16 fp8"] bash ops/bench/demo_fp8target.sh OUT "SEEDS"   (repo root, .venv;
# seed by seed, both precisions each, so a cut run leaves pairs)
set -euo pipefail
OUT=${1:-/tmp/fp8demo}; SEEDS=${2:-"0 1 2"}; EPOCHS=${EPOCHS:-12}; PRECS=${PRECS:-"bf16 fp8"}
PY=.venv/bin/python
mkdir -p "$OUT"
TARGET=$($PY -c "from dflash.tools.demo.assets import tiny_target_dir; print(tiny_target_dir())")
DATA=$($PY -c "from dflash.tools.demo.assets import distilled_dataset_path; print(distilled_dataset_path())")
for prec in bf16 fp8; do
  [[ -d "$OUT/spool-$prec/ready" ]] && continue
  $PY -m dflash.producer.cli --gpus cpu:1 --model "$TARGET" --dataset "$DATA" --spool "$OUT/spool-$prec" \
    --run "fp8demo-$prec" --max-length 512 --batch-tokens 4096 --epochs "$EPOCHS" --eval-samples 32 --codec bf16 \
    --target-precision "$prec" > "$OUT/produce-$prec.log" 2>&1
done
rm -rf "$OUT/spool-fp8/eval" && cp -r "$OUT/spool-bf16/eval" "$OUT/spool-fp8/eval"
for seed in $SEEDS; do
  for prec in $PRECS; do
    run="$OUT/$prec-s$seed"; [[ -f "$run/done" ]] && continue
    rm -rf "$run" "$OUT/copy"; cp -r "$OUT/spool-$prec" "$OUT/copy"
    $PY -m dflash.consumer.cli --gpu cpu --spool "$OUT/copy" --target "$TARGET" --run-dir "$run" \
      --context-tokens 512 --num-anchors 64 --max-anchors-per-doc 16 --num-layers 2 \
      --block-size 8 --eval-every 100 --eval-budget 1 --log-every 1 --lr 3e-3 --seed "$seed" --bucket oldest \
      > "$run.log" 2>&1 && touch "$run/done"
  done
done
