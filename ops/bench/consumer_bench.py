"""Consumer benchmark: the real trainer loop over a real spool, and the reference step, in one run.

``--mode trainer`` (what users run): producer processes (``bench_data.SpoolFiller``) write real shards (the
project's zarr writer and default codec, spool publish + byte budget, a realistic chat length
distribution) while ``dflash.consumer.trainer.Trainer`` — the object ``dflash-consume`` runs — trains from
that spool: feed, packing, input pipeline, compiled step, checkpoints to a local store. Reports context and
real tok/s (stream fill), ms/step, TFLOP/s, MFU, stall per checkpoint, first step, recompiles, memory drift.
``--reference DIR`` runs the reference step (``ref_consumer_step.py`` from ../shared/bench, copied into a
git-ignored folder) first, on the same GPU in the same call, so the ratio is measured side by side.

``--mode step``: the trainer's step on synthetic batches built in this process (a HAND-BUILT path: no feed,
no spool, no input pipeline; kept to isolate the step's own speed).

``--mode learning``: the same learnable spool trained with each ``--precision`` (same data order, same
seed) for ``--steps`` steps; writes the loss curves (JSON) to compare precisions.

FLOPs are counted explicitly (see ``step_flops``): matmul FLOPs of every projection that runs, x3 for
trainable layers (forward + input grad + weight grad), x2 for ``fc`` (its input is data: no input grad) and
for the frozen lm_head (no weight grad); attention counts only the (query, key) pairs the mask lets through
(4·pairs·head_dim per head forward, x3 for backward). MFU = achieved / measured bf16 matmul peak.

    python ops/bench/consumer_bench.py --mode trainer --preset 32b --steps 200 --reference .bench/ref
    python ops/bench/consumer_bench.py --mode step --preset tiny --steps 5 --device cpu      # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import FillPlan, SpoolFiller, write_target_head  # noqa: E402

from dflash.common.contract.codecs import DEFAULT_CODEC_SPEC, CodecConfig
from dflash.common.drafter.batch import build_draft_batch, pack_samples
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.dflash import recompile_count
from dflash.common.drafter.layers import FULL, HYBRID_SLIDING_WINDOW, SLIDING, default_target_layer_ids
from dflash.common.drafter.model import DFlashDrafter, TargetHead
from dflash.consumer.config import ARCH_DEFAULTS, TrainConfig, add_train_flags, train_flag_names
from dflash.consumer.optim import build_optimizer, clipped_step
from dflash.consumer.step import (
    cast_parameters,
    compile_drafter,
    forward_backward,
    make_loss,
)
from dflash.consumer.trainer import Trainer

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
    # the Qwen3.5/3.6-27B hybrid's drafter: its target's width, attention heads and 248K vocabulary
    "hybrid27b": dict(
        hidden_size=5120,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        intermediate_size=17408,
        vocab_size=248320,
        num_target_layers=64,
    ),
    "small": dict(
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=3072,
        vocab_size=32000,
        num_target_layers=24,
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


LINEAR_ATTENTION = {
    "hybrid27b": dict(
        linear_num_value_heads=48,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )
}
"""Presets whose target is a hybrid (Gated DeltaNet dims): its drafter slides in all layers but the last."""


def preset_layers(preset: str) -> dict:
    """The drafter's layer layout for a preset's target (the hybrid layout where the target is one)."""
    if preset not in LINEAR_ATTENTION:
        return {}
    return {"layer_types": [SLIDING] * 4 + [FULL], "sliding_window": HYBRID_SLIDING_WINDOW}


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


def run(
    preset: str,
    *,
    steps: int,
    context: int,
    anchors: int,
    device: torch.device,
    backend: str,
    precision: str | None = None,
) -> dict:
    cfg = DrafterConfig(
        **PRESETS[preset],
        num_layers=5,
        block_size=16,
        mask_token_id=0,
        target_layer_ids=list(range(1, 6)),
        **preset_layers(preset),
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head = TargetHead(
        torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device) * 0.02,
        torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device) * 0.02,
    )
    model = DFlashDrafter(cfg, head).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    tcfg = TrainConfig.from_flat(
        spool=".",
        target=".",
        total_steps=steps,
        compile_backend=backend,
        **({"precision": precision} if precision else {}),
    )
    cast_parameters(model, tcfg.optim.param_dtype(device.type))
    optimizer, schedule = build_optimizer(
        model,
        tcfg.optim,
        device=device,
        schedule_steps=tcfg.schedule_steps,
        compile_backend=tcfg.compile_options.resolved_backend(device.type),
    )
    loss_fn = make_loss(tcfg.step, device)
    trainable = [p for p in model.parameters() if p.requires_grad]
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
            lce=loss_fn,
        )
        clipped_step(optimizer, trainable, tcfg.optim.grad_clip)
        schedule.step()
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
        "precision": tcfg.optim.resolved_precision(device.type),
        "loss_impl": tcfg.step.resolved_loss_impl(device.type),
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


def visible_pairs(batch, block_size: int) -> float:
    """(query, key) pairs the DFlash mask lets through: each valid block sees its document's prefix before
    the anchor plus its own B tokens."""
    doc_start = batch.anchors - batch.positions[batch.anchors]
    return float(((batch.anchors - doc_start + block_size) * batch.anchor_valid).sum()) * block_size


REF_SHAPES = ("32b", "hybrid27b")
"""The drafter shapes the reference step measures (its REF_SHAPE): a preset's ratio to the reference is a
ratio only at the same shape."""


def run_reference(
    ref_dir: str, context: int, anchors: int, *, shape: str = "32b", timeout: float = 600
) -> dict:
    """The reference step (../shared/bench/ref_consumer_step.py) at ``shape`` (its REF_SHAPE) in a
    subprocess on the same GPU. The shape it printed must be the one asked for: a copy of the script from
    before REF_SHAPE measures 32b whatever it is told, and its figure is no reference for another shape."""
    if shape not in REF_SHAPES:
        raise ValueError(f"the reference step has no {shape} shape (it measures {', '.join(REF_SHAPES)})")
    script = Path(ref_dir) / "ref_consumer_step.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(context), str(anchors)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "REF_SHAPE": shape},
    )
    out = proc.stdout + proc.stderr
    m = re.search(r"([\d.]+) ms/step, (\d+) TFLOP/s.*ctx tok/s (\d+)", out)
    first = re.search(r"first step s ([\d.]+)", out)
    if proc.returncode != 0 or m is None:
        raise RuntimeError(f"reference step failed (rc {proc.returncode}): {out[-2000:]}")
    printed = re.search(r"shape (\S+) S=", out)
    got = printed.group(1) if printed else "32b"  # the script before REF_SHAPE printed no shape
    if got != shape:
        raise RuntimeError(
            f"reference step measured shape {got}, asked for {shape}: {script} predates REF_SHAPE "
            "(copy ../shared/bench/ref_consumer_step.py again)"
        )
    return {
        "shape": shape,
        "ms_per_step": float(m.group(1)),
        "tflops": float(m.group(2)),
        "context_tok_s": int(m.group(3)),
        "first_step_s": float(first.group(1)) if first else None,
    }


def vs_reference(ref: dict | None, run: dict, *, key: str = "ms_per_step_median") -> float | None:
    """The run's speed-up over the reference step (reference ms / run ms), or None where there is no
    reference figure or it was measured at another shape than the run's preset."""
    if not ref or not ref.get("ms_per_step") or not run.get(key):
        return None
    if ref.get("shape", "32b") != run.get("preset"):
        return None
    return round(ref["ms_per_step"] / run[key], 3)


def _steady_intervals(history: list[dict], *, from_step: int, save_steps: set[int]) -> tuple[list, list]:
    """Per-step seconds of each logged interval after ``from_step``: (without a save, with a save)."""
    plain, with_save = [], []
    for a, b in zip(history, history[1:], strict=False):
        if a["step"] < from_step:
            continue
        per_step = (b["time"] - a["time"]) / (b["step"] - a["step"])
        saved = any(a["step"] < s <= b["step"] for s in save_steps)
        (with_save if saved else plain).append((per_step, b["step"] - a["step"]))
    return plain, with_save


def prefill_spool(
    preset: str,
    *,
    workdir: Path,
    context: int,
    max_steps: int,
    producers: int,
    learnable: bool,
    codec: str | None = None,
) -> tuple[Path, Path, FillPlan, SpoolFiller, int, float]:
    """A spool filled by producer processes before training starts (the consumer alone is measured, not
    the producers' CPU load) and the preset's target head: (spool, target, plan, filler, tokens, seconds)."""
    from dflash.common.contract.spool import Spool

    shape = PRESETS[preset]
    target = workdir / f"target-{preset}"
    if not (target / "model.safetensors").exists():
        write_target_head(target, shape, linear=LINEAR_ATTENTION.get(preset))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    spool = shm / f"dflash-bench-{preset}-{os.getpid()}"
    shutil.rmtree(spool, ignore_errors=True)
    plan = FillPlan(
        spool=str(spool),
        hidden_size=shape["hidden_size"],
        layer_ids=default_target_layer_ids(shape["num_target_layers"], 5),
        vocab_size=shape["vocab_size"],
        context_tokens=context,
        total_tokens=int((max_steps + 8) * context * 1.05),
        budget_bytes=int(1e15),  # pre-filled: every shard is written before training starts
        producers=producers,
        seed=0,  # the same data whatever the trainer's seed
        learnable=learnable,
        codec=codec,
    )
    Spool(spool)  # create the layout before the processes start
    filler = SpoolFiller(plan)
    t_fill = time.monotonic()
    written = filler.wait()
    return spool, target, plan, filler, written, time.monotonic() - t_fill


def train_counting_pairs(
    cfg: TrainConfig, *, device: str, count_steps: int
) -> tuple[Trainer, dict, list[float], float]:
    """The real Trainer's run, the mask's visible pairs counted in its first ``count_steps`` steps:
    (trainer, its summary, the pairs per step, seconds)."""
    t0 = time.monotonic()
    trainer = Trainer(cfg, device=device)
    pairs: list[float] = []
    train_step = trainer.train_step

    def counted_step(item, stats):  # instrumentation only: the mask's visible pairs, in the warm-up steps
        # (the batches are built in the data worker process or the input thread: counted here, on the
        # step's own device batch; the host sync this costs stays out of the timed steps)
        if not item.padding and trainer.step < count_steps:
            pairs.append(visible_pairs(item.batch, cfg.drafter.block_size))
        return train_step(item, stats)

    trainer.train_step = counted_step
    if os.environ.get("DFLASH_BENCH_PYSPY"):  # "delay_s:duration_s:out": sample every thread's stacks
        delay, duration, out = os.environ["DFLASH_BENCH_PYSPY"].split(":", 2)
        subprocess.Popen(
            [
                "bash",
                "-c",
                f"sleep {delay}; py-spy record --pid {os.getpid()} --duration {duration} "
                f"--rate 50 --format raw --nonblocking --threads -o {out} >/dev/null 2>&1",
            ]
        )
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    return trainer, summary, pairs, time.monotonic() - t0


def checkpoint_events(run_dir: Path) -> list[dict]:
    """Rank 0's checkpoint events (saved or failed) from its metrics file."""
    metrics_file = run_dir / "metrics" / "consumer-0.jsonl"
    if not metrics_file.exists():
        return []
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    return [
        {k: r.get(k) for k in ("event", "step", "stall_s", "write_s", "gb")}
        for r in records
        if r.get("event") in ("checkpoint", "checkpoint_failed")
    ]


def run_trainer(
    preset: str,
    *,
    steps: int,
    warmup: int,
    options: dict,
    precision: str,
    workdir: Path,
    save_every: int | None,
    learnable: bool = False,
    feed_only: bool = False,
    seed: int = 0,
    bucket: str = "random",
    producers: int = 12,
    codec: str | None = None,
) -> dict:
    """The real Trainer over a spool that producer processes filled; ``options``: the TrainConfig fields
    of the consumer's flags (``consumer_options``)."""
    context, anchors, device = options["context_tokens"], options["num_anchors"], options["device"]
    max_steps = warmup + steps
    spool, target, plan, filler, written, fill_s = prefill_spool(
        preset,
        workdir=workdir,
        context=context,
        max_steps=max_steps,
        producers=producers,
        learnable=learnable,
        codec=codec,
    )
    if feed_only:
        return feed_throughput(
            spool,
            plan,
            context=context,
            anchors=anchors,
            steps=max_steps,
            fill_s=fill_s,
            device=device,
            decode_threads=options.get("decode_threads"),
            pool_streams=options.get("pool_streams", 4),
        )
    run_dir = workdir / f"run-{preset}-{precision}-{int(time.time())}"
    ckpt = workdir / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    cfg = TrainConfig.from_flat(
        spool=str(spool),
        target=str(target),
        run="bench",
        run_dir=str(run_dir),
        store=str(ckpt) if save_every else None,
        save_every=save_every or 10**9,
        keep_last=1,
        max_steps=max_steps,
        total_steps=max_steps,
        precision=precision,
        seed=seed,
        bucket=bucket,
        **{k: v for k, v in options.items() if k != "device"},
    )
    try:
        trainer, summary, pairs, total_s = train_counting_pairs(
            cfg, device=device, count_steps=max(warmup, 3)
        )
    finally:
        filler.close()
        shutil.rmtree(spool, ignore_errors=True)
    history = summary["history"]
    save_steps = set(range(save_every, max_steps + 1, save_every)) if save_every else set()
    plain, with_save = _steady_intervals(history, from_step=warmup, save_steps=save_steps)
    step_s = statistics.median(p for p, _ in plain)
    all_steps = sum(n for _, n in plain + with_save)
    mean_all = sum(p * n for p, n in plain + with_save) / max(1, all_steps)
    flops = step_flops(
        trainer.drafter_config,
        context=context,
        anchors=anchors,
        visible_pairs=statistics.mean(pairs) if pairs else 0.0,
    )
    cuda = device.startswith("cuda")
    peak = matmul_peak_tflops(torch.device(device)) if cuda else float("nan")
    mem = [r["mem_gb"] for r in history if r["step"] >= warmup and "mem_gb" in r]
    fill = summary["fill"]
    return {
        "mode": "trainer (real Trainer over a real spool)",
        "preset": preset,
        "precision": precision,
        "seed": seed,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "context_tokens": context,
        "anchors": anchors,
        "steps_measured": steps,
        "ms_per_step_median": round(step_s * 1e3, 1),
        "ms_per_step_mean_incl_saves": round(mean_all * 1e3, 1),
        "context_tok_s": round(context / step_s),
        "real_tok_s": round(context * fill / step_s),
        "fill": round(fill, 4),
        "tflop_per_step": round(flops / 1e12, 2),
        "tflops": round(flops / step_s / 1e12, 1),
        "matmul_peak_tflops": round(peak, 1),
        "mfu": round(flops / step_s / 1e12 / peak, 3),
        "first_step_s": round(summary["first_step_s"], 1),
        "recompiles_after_warmup": summary["recompiles_after_warmup"],
        "peak_mem_gb_first": round(mem[0], 2) if mem else None,
        "peak_mem_gb_last": round(mem[-1], 2) if mem else None,
        "peak_mem_drift_pct": round(100 * (mem[-1] - mem[0]) / mem[0], 2) if mem else None,
        "checkpoints": checkpoint_events(run_dir),
        "stall_per_save_s_from_step_times": [round((p - step_s) * n, 2) for p, n in with_save],
        "losses": [(r["step"], round(r["loss"], 4)) for r in history],
        "ms_per_step_by_interval": [
            (b["step"], round(1e3 * (b["time"] - a["time"]) / (b["step"] - a["step"]), 1))
            for a, b in zip(history, history[1:], strict=False)
        ],
        "total_s": round(total_s, 1),
        "prefill_s": round(fill_s, 1),
        "prefill_tokens": written,
    }


def feed_throughput(
    spool: Path,
    plan: FillPlan,
    *,
    context: int,
    anchors: int,
    steps: int,
    fill_s: float,
    device: str = "cuda",
    decode_threads: int | None = None,
    pool_streams: int = 4,
) -> dict:
    """The data path alone (claim, decode, pack, anchors, pinned copy to the GPU; FP8 shards dequantized
    on the GPU after the copy), no training step: the steps it delivers per second, and each data
    thread's time per step by stage (consumer/data_clock.py), which says what bounds it."""
    import zarr

    from dflash.common.contract.spool import Spool
    from dflash.common.drafter.batch import build_draft_batch
    from dflash.consumer.data_clock import DataPathClock
    from dflash.consumer.feed import ShardFeed
    from dflash.consumer.input_pipeline import InputPipeline

    if decode_threads:  # as dflash-consume sets it (consumer/drafter_setup.py), before the first read
        zarr.config.set({"threading.max_workers": decode_threads})
    cuda = device.startswith("cuda")
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(device)
    clock = DataPathClock()
    feed = ShardFeed(
        Spool(spool),
        "probe",
        context_tokens=context,
        bucket="random",
        pin_memory=cuda,
        pool_streams=pool_streams,
        clock=clock.feed,
        packing_clock=clock.pipeline,
    )
    gen = torch.Generator().manual_seed(0)

    def build(packed):
        return build_draft_batch(
            packed,
            block_size=16,
            num_anchors=anchors,
            max_anchors_per_doc=anchors,
            mask_token_id=0,
            gamma=7.0,
            generator=gen,
        )

    pipe = InputPipeline(
        lambda w: feed.next_packed(wait_s=w),
        build,
        feed.exhausted,
        device=dev,
        hidden_dtype=torch.bfloat16,
        clock=clock.pipeline,
    )
    times, n = [], 0
    t = time.monotonic()
    t0 = t
    try:
        while n < steps:
            item = pipe.get(timeout=5.0)
            if item is None:
                if pipe.exhausted():
                    break
                continue
            if cuda:
                torch.cuda.current_stream().synchronize()
            feed.commit()
            n += 1
            now = time.monotonic()
            times.append(now - t)
            t = now
    finally:
        stages = clock.interval(n)  # each thread's ms per step by stage, over the whole run
        wall_s = time.monotonic() - t0
        pipe.close()
        feed.close()
        shutil.rmtree(spool, ignore_errors=True)
    step_s = statistics.median(times[5:]) if len(times) > 10 else float("nan")
    width, layers = plan.hidden_size * len(plan.layer_ids), len(plan.layer_ids)
    fp8 = bool(plan.codec) and CodecConfig.parse(plan.codec).fp8
    host_bytes = width + 2 * layers if fp8 else 2 * width  # what the host decodes, packs and copies per token
    return {
        "mode": "feed (data path only: claim, decode, pack, anchors, pinned copy; no step)",
        "codec": plan.codec or DEFAULT_CODEC_SPEC,
        "steps": n,
        "ms_per_step_median": round(step_s * 1e3, 1),
        "context_tok_s": round(context / step_s),
        "fill": round(feed.counters.tokens_packed / max(1, feed.counters.slots_packed), 4),
        "host_bytes_per_token": host_bytes,
        "hidden_gb_per_s": round(context * width * 2 / step_s / 1e9, 2),  # as bf16, whatever the codec
        "host_hidden_gb_per_s": round(context * host_bytes / step_s / 1e9, 2),
        "prefill_s": round(fill_s, 1),
        "decode_threads": decode_threads or "zarr default",
        "mean_ms_per_step": round(1e3 * wall_s / max(1, n), 1),
        "feed_thread_ms_per_step": stages["feed_ms"],
        "pipeline_thread_ms_per_step": stages["pipeline_ms"],
    }


# TrainConfig fields the bench sets itself: its spool, run and checkpoint folders, the steps it times, the
# sweeps over --precision and --seed, and each mode's claim order. Every other field is a flag of this
# script, named, typed, defaulted and documented as on dflash-consume (the flags are made from TrainConfig).
BENCH_SETS = (
    "spool",
    "target",
    "run",
    "run_dir",
    "store",
    "save_every",
    "keep_last",
    "max_steps",
    "total_steps",
    "precision",
    "seed",
    "bucket",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="trainer", choices=["trainer", "step", "learning", "reference", "feed"])
    p.add_argument(
        "--preset", action="append", choices=sorted(PRESETS), help="repeatable (default 8b and 32b)"
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20, help="trainer mode: steps before timing starts")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--precision", action="append", help="repeatable (default auto = what dflash-consume uses)"
    )
    p.add_argument("--save-every", type=int, default=100, help="trainer mode: checkpoint period (0 = none)")
    p.add_argument("--reference", default=None, help="folder holding ref_consumer_step.py: run it first")
    p.add_argument(
        "--reference-shape",
        default="32b",
        choices=REF_SHAPES,
        help="the reference step's drafter shape (its REF_SHAPE); only a preset of this shape gets a ratio",
    )
    p.add_argument(
        "--workdir", default=None, help="trainer mode: target/checkpoint folder (default: a temp dir)"
    )
    p.add_argument("--producers", type=int, default=12, help="processes pre-filling the spool")
    p.add_argument("--seed", type=int, action="append", help="trainer seed(s): init and anchors (default 0)")
    p.add_argument(
        "--save-runs",
        type=int,
        default=10**6,
        help="trainer mode: checkpoints in the first N runs only "
        "(a 32B-class final save writes ~31 GB: tens of seconds per run)",
    )
    p.add_argument("--json", default=None)
    p.add_argument(
        "--codec",
        default=None,
        help="the pre-filled spool's shard codec, e.g. fp8 or bf16 (default: the shard format's default)",
    )
    consumer = p.add_argument_group(
        "dflash-consume's options (shapes, loss, compile, loop); --max-anchors-per-doc "
        "follows --num-anchors unless given"
    )
    add_train_flags(consumer, exclude=BENCH_SETS, defaults={"max_anchors_per_doc": None})
    return p


def consumer_options(args: argparse.Namespace) -> dict:
    """The TrainConfig fields of the consumer's flags (and the bench's --device)."""
    names = train_flag_names() - set(BENCH_SETS)
    options = {k: getattr(args, k) for k in names if hasattr(args, k)}
    if options["num_anchors"] is None:  # the drafter architecture's default, as TrainConfig applies it
        options["num_anchors"] = ARCH_DEFAULTS[options.get("drafter_arch") or "dflash"]["num_anchors"]
    if options["max_anchors_per_doc"] is None:
        options["max_anchors_per_doc"] = options["num_anchors"]
    return {**options, "device": args.device}


def _run_one(
    args: argparse.Namespace, options: dict, preset: str, precision: str, seed: int, run_no: int
) -> dict:
    if args.mode == "step":
        device = torch.device(args.device)
        flags = {k: v for k, v in options.items() if k != "device"}
        backend = TrainConfig.from_flat(spool=".", target=".", **flags).compile_options.resolved_backend(
            device.type
        )
        r = run(
            preset,
            steps=args.steps,
            context=options["context_tokens"],
            anchors=options["num_anchors"],
            device=device,
            backend=backend,
            precision=precision,
        )
        r["mode"] = "step (hand-built batches, no feed/spool/input pipeline)"
        return r
    return run_trainer(
        preset,
        steps=args.steps,
        warmup=args.warmup,
        options=options,
        precision=precision,
        workdir=Path(args.workdir),
        producers=args.producers,
        seed=seed,
        save_every=args.save_every if args.mode == "trainer" and run_no < args.save_runs else None,
        learnable=args.mode == "learning",
        feed_only=args.mode == "feed",
        bucket="random" if args.mode == "trainer" else "oldest",
        codec=args.codec,
    )


COLUMNS = (
    "mode",
    "preset",
    "precision",
    "ms_per_step_median",
    "context_tok_s",
    "fill",
    "mfu",
    "vs_reference",
    "first_step_s",
    "recompiles_after_warmup",
    "peak_mem_drift_pct",
)


def main() -> None:
    args = build_parser().parse_args()
    options = consumer_options(args)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="dflash-bench-")
    results = []
    if args.reference:
        ref = run_reference(
            args.reference, options["context_tokens"], options["num_anchors"], shape=args.reference_shape
        )
        ref = {"mode": "reference", **ref}
        print(json.dumps(ref), flush=True)
        results.append(ref)
    runs = [(pr, sd) for pr in args.precision or ["auto"] for sd in args.seed or [0]]
    for preset in [] if args.mode == "reference" else args.preset or ["8b", "32b"]:
        for run_no, (precision, seed) in enumerate(runs):
            r = _run_one(args, options, preset, precision, seed, run_no)
            ref = results[0] if results and results[0]["mode"] == "reference" else None
            if ref and "context_tok_s" in r and ref.get("shape") == preset:  # a ratio at one shape only
                r["vs_reference"] = round(r["context_tok_s"] / ref["context_tok_s"], 3)
            print(json.dumps({k: v for k, v in r.items() if k != "losses"}), flush=True)
            results.append(r)
            torch._dynamo.reset()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in results:
        print("| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
