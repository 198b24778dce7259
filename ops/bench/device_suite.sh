#!/usr/bin/env bash
# Everything that needs the GPU machine, in few calls (device time is scarce). Parts (any order, several per
# call; default all):
#   tests      GPU tests (flex fwd+bwd vs SDPA, three consumers compiling on one GPU, producer on CUDA)
#   ref        the reference consumer step (needs .bench/ref: a copy of ../shared/bench)
#   feed32     the data path alone at 32B-class width (claim, decode, pack, pinned copy; no step)
#   trainer32  the real Trainer over a real spool, 32B-class drafter, default precision (amp) and bf16
#   ckpt32     trainer32 with background checkpoints every 60 steps (stall per save; warm first step)
#   warm32     a fresh process on the warm compile cache: time to first step
#   trainer8   the real Trainer, 8B-class drafter, bf16
#   learning   a learnable spool trained 500 steps with bf16 and with amp (loss curves)
#   producer   the producer benchmark (8B target)
# Run from the repo root on the device with `.whl` carried (../shared/device/wheels.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/dflash-inductor-cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
export PATH="/tmp/site/bin:$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, zarr; print(torch.__version__, transformers.__version__, zarr.__version__)" | tee -a "$OUT/gpu.txt"

parts=" ${*:-all} "
want() { [[ "$parts" == *" all "* || "$parts" == *" $1 "* ]]; }
bench() {  # name, args...
  local name=$1; shift
  echo "== consumer bench: $name"
  python3 ops/bench/consumer_bench.py --workdir /tmp/bench-work --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1
  grep -v "^W1\|warn\|Writing" "$OUT/$name.log" | tail -4 | cut -c1-1500
}
if want tests; then
  echo "== GPU tests"
  timeout 240 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if want ref; then bench ref --mode reference --reference .bench/ref; fi
if want feed32; then bench feed32 --mode feed --preset 32b --steps 60 --warmup 0; fi
if want trainer32; then  # no checkpoints: the loop alone; py-spy samples every thread for 12 s
  DFLASH_BENCH_PYSPY="${PYSPY_DELAY:-75}:12:$OUT/pyspy32.txt" \
    bench trainer32 --mode trainer --preset 32b --steps 120 --save-every 0 --precision auto --precision bf16
fi
if want ckpt32; then  # background checkpoints every 50 steps (warm compile cache after trainer32)
  bench ckpt32 --mode trainer --preset 32b --steps 100 --save-every 60
fi
if want warm32; then bench warm32 --mode trainer --preset 32b --steps 10 --warmup 2 --save-every 0; fi
if want trainer8; then bench trainer8 --mode trainer --preset 8b --steps 200; fi
if want learning; then
  bench learning --mode learning --preset small --steps 500 --warmup 0 --context 2048 --anchors 128 --precision bf16 --precision amp
fi
if want producer; then
  echo "== producer bench"
  timeout 240 python3 ops/bench/producer_bench.py --out "$OUT" 2>&1 | tee "$OUT/producer_bench.log" | tail -25
fi
