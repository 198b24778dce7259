"""The learning rate of every step: a linear warm-up / cosine curve (``WarmupCosine``) behind one small
object (``LrSchedule``) that the trainer, its checkpoints and its log lines reach it through.

Why one object: torch's ``LambdaLR`` keeps the curve in ``lr_lambdas[0]`` and the rate it last set in a
private field; the trainer needs to count tokens into the curve, size it from the data at the first step
and read the rate for its log line. ``LrSchedule`` says those three things in its own words, and the
checkpoint still stores ``LambdaLR``'s state (the curve's attributes included), so old checkpoints load.
"""

from __future__ import annotations

import math

import torch


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

    def add_tokens(self, tokens: int) -> None:
        """Tokens the group trained (all ranks), counted before the step they set the rate of."""
        self.tokens_done += tokens

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


class LrSchedule:
    """``LambdaLR`` over a ``WarmupCosine``: the rate each ``step()`` sets, the token count behind it, and
    the campaign's sizing (``size_from_data``) that a resume or a short stream keeps right (``replan``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int) -> None:
        self.curve = WarmupCosine(warmup_steps, total_steps)
        self._optimizer = optimizer
        self._scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.curve)
        self._planned_tokens: int | None = None  # set when the data sized the curve in this launch
        self._step_tokens = 1

    @property
    def total_steps(self) -> int:
        return self.curve.total_steps

    @property
    def warmup_steps(self) -> int:
        return self.curve.warmup_steps

    @property
    def on_steps(self) -> bool:
        """The curve runs on steps (a length given by flag, or no campaign), not on the data's tokens."""
        return not self.curve.planned_tokens

    @property
    def lr(self) -> float:
        """The rate the next optimizer step uses (the first parameter group's)."""
        return self._optimizer.param_groups[0]["lr"]

    def count_tokens(self, tokens: int) -> None:
        """A step's tokens (all ranks) into the curve's count, before the step: ``step()`` sets the next
        step's rate from it. Every rank adds the same sums, so every rank computes the same rate."""
        self.curve.add_tokens(tokens)

    def step(self) -> None:
        self._scheduler.step()

    def size_from_data(
        self, total_steps: int, warmup_ratio: float, planned_tokens: int, step_tokens: int, *, step: int
    ) -> None:
        """The campaign's length sizes the curve, which then runs on tokens (``WarmupCosine.follow_tokens``);
        a resumed run (``step`` > 0) gets the rest of the data's steps; this step's rate follows at once."""
        self.curve.resize(total_steps, warmup_ratio)
        self.curve.follow_tokens(planned_tokens, step_tokens)
        self._planned_tokens, self._step_tokens = planned_tokens, step_tokens
        if step:  # resumed: the rest of the data from what the checkpoint trained
            if not self.curve.tokens_done:  # a checkpoint from before the count: full streams, as planned
                self.curve.add_tokens(step * step_tokens)
            self.replan(step)
        self._set_rate()  # this step's factor, resized

    def fit_length(self, total_steps: int, warmup_ratio: float, *, step: int) -> str | None:
        """Run the curve on steps over ``total_steps`` (a length given by flag, or the default), the
        current rate set at once; a phrase saying what changed, None when the curve already was that.

        Why: a checkpoint's schedule state carries its curve, length included, so a run extended by a
        larger ``--max-steps`` / ``--total-steps`` would otherwise keep the old length and train every
        further step at lr 0 (its samples used up with no learning). The new curve is the one a fresh run
        of this length has, at this step: the rate the extension continues at is that curve's, never 0."""
        curve = self.curve
        if not curve.planned_tokens and curve.total_steps == total_steps:
            return None
        was = (
            f"the checkpoint's curve ran on the data's tokens (~{curve.total_steps} steps)"
            if curve.planned_tokens
            else f"the checkpoint's curve was {curve.total_steps} steps"
        )
        before = self.lr
        curve.planned_tokens = 0
        curve.resize(total_steps, warmup_ratio)
        self._planned_tokens = None
        self._set_rate()
        return (
            f"{was} (lr {before:.3g} at step {step}); re-planned over {total_steps} steps from step {step}: "
            f"warm-up {curve.warmup_steps}, cosine to 0 at step {total_steps}, step {step + 1} at lr "
            f"{self.lr:.3g}"
        )

    def _set_rate(self) -> None:
        """The rate of the next step from the curve as it is now (after resizing it)."""
        factor = self.curve(self._scheduler.last_epoch)
        for group, base in zip(self._optimizer.param_groups, self._scheduler.base_lrs, strict=True):
            group["lr"] = base * factor

    def replan(self, step: int) -> None:
        """After a step, when the data sized the curve: keep its estimated length right
        (``WarmupCosine.replan``); a length given by flag stays as given."""
        if self._planned_tokens is not None:
            self.curve.replan(step, self._planned_tokens, self._step_tokens)

    def state_dict(self) -> dict:
        return self._scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """``LambdaLR``'s state: also the curve's attributes (its token count and length)."""
        self._scheduler.load_state_dict(state)
