"""The campaign plan a consumer prints and sizes its learning-rate schedule from (``schedule.py``).

Why: the cosine schedule's length should be what the data gives (samples x epochs packed into streams of
``context_tokens`` on every rank), not a number the user guesses. The producers count it while they
tokenize (``state/campaign-n<node>.json``, see dflash.common.contract.epochs); a consumer reads it when its first
batch is ready (the file is written before any shard; a spool whose producers recorded a plan but not yet
its campaign is waited for: Trainer._await_campaign), every rank takes rank 0's reading so the group's
schedules cannot differ, and ``--total-steps`` (or ``--max-steps``) still overrides it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dflash.common.contract.epochs import Campaign, Epochs

log = logging.getLogger(__name__)


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

    def progress_fields(self, *, step: int, epoch: int, total_steps: int, step_s: float) -> dict:
        """epoch k/N, the planned steps and the ETA at ``step_s`` per step (a log line's campaign part)."""
        out = {"epoch": epoch + 1, "epochs": self.epochs.epochs, "total_steps": total_steps}
        eta = eta_s(step, total_steps, step_s)
        return {**out, "eta_s": eta} if eta is not None else out

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
