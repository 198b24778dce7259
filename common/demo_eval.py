"""The demo's verdict: held-out τ of the untrained and the trained drafter, by real draft -> verify decoding.

Why not the trainer's τ: it is measured on the training batches themselves, per step, and swings with
which shard a step drew. Here both drafters decode the same held-out prompts (never trained on) with
``dflash-eval``'s loop (consumer/evaluate.py) against the target, so before and after compare like with
like, and the number is the acceptance length a user would get.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class HeldOutEval:
    """Where and how to evaluate."""

    target: Path
    prompts: Path
    """JSONL of held-out conversations; their prompts (up to the first assistant turn) are decoded."""
    num_prompts: int
    max_new_tokens: int
    chunk: int = 8
    """Prompts per progress line."""


@dataclass(kw_only=True)
class EvalResult:
    tau: float
    prompts: int
    generated_tokens: int
    verify_steps: int
    wall_s: float


def export_initial_drafter(
    target: Path, out: Path, *, seed: int = 0, num_layers: int = 5, block_size: int = 16
) -> Path:
    """Export the drafter a fresh ``dflash-consume --seed <seed>`` run starts from (fp32), so the
    untrained drafter is evaluated by the same loader and loop as the trained one."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash.consumer.drafter import DrafterConfig, load_target_head
    from dflash.consumer.export import export_drafter
    from dflash.consumer.trainer import initial_drafter

    config = DrafterConfig.from_target_config(
        AutoConfig.from_pretrained(target),
        num_layers=num_layers,
        block_size=block_size,
        tokenizer=AutoTokenizer.from_pretrained(target),
    )
    with torch.random.fork_rng(devices=[]):  # the demo's own RNG state is not the trainer's business
        model = initial_drafter(config, load_target_head(str(target), dtype=torch.float32), seed=seed)
    return export_drafter(model.state_dict(), config, out, dtype=torch.float32, overwrite=True)


def evaluate_drafter(
    cfg: HeldOutEval, drafter_dir: Path, *, say: Callable[[str], None] = print, label: str = ""
) -> EvalResult:
    """Greedy speculative decoding of the held-out prompts with `drafter_dir`; τ pooled over all steps."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.consumer.evaluate import evaluate, load_prompts, stop_tokens
    from dflash.consumer.export import load_exported_drafter

    threads = torch.get_num_threads()
    # One thread: decoding is a chain of tiny matmuls; two threads on a busy 2-core box spin against each
    # other (see tests/test_evaluate.py) and the result is the same.
    torch.set_num_threads(1)
    try:
        tok = AutoTokenizer.from_pretrained(cfg.target)
        target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32).eval()
        drafter = load_exported_drafter(drafter_dir, target, dtype=torch.float32)
        prompts = load_prompts(str(cfg.prompts), tok, num_prompts=cfg.num_prompts)
        stop = stop_tokens(tok, target)
        emitted = steps = tokens = 0
        wall = 0.0
        for i in range(0, len(prompts), cfg.chunk):
            r = evaluate(
                target,
                drafter,
                prompts[i : i + cfg.chunk],
                max_new_tokens=cfg.max_new_tokens,
                stop_token_ids=stop,
            )
            emitted += round(r.tau * r.verify_steps)
            steps, tokens, wall = steps + r.verify_steps, tokens + r.generated_tokens, wall + r.wall_s
            say(
                f"[demo] held-out eval {label}: {min(i + cfg.chunk, len(prompts))}/{len(prompts)} prompts, τ {emitted / max(1, steps):.2f}"
            )
    finally:
        torch.set_num_threads(threads)
    return EvalResult(
        tau=emitted / max(1, steps),
        prompts=len(prompts),
        generated_tokens=tokens,
        verify_steps=steps,
        wall_s=wall,
    )
