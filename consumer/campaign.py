"""The learning-rate schedule and the campaign plan a consumer prints, sized from the data.

Why: the cosine schedule's length should be what the data gives (samples x epochs packed into streams of
``context_tokens`` on every rank), not a number the user guesses. The producers count it while they
tokenize (``state/campaign-n<node>.json``, see dflash.common.contract.epochs); a consumer reads it when its first
batch is ready (the file is written before any shard), every rank takes rank 0's reading so the group's
schedules cannot differ, and ``--total-steps`` (or ``--max-steps``) still overrides it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from dflash.common.contract.epochs import Campaign, Epochs

log = logging.getLogger(__name__)


class WarmupCosine:
    """LR factor: linear warm-up, then cosine decay to 0 (docs/architecture.md, the training recipe: 4 % warm-up, cosine).

    A callable object rather than a closure: LambdaLR saves its attributes in the scheduler's state (so
    ``tokens_done`` survives a resume), and the length can be set once the campaign is known.

    Two clocks. Given a length in steps (``--total-steps``, ``--max-steps``) the curve runs on steps. Sized
    from the data (``follow_tokens``) it runs on the tokens the group has trained: a resume with another
    world size (steps of another size) continues the same curve, the learning rate moving by at most one
    step's change at the resume, and a stream packed short does not push the decay to 0 while data is
    still coming (measured before, on steps: 52 of 663 demo steps at lr 0; a 2 -> 1 rank resume jumped
    4.2e-4 -> 5.2e-4). ``total_steps`` is then the estimate of the steps the rest of the data makes
    (``replan``): what the console and ETA show, never what sets the rate.
    """

    def __init__(self, warmup_steps: int, total_steps: int):
        self.warmup_steps, self.total_steps = max(1, warmup_steps), max(1, total_steps)
        self.tokens_done = 0
        """Tokens the group has trained (all ranks, every durable step of every launch)."""
        self.planned_tokens = 0
        """The campaign's tokens (all epochs); 0: the curve runs on steps."""
        self.warmup_tokens = 0
        self.step_tokens = 1
        """Tokens of one full step of this launch (context x world size)."""

    def resize(self, total_steps: int, warmup_ratio: float) -> None:
        self.total_steps = max(1, total_steps)
        self.warmup_steps = max(1, int(warmup_ratio * self.total_steps))

    def follow_tokens(self, planned_tokens: int, step_tokens: int) -> None:
        """Run the curve on tokens: ``planned_tokens`` in all, ``step_tokens`` a full step of this launch.
        The warm-up is the ``warmup_steps`` just sized (``resize``) in this launch's steps, kept in tokens
        from the first launch on: a resume in another world size warms up over the same tokens."""
        self.planned_tokens = max(1, planned_tokens)
        self.step_tokens = max(1, step_tokens)
        if not self.warmup_tokens:  # a fresh run (or a checkpoint from before the token clock)
            self.warmup_tokens = self.warmup_steps * self.step_tokens
        self.warmup_steps = max(1, -(-self.warmup_tokens // self.step_tokens))

    def replan(self, step: int, planned_tokens: int, tokens_per_step: int) -> None:
        """Length = the steps taken + the full streams the rest of the data makes (the estimate shown; on
        steps, also the curve's length). Replanned after every step from the group's token count, the
        decay ends with the data. The warm-up keeps its length."""
        left = max(0, planned_tokens - self.tokens_done)
        self.total_steps = max(1, step + -(-left // max(1, tokens_per_step)))

    def __call__(self, step: int) -> float:
        if self.planned_tokens:
            return self._on_tokens()
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def _on_tokens(self) -> float:
        """The factor of the next step from the tokens trained before it. Warm-up: as (step + 1) / warm-up
        steps, counted in tokens. Decay: never the plan's end before the data's: past the planned tokens
        (an estimate a little short) the factor stays that of the plan's last full step, never 0."""
        done = self.tokens_done
        if done < self.warmup_tokens:
            return min(1.0, (done + self.step_tokens) / self.warmup_tokens)
        span = max(1, self.planned_tokens - self.warmup_tokens)
        last = max(0.0, 1.0 - self.step_tokens / span)  # the progress at the start of the plan's last step
        progress = min((done - self.warmup_tokens) / span, last)
        return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class CampaignPlan:
    """What a consumer group will train: the data's size, its epochs and the steps they make."""

    campaign: Campaign
    epochs: Epochs
    context_tokens: int
    world_size: int

    @property
    def steps_per_epoch(self) -> int:
        return self.campaign.steps_per_epoch(self.context_tokens, self.world_size)

    @property
    def total_steps(self) -> int:
        return self.campaign.total_steps(self.context_tokens, self.world_size)

    def describe(
        self,
        warmup_steps: int,
        *,
        override: str | None = None,
        total_steps: int | None = None,
        resumed: int = 0,
    ) -> str:
        """One line; ``total_steps`` is the schedule's own count (a resume: the steps taken + those the rest
        of the data makes at this world size), so the number printed is the one the run uses."""
        c = self.campaign
        total = total_steps if total_steps is not None else self.total_steps
        line = (
            f"campaign: {c.samples} samples x {c.epochs} epoch(s), {c.tokens} tokens/epoch ({c.loss_tokens} "
            f"supervised); {self.steps_per_epoch} steps/epoch at {self.context_tokens} tokens x "
            f"{self.world_size} rank(s) = {total} steps, warm-up {warmup_steps}"
        )
        if resumed and not override:
            line += f"; resumed at step {resumed}, {max(0, total - resumed)} steps left at this world size"
        return line + (f"; schedule length {override} (override)" if override else "")


def read_plan(spool, *, context_tokens: int, world_size: int) -> CampaignPlan | None:
    """The plan from the spool's run record and campaign files (None while producers have not written
    them: a spool bound by consumers only, or producers of an older version)."""
    run = spool.read_run() or {}
    states = spool.read_campaign()
    if "plan" not in run or not states:
        return None
    epochs = Epochs.from_plan(run["plan"])
    return CampaignPlan(
        campaign=Campaign.from_states(states, epochs.epochs),
        epochs=epochs,
        context_tokens=context_tokens,
        world_size=world_size,
    )


def eta_s(step: int, total_steps: int, step_s: float) -> float | None:
    """Seconds left at ``step_s`` per step (None past the planned end or without a rate)."""
    if step_s <= 0 or step >= total_steps:
        return None
    return (total_steps - step) * step_s
