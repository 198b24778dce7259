#!/usr/bin/env python
"""FP8 against bf16 matmuls at the hybrid-27B target's linear shapes, one GPU: what an FP8 target can win.

Why: the FP8 target (common/target/fp8.py) bets on ``torch._scaled_mm`` with rowwise scales, its activation
quantization fused by inductor. This times, per linear of a hybrid-27B layer (M tokens per batch):
- ``bf16``: ``F.linear`` in bf16 (cuBLAS), the producer's matmul today;
- ``fp8_mm``: ``torch._scaled_mm`` rowwise alone, operands already FP8 (the ceiling);
- ``fp8_linear_eager`` / ``fp8_linear_compiled``: ``Fp8Linear`` as the producer runs it (the activation's
  row amax, scale and cast, then the matmul), eager and under ``torch.compile`` (inductor fuses the
  quantization into one kernel);
- ``fp8_block``: ``torch._scaled_mm`` with 1 x 128 activation and 128 x 128 weight block scales (the
  published checkpoints' own layout) where this torch/cuBLAS has it (else its one-line error).
TFLOP/s per shape and over the whole layer mix (a GDN layer's and an attention layer's linears, 3:1).

    python ops/bench/fp8_matmul.py --out $OUT   # GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dflash.common.target.fp8 import FP8_DTYPE, Fp8Linear, quantize_rows

# (name, in, out, per GDN layer, per attention layer): the hybrid-27B preset (ops/bench/targets.py)
SHAPES = [
    ("gdn in_proj_qkv", 5120, 10240, 1, 0),
    ("gdn in_proj_z", 5120, 6144, 1, 0),
    ("gdn out_proj", 6144, 5120, 1, 0),
    ("attn q_proj (+gate)", 5120, 12288, 0, 1),
    ("attn k_proj / v_proj", 5120, 1024, 0, 2),
    ("attn o_proj", 6144, 5120, 0, 1),
    ("mlp gate / up", 5120, 17408, 2, 2),
    ("mlp down", 17408, 5120, 1, 1),
]


KEYS = ("bf16", "fp8_mm", "fp8_linear_eager", "fp8_linear_compiled", "fp8_block")


def timed(fn, flops: float, iters: int) -> float:
    """TFLOP/s of ``fn`` (best of 3 runs of ``iters`` calls, after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / iters)
    return flops / best / 1e12


def block_mm(x: torch.Tensor, w: torch.Tensor):
    """A callable of the blockwise-scaled product (1 x 128 activations, 128 x 128 weights), or the reason."""
    m, k = x.shape
    n = w.shape[0]
    try:
        xs = (x.float().view(m, k // 128, 128).abs().amax(-1) / 448).clamp(min=1e-12)
        xq = (x.float().view(m, k // 128, 128) / xs[..., None]).to(FP8_DTYPE).view(m, k)
        ws = (w.float().view(n // 128, 128, k // 128, 128).abs().amax((1, 3)) / 448).clamp(min=1e-12)
        wq = (w.float().view(n // 128, 128, k // 128, 128) / ws[:, None, :, None]).to(FP8_DTYPE).view(n, k)
        a_scale = xs.t().contiguous().t()  # outer-dim-major, as cuBLAS's 1 x 128 scaling wants
        fn = lambda: torch._scaled_mm(xq, wq.t(), scale_a=a_scale, scale_b=ws, out_dtype=torch.bfloat16)  # noqa: E731
        fn()
        return fn
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:
        return str(err).strip().splitlines()[0][:200]


def time_shape(k: int, n: int, tokens: int, iters: int, dev: torch.device) -> dict:
    """TFLOP/s of each path (KEYS) for [tokens, k] x [k, n]."""
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    fp8 = Fp8Linear(lin, emulate=False)
    xq, xs = quantize_rows(x)
    compiled = torch.compile(fp8, dynamic=True)
    flops = 2.0 * tokens * k * n
    row: dict = {"flops": flops}
    with torch.inference_mode():
        row["bf16"] = timed(lambda: torch.nn.functional.linear(x, lin.weight), flops, iters)
        row["fp8_mm"] = timed(
            lambda: torch._scaled_mm(
                xq, fp8.weight.t(), scale_a=xs, scale_b=fp8.weight_scale, out_dtype=torch.bfloat16
            ),
            flops,
            iters,
        )
        row["fp8_linear_eager"] = timed(lambda: fp8(x), flops, iters)
        row["fp8_linear_compiled"] = timed(lambda: compiled(x), flops, iters)
        blk = block_mm(x, lin.weight)
        row["fp8_block"] = timed(blk, flops, iters) if callable(blk) else blk
    return {k: round(v, 1) if isinstance(v, float) and k != "flops" else v for k, v in row.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768, help="M: tokens per batch (the producer's default)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="runs/bench")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("fp8_matmul: error: no CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    res = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "tokens": args.tokens,
        "shapes": [],
    }
    for name, k, n, per_gdn, per_attn in SHAPES:
        row = {"shape": name, "in": k, "out": n, **time_shape(k, n, args.tokens, args.iters, dev)}
        row["weight"] = 3 * per_gdn + per_attn  # 3 GDN layers per attention layer
        res["shapes"].append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    rows = res["shapes"]
    total = sum(r["weight"] * r["flops"] for r in rows)
    seconds = {  # per layer mix, for each path measured at every shape
        k: sum(r["weight"] * r["flops"] / (r[k] * 1e12) for r in rows)
        for k in KEYS
        if all(isinstance(r[k], float) for r in rows)
    }
    res["layer_mix_tflops"] = {k: round(total / s / 1e12, 1) for k, s in seconds.items()}
    res["layer_mix_vs_bf16"] = {k: round(seconds["bf16"] / s, 3) for k, s in seconds.items()}
    print(json.dumps({"layer_mix_tflops": res["layer_mix_tflops"], "vs_bf16": res["layer_mix_vs_bf16"]}))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_matmul.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
