"""The demo's verdict: held-out τ of the untrained and the trained drafter, by real draft -> verify decoding.

Why not the trainer's in-loop τ: it is measured on the training batches themselves, per step, and swings
with which shard a step drew. Here both drafters decode the held-out documents the producers spooled
(never trained on) with ``dflash-eval``'s loop (common/drafter/dflash.py) against the target, so before and
after compare like with like, and the number is the acceptance length a user would get. The consumer's
decode-order τ (common/drafter/decode_tau.py) is logged on the same documents with the same budgets: the demo
prints both, equal when the answers are the target's own, the in-training one an estimate otherwise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dflash.common.contract.spool import Spool
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.decode_tau import first_response, read_held_out
from dflash.common.drafter.dflash import DrafterProposer, TargetRunner, speculative_generate
from dflash.common.drafter.hf_format import export_drafter
from dflash.common.drafter.model import initial_drafter
from dflash.common.drafter.report import summarize
from dflash.common.target.attach import load_exported_drafter
from dflash.common.target.head import load_target_head

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class HeldOutDocs:
    """The held-out documents as the producers spooled them (the spool's eval/ shards): each one's prompt
    (the tokens before its first answer) and the length of that answer, the decode budget. The consumer's
    in-training decode-order τ walks the same documents with the same budgets."""

    prompts: list[torch.Tensor]
    budgets: list[int]
    sample_ids: list[int]

    @classmethod
    def from_spool(cls, spool: Path) -> HeldOutDocs:

        prompts, budgets, ids = [], [], []
        for doc in read_held_out(Spool(spool, create=False).eval_shards()):
            span = first_response(doc.loss_mask)
            if span is None:
                continue
            prompts.append(torch.from_numpy(doc.input_ids[: span[0]]).long())
            budgets.append(span[1] - span[0])
            ids.append(doc.sample_index)
        return cls(prompts=prompts, budgets=budgets, sample_ids=ids)


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

    config = DrafterConfig.from_target_config(
        AutoConfig.from_pretrained(target),
        num_layers=num_layers,
        block_size=block_size,
        tokenizer=AutoTokenizer.from_pretrained(target),
    )
    head = load_target_head(str(target), dtype=torch.float32)
    config.target_fingerprint = head.fingerprint  # as the trainer records it
    with torch.random.fork_rng(devices=[]):  # the demo's own RNG state is not the trainer's business
        model = initial_drafter(config, head, seed=seed)
    return export_drafter(model.state_dict(), config, out, dtype=torch.float32, overwrite=True)


def evaluate_drafter(
    target_dir: Path,
    drafter_dir: Path,
    docs: HeldOutDocs,
    *,
    every_s: float = 5.0,
    say: Callable[[str], None] = print,
    label: str = "",
) -> EvalResult:
    """Greedy speculative decoding of every held-out prompt with `drafter_dir` against the target, each for
    its answer's length (no stop token: the in-training walk has none either); τ pooled over all verify
    steps, as dflash-eval reports it."""

    threads = torch.get_num_threads()
    # One thread: decoding is a chain of tiny matmuls; two threads on a busy 2-core box spin against each
    # other (see tests/test_evaluate.py) and the result is the same.
    torch.set_num_threads(1)
    try:
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        drafter = load_exported_drafter(drafter_dir, target, dtype=torch.float32)
        runner = TargetRunner(target, drafter.config.target_layer_ids)
        try:
            gens, said = [], time.monotonic()
            for i, (prompt, budget) in enumerate(zip(docs.prompts, docs.budgets, strict=True)):
                gens.append(
                    speculative_generate(runner, DrafterProposer(drafter), prompt, max_new_tokens=budget)
                )
                # a line every few seconds (every 8 prompts once left 10 s of silence on an untrained drafter)
                if time.monotonic() - said >= every_s or i + 1 == len(docs.prompts):
                    said = time.monotonic()
                    tau = summarize(gens, drafter.config.block_size).tau
                    say(f"[demo] held-out eval {label}: {i + 1}/{len(docs.prompts)} prompts, τ {tau:.2f}")
        finally:
            runner.close()
    finally:
        torch.set_num_threads(threads)
    report = summarize(gens, drafter.config.block_size)
    return EvalResult(
        tau=report.tau,
        prompts=len(gens),
        generated_tokens=report.generated_tokens,
        verify_steps=report.verify_steps,
        wall_s=sum(g.wall_s for g in gens),
    )
