"""What every rank of a consumer group decides together before a step, from one small host-side
collective (a gloo all-gather of a few ints, well under a millisecond, never waiting for the GPU): whether
anyone has data, whether everyone is drained, a stop, a fatal save error, and the step's epoch and tokens.

Both ends are here: ``RankView.encode`` is what a rank sends, ``RankView.decode`` and ``StepAgreement.of``
what every rank makes of the gathered views, so the layout of the ints is written in one place.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass


@dataclass(frozen=True)
class RankView:
    """What one rank brings to the agreement."""

    has_step: bool
    drained: bool
    """No more data will come to this rank (its feed is exhausted, nothing held back)."""
    stop_asked: bool
    """A signal asked this rank to stop."""
    save_failed: bool
    """A save failed with no checkpoint to fall back on, or the store's outage passed its bound."""
    epoch: int = -1
    """The campaign epoch of the step this rank holds (-1 without one)."""
    tokens: int = 0
    """The tokens of the step this rank holds."""
    starved: bool = False
    """No step here and none coming soon: no live producer produces (each is done, gone, or waiting on the
    spool budget, which the other ranks' held steps count against)."""

    def encode(self) -> list[int]:
        """The ints this rank sends, in field order."""
        return [int(v) for v in astuple(self)]

    @classmethod
    def decode(cls, ints: list[int]) -> RankView:
        """A view from the ints ``encode`` made (on any rank)."""
        has_step, drained, stop_asked, save_failed, epoch, tokens, starved = ints
        return cls(
            bool(has_step),
            bool(drained),
            bool(stop_asked),
            bool(save_failed),
            int(epoch),
            int(tokens),
            bool(starved),
        )


@dataclass(frozen=True)
class StepAgreement:
    """The ranks' joint view before a step."""

    have: bool  # some rank holds a step
    everyone: bool
    """Every rank holds a step, has no more data, or can get none soon (starved): stepping now wastes no
    slot that waiting would fill. Why the starved: a rank waiting for a shard while the only producers
    left wait on the spool budget that the others' held steps fill would wait for ever (a producer worker
    killed at start-up left one producer, its one shard in flight claimed by the other rank: the launch
    hung at 0 tok/s)."""
    exhausted: bool
    stop: bool
    fatal: bool
    epoch: int
    tokens: int

    @classmethod
    def of(cls, gathered: list[list[int]], *, last_epoch: int) -> StepAgreement:
        """From every rank's encoded ``RankView``: only the ranks whose step is of the lowest epoch train data
        this step (the others pad and keep theirs), and the step's epoch stays the last one when no rank
        has data."""
        ranks = [RankView.decode(r) for r in gathered]
        epochs = [r.epoch for r in ranks if r.has_step]
        lowest = min(epochs) if epochs else last_epoch
        return cls(
            have=any(r.has_step for r in ranks),
            everyone=all(r.has_step or r.drained or r.starved for r in ranks),
            exhausted=all(r.drained for r in ranks),
            stop=any(r.stop_asked for r in ranks),
            fatal=any(r.save_failed for r in ranks),
            epoch=lowest,
            tokens=sum(r.tokens for r in ranks if r.has_step and r.epoch == lowest),
        )
