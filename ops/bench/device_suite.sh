#!/usr/bin/env bash
# Everything that needs the GPU machine, in one call (device time is scarce):
#   GPU tests (flex fwd+bwd vs SDPA, three consumers compiling on one GPU, producer on CUDA),
#   the consumer step benchmark (8B- and 32B-class drafters), the producer benchmark (8B target).
# Run from the repo root on the device with `.whl` carried (../shared/device/wheels.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
export PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, zarr; print(torch.__version__, transformers.__version__, zarr.__version__)" | tee -a "$OUT/gpu.txt"

parts=" ${*:-all} "
want() { [[ "$parts" == *" all "* || "$parts" == *" $1 "* ]]; }
if want tests; then
  echo "== GPU tests"
  timeout 240 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if want consumer; then
  echo "== consumer bench"
  timeout 330 python3 ops/bench/consumer_bench.py --preset 8b --preset 32b --steps 200 \
    --json "$OUT/consumer_bench.json" 2>&1 | tee "$OUT/consumer_bench.log" | grep -v "^W1\|warn" | tail -12
fi
if want producer; then
  echo "== producer bench"
  timeout 240 python3 ops/bench/producer_bench.py --out "$OUT" 2>&1 | tee "$OUT/producer_bench.log" | tail -25
fi
