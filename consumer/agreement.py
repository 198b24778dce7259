"""What every rank of a consumer group decides together before a step, from one small host-side
collective (a gloo all-gather of a few ints, well under a millisecond, never waiting for the GPU): whether
anyone has data, whether everyone is drained, a stop, a fatal save error, and the step's epoch and tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepAgreement:
    """The ranks' joint view before a step."""

    have: bool  # some rank holds a step
    everyone: bool  # every rank holds a step or has no more data: stepping wastes no rank's slot
    exhausted: bool
    stop: bool
    fatal: bool
    epoch: int
    tokens: int

    @classmethod
    def of(cls, ranks: list[list[int]], *, last_epoch: int) -> StepAgreement:
        """From every rank's [has a step, drained, stop asked, fatal save error, its step's epoch, its
        tokens]: only the ranks whose step is of the lowest epoch train data this step
        (the others pad and keep theirs), and the step's epoch stays the last one when no rank has data."""
        epochs = [r[4] for r in ranks if r[0]]
        lowest = min(epochs) if epochs else last_epoch
        return cls(
            have=any(r[0] for r in ranks), everyone=all(r[0] or r[1] for r in ranks),
            exhausted=all(r[1] for r in ranks), stop=any(r[2] for r in ranks), fatal=any(r[3] for r in ranks),
            epoch=lowest, tokens=sum(r[5] for r in ranks if r[0] and r[4] == lowest),
        )  # fmt: skip
