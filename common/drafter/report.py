"""What a decode is worth: τ, acceptance per block position, speed (``EvalReport``, ``summarize``).

τ = tokens emitted per verify step (accepted drafts + bonus, cut at a stop token or the length budget), pooled
over all steps of all prompts: the public DFlash benchmark's "acceptance length". Per block it is the trainer's
`tau`; the trainer averages it over uniformly sampled anchors, decoding over the anchors it visits, which
weighs easy stretches less (docs/export-and-eval.md: why the trainer's number is higher). The decoding itself
is dflash.common.drafter.dflash (``speculative_generate``); this module only counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dflash.common.drafter.dflash import Generation, Sampling


@dataclass(kw_only=True)
class EvalReport:
    prompts: int
    block_size: int
    generated_tokens: int
    verify_steps: int
    tau: float
    """Tokens per verify step (accepted + bonus), pooled over all steps."""
    tau_per_prompt: list[float]
    accept_rate: list[float]
    """[B]: index k = fraction of verify steps whose draft position k was accepted (index 0 = the anchor)."""
    accept_length_hist: list[int]
    """[B+1]: verify steps by tokens emitted."""
    target_forwards_per_token: float
    wall_s: float
    tokens_per_s: float
    baseline: dict | None = None
    outputs: list[list[int]] = field(default_factory=list)
    """Generated token ids per prompt (prompt excluded)."""
    sampling: dict | None = None
    """None: greedy; else temperature, top_p and how drafts were made (the acceptance above is then that of
    speculative rejection sampling: a draft is accepted with probability min(1, p/q))."""


def summarize(
    gens: Sequence[Generation],
    block_size: int,
    baseline: Sequence[Generation] | None = None,
    *,
    sampling: Sampling | None = None,
) -> EvalReport:
    """Pool the verify steps of ``gens``; with ``baseline`` (the same prompts decoded without a drafter) the
    speed-up and, greedy, how many prompts' outputs differ (sampled outputs differ by chance: None)."""
    sampled = sampling is not None and not sampling.greedy
    steps = [s for g in gens for s in g.steps]
    tokens = sum(len(g.tokens) for g in gens)
    wall = sum(g.wall_s for g in gens)
    drafted = [sum(1 for b, _, _ in steps if b - 1 >= k) for k in range(block_size)]
    accepted = [sum(1 for _, a, _ in steps if a >= k) for k in range(block_size)]
    hist = [0] * (block_size + 1)
    for _, _, n in steps:
        hist[n] += 1
    report = EvalReport(
        prompts=len(gens),
        block_size=block_size,
        generated_tokens=tokens,
        verify_steps=len(steps),
        tau=sum(n for _, _, n in steps) / max(1, len(steps)),
        tau_per_prompt=[sum(n for _, _, n in g.steps) / max(1, len(g.steps)) for g in gens],
        accept_rate=[1.0] + [accepted[k] / drafted[k] if drafted[k] else 0.0 for k in range(1, block_size)],
        accept_length_hist=hist,
        target_forwards_per_token=sum(g.target_forwards for g in gens) / max(1, tokens),
        wall_s=wall,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        outputs=[list(g.tokens) for g in gens],
        sampling={"temperature": sampling.temperature, "top_p": sampling.top_p, "draft": sampling.draft}
        if sampled
        else None,
    )
    if baseline is not None:
        base_tokens = sum(len(g.tokens) for g in baseline)
        base_wall = sum(g.wall_s for g in baseline)
        base_tps = base_tokens / base_wall if base_wall > 0 else 0.0
        report.baseline = {
            "tokens_per_s": base_tps,
            "wall_s": base_wall,
            "speedup": report.tokens_per_s / base_tps if base_tps else 0.0,
            "mismatched_prompts": None
            if sampled
            else sum(g.tokens != b.tokens for g, b in zip(gens, baseline, strict=True)),
        }
    return report
