"""Consumer step benchmark: ms/step, context tok/s, TFLOP/s, MFU, first step, recompiles, memory drift.

Runs the trainer's own step (``forward_backward`` + grad clip + fused AdamW + schedule, compiled draft
layers with flex_attention on CUDA) on synthetic packed batches of fixed shape: random documents per
step (the mask changes every step, the shapes never do), hidden states copied host->device from pinned
memory each step as the trainer does. Random weights; the target's embedding/lm_head are random too.

FLOPs are counted explicitly (see ``step_flops``): matmul FLOPs of every projection that runs, x3 for
trainable layers (forward + input grad + weight grad), x2 for ``fc`` (its input is data: no input grad) and
for the frozen lm_head (no weight grad); attention counts only the (query, key) pairs the mask lets through
(4·pairs·head_dim per head forward, x3 for backward). MFU = achieved / measured bf16 matmul peak.

    python ops/bench/consumer_bench.py --preset 32b --steps 200 --json out.json
    python ops/bench/consumer_bench.py --preset tiny --steps 5 --device cpu      # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dflash.consumer.attention import recompile_count
from dflash.consumer.batching import build_draft_batch, pack_samples
from dflash.consumer.config import TrainConfig
from dflash.consumer.drafter import DFlashDrafter, DrafterConfig, TargetHead
from dflash.consumer.trainer import build_optimizer, compile_drafter, forward_backward

PRESETS = {
    # hidden, heads, kv heads, head_dim, intermediate, vocab, target layers
    "8b": dict(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        num_target_layers=36,
    ),
    "32b": dict(
        hidden_size=5120,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=25600,
        vocab_size=151936,
        num_target_layers=64,
    ),
    "tiny": dict(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=4096,
        num_target_layers=8,
    ),
}


def step_flops(cfg: DrafterConfig, *, context: int, anchors: int, visible_pairs: float) -> float:
    h, hq, hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    b, k = cfg.block_size, cfg.num_context_layers
    q = anchors * b
    fc = 2 * context * (k * h) * h * 2
    per_layer = (
        2 * q * h * hq * d  # q_proj
        + 2 * 2 * (context + q) * h * hkv * d  # k_proj, v_proj over context and block tokens
        + 2 * q * hq * d * h  # o_proj
        + 3 * 2 * q * h * cfg.intermediate_size  # gate, up, down
    ) * 3
    attention = 4 * visible_pairs * d * hq * 3
    lm_head = 2 * anchors * (b - 1) * h * cfg.vocab_size * 2
    return fc + cfg.num_layers * (per_layer + attention) + lm_head


def matmul_peak_tflops(device: torch.device) -> float:
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ c
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ c
    torch.cuda.synchronize()
    return 2 * n**3 * 10 / (time.perf_counter() - t) / 1e12


def random_packed(context: int, width: int, vocab: int, pinned_hidden: torch.Tensor, gen: torch.Generator):
    """Documents of random lengths (64..context/2) packed to exactly ``context`` tokens, last one padded."""
    samples, used, i = [], 0, 0
    while used < context - 64:
        n = int(torch.randint(64, max(65, context // 2), (1,), generator=gen))
        n = min(n, context - used)
        ids = torch.randint(0, vocab, (n,), generator=gen)
        mask = torch.rand(n, generator=gen) > 0.3
        samples.append((ids, mask, pinned_hidden[used : used + n], i))
        used += n
        i += 1
    return pack_samples(samples, context_tokens=context)


def run(preset: str, *, steps: int, context: int, anchors: int, device: torch.device, backend: str) -> dict:
    cfg = DrafterConfig(
        **PRESETS[preset], num_layers=5, block_size=16, mask_token_id=0, target_layer_ids=list(range(1, 6))
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head = TargetHead(
        torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device) * 0.02,
        torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device) * 0.02,
    )
    model = DFlashDrafter(cfg, head).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    tcfg = TrainConfig(spool=".", target=".", device=str(device), total_steps=steps)
    optimizer, scheduler = build_optimizer(model, tcfg, device)
    compile_drafter(model, backend)
    width = cfg.hidden_size * cfg.num_context_layers
    pinned = torch.randn(context, width).to(torch.bfloat16)
    if device.type == "cuda":
        pinned = pinned.pin_memory()
    gen = torch.Generator().manual_seed(0)

    def one_step() -> tuple[float, float]:
        packed = random_packed(context, width, cfg.vocab_size, pinned, gen)
        batch = build_draft_batch(
            packed,
            block_size=cfg.block_size,
            num_anchors=anchors,
            max_anchors_per_doc=anchors,
            mask_token_id=0,
            gamma=7.0,
            generator=gen,
        )
        # visible pairs: each valid block sees its document's prefix before the anchor plus its own B tokens
        doc_start = batch.anchors - batch.positions[batch.anchors]
        pairs = (
            float(((batch.anchors - doc_start + cfg.block_size) * batch.anchor_valid).sum()) * cfg.block_size
        )
        weight = batch.label_weights.sum()
        batch = batch.to(device, non_blocking=True, hidden_dtype=dtype)
        forward_backward(
            model,
            model,
            batch,
            loss_scale=1.0 / weight.clamp(min=1e-6).to(device),
            chunk_tokens=tcfg.loss_chunk_tokens,
        )
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return pairs, float(weight)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    one_step()
    sync()
    first_step_s = time.perf_counter() - t0
    one_step()
    sync()
    compiles_after_warmup = recompile_count()
    times, pairs_all, mem = [], [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        t = time.perf_counter()
        pairs, _ = one_step()
        sync()
        times.append(time.perf_counter() - t)
        pairs_all.append(pairs)
        if device.type == "cuda":
            mem.append(torch.cuda.max_memory_allocated(device) / 2**30)
    recompiles = recompile_count() - compiles_after_warmup
    step_s = statistics.median(times)
    flops = step_flops(cfg, context=context, anchors=anchors, visible_pairs=statistics.mean(pairs_all))
    out = {
        "preset": preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params_trainable_M": round(n_params / 1e6, 1),
        "context_tokens": context,
        "anchors": anchors,
        "steps": steps,
        "ms_per_step_median": round(step_s * 1e3, 1),
        "ms_per_step_mean": round(statistics.mean(times) * 1e3, 1),
        "context_tok_s": round(context / step_s),
        "tflop_per_step": round(flops / 1e12, 2),
        "tflops": round(flops / step_s / 1e12, 1),
        "first_step_s": round(first_step_s, 1),
        "recompiles_after_warmup": recompiles,
        "backend": backend,
    }
    if device.type == "cuda":
        peak = matmul_peak_tflops(device)
        early = mem[min(9, len(mem) - 1)]
        out.update(
            matmul_peak_tflops=round(peak, 1),
            mfu=round(flops / step_s / 1e12 / peak, 3),
            peak_mem_gb_step10=round(early, 2),
            peak_mem_gb_last=round(mem[-1], 2),
            peak_mem_drift_pct=round(100 * (mem[-1] - early) / early, 2),
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--preset", action="append", choices=sorted(PRESETS), help="repeatable (default 8b and 32b)"
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--anchors", type=int, default=256)
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    results = []
    for preset in args.preset or ["8b", "32b"]:
        r = run(
            preset,
            steps=args.steps,
            context=args.context,
            anchors=args.anchors,
            device=device,
            backend=args.backend,
        )
        print(json.dumps(r), flush=True)
        results.append(r)
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    cols = [
        "preset",
        "ms_per_step_median",
        "context_tok_s",
        "tflops",
        "mfu",
        "first_step_s",
        "recompiles_after_warmup",
        "peak_mem_drift_pct",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
