"""The optimizer step alone at a drafter's width: each precision's AdamW (with the clip and the gradient norm,
as ``clipped_step`` runs it in the trainer) over parameters of the preset's drafter's shapes, timed with
CUDA events, with the bytes per parameter it must move and the bandwidth that makes.

Why: the real loop's kernel table names torch's fused AdamW, but a compiled update is a handful of
inductor kernels among the step's others; here each candidate's step is the only thing on the GPU, so its
time and its share of the memory roofline are plain. The compiled updates use the same parameter shapes
and order as the trainer's, so their graphs land in the inductor cache a later A/B (consumer_ab.py) loads.

Bytes per parameter per step (read + written; the norm reads the gradient once more):
    amp     fused AdamW on fp32 weights, gradients, moments: 16 + 12, norm 4            = 32
    mixed   MasterAdamW: bf16 gradient, fp32 master and moments, bf16 weight out: 14 + 14, norm 2 = 30
    bf16    torch's fused AdamW on bf16 weights and moments (round to nearest): 8 + 6, norm 2 = 16
    bf16sr  StochasticAdamW, bf16 moments: 8 + 6, norm 2                                  = 16
    bf16sr-fp32m  StochasticAdamW, fp32 moments: 12 + 10, norm 2                         = 24
    ao8bit  torchao's AdamW8bit (bf16 stochastic rounding), 8-bit moments: 6 + 4, norm 2, the clip's
            multiply of every gradient 4 (its step takes no scale)                        = 16

    python ops/bench/optim_bench.py --preset 32b --out $OUT
    python ops/bench/optim_bench.py --preset tiny --device cpu --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from consumer_bench import PRESETS, preset_layers  # noqa: E402

from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.model import DFlashDrafter, TargetHead
from dflash.consumer.optim import MasterAdamW, StochasticAdamW, clipped_step

BYTES_PER_PARAM = {"amp": 32, "mixed": 30, "bf16": 16, "bf16sr": 16, "bf16sr-fp32m": 24, "ao8bit": 16}
"""What each variant's step must read and write per parameter (module docstring)."""
VARIANTS = tuple(BYTES_PER_PARAM)


def param_shapes(preset: str) -> list[torch.Size]:
    """The trainable parameters' shapes of the preset's 5-layer drafter, in the model's order (built on the
    meta device: no memory)."""
    cfg = DrafterConfig(
        **PRESETS[preset],
        num_layers=5,
        block_size=16,
        mask_token_id=0,
        target_layer_ids=list(range(1, 6)),
        **preset_layers(preset),
    )
    with torch.device("meta"):
        head = TargetHead(
            torch.empty(cfg.vocab_size, cfg.hidden_size), torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        model = DFlashDrafter(cfg, head)
    return [p.shape for p in model.parameters() if p.requires_grad]


def make_optimizer(variant: str, params: list[torch.Tensor], backend: str) -> torch.optim.Optimizer:
    if variant == "amp":
        return torch.optim.AdamW(params, lr=6e-4, weight_decay=0.0, fused=params[0].is_cuda)
    if variant == "bf16":
        return torch.optim.AdamW(params, lr=6e-4, weight_decay=0.0, fused=params[0].is_cuda)
    if variant == "mixed":
        return MasterAdamW(params, lr=6e-4, weight_decay=0.0, compile_backend=backend)
    if variant in ("bf16sr", "bf16sr-fp32m"):
        moments = torch.float32 if variant == "bf16sr-fp32m" else torch.bfloat16
        return StochasticAdamW(
            params, lr=6e-4, weight_decay=0.0, moment_dtype=moments, compile_backend=backend
        )
    if variant == "ao8bit":
        from torchao.optim import AdamW8bit  # only this variant needs torchao (carried as a wheel)

        return AdamW8bit(params, lr=6e-4, weight_decay=0.0, bf16_stochastic_round=True)
    raise ValueError(f"unknown variant {variant!r} (one of {', '.join(VARIANTS)})")


def run_variant(
    variant: str, shapes: list[torch.Size], device: torch.device, *, steps: int, warmup: int
) -> dict:
    """``warmup`` steps (the compile), then ``steps`` timed steps; ms per step (median), achieved GB/s."""
    dtype = torch.float32 if variant == "amp" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(s, device=device, generator=gen).mul_(0.02).to(dtype)) for s in shapes
    ]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen).mul_(1e-4).to(dtype)
    backend = "inductor" if device.type == "cuda" else "eager"
    opt = make_optimizer(variant, params, backend)
    t0 = time.monotonic()
    for _ in range(warmup):
        if variant == "ao8bit":  # torchao's step takes no gradient scale: clip the gradients first
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        else:
            clipped_step(opt, params, 1.0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    warm_s = time.monotonic() - t0
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        if variant == "ao8bit":
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        else:
            clipped_step(opt, params, 1.0)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append(1e3 * (time.perf_counter() - t))
    n = sum(s.numel() for s in shapes)
    ms = statistics.median(times)
    rec = {
        "variant": variant,
        "params_b": round(n / 1e9, 4),
        "ms_per_step_median": round(ms, 2),
        "ms_min": round(min(times), 2),
        "bytes_per_param": BYTES_PER_PARAM[variant],
        "gb_per_step": round(n * BYTES_PER_PARAM[variant] / 1e9, 2),
        "achieved_tb_s": round(n * BYTES_PER_PARAM[variant] / (ms / 1e3) / 1e12, 3),
        "warmup_s": round(warm_s, 1),
    }
    if device.type == "cuda":
        rec["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
    del opt, params
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="32b", choices=sorted(PRESETS))
    p.add_argument("--variants", default="amp,mixed,bf16sr,bf16sr-fp32m,bf16,ao8bit")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if bad := [v for v in variants if v not in VARIANTS]:
        raise SystemExit(f"--variants: unknown {', '.join(bad)} (one of {', '.join(VARIANTS)})")
    device = torch.device(args.device)
    shapes = param_shapes(args.preset)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for variant in variants:
        try:
            rec = run_variant(variant, shapes, device, steps=args.steps, warmup=args.warmup)
        except Exception as err:  # one variant's failure (torchao missing, out of memory) is its record
            rec = {"variant": variant, "error": f"{type(err).__name__}: {str(err)[:300]}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rec.update(
            preset=args.preset, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        )
        print(json.dumps(rec), flush=True)
        with (out / f"optim_bench_{args.preset}.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
