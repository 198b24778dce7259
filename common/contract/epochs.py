"""Epochs of a run: what a sample id names, the order of each epoch, and the campaign's size.

Why one integer per (epoch, row): everything that guarantees exactly-once (the trained-sample set in
checkpoints, the producers' skip set, the consumers' duplicate check, the sample ledger) works on sample
ids. Naming the k-th training of dataset row r by ``id = k * rows + r`` gives every epoch its own ids, so
those guarantees hold per epoch with no second mechanism, and a one-epoch run keeps ``id == row``.
A row may give several samples (a multi-turn chat whose template renders history unlike generation:
common/target/chat.py); its s-th sample (s >= 1) takes ``id = (s * epochs + k) * rows + r``, above every
first sample's id, so rows that give one sample keep their ids and every sample's id is unique and stable.

The order of epoch k is a permutation of the rows drawn from (seed, k): reproducible from the run's
record, different every epoch. Producers keep their slice of rows (row % world == rank, so each tokenizes
its rows once) and walk it in the epoch's order; the next epoch starts when a producer's slice of this one
is done, so production of epoch k+1 overlaps the end of epoch k.

Held-out rows (``eval_samples``, drawn by the seed) are never trained in any epoch; producers spool their
hidden states once per campaign into the spool's eval/ folder, which no trainer claims (consumers read them
for the decode-order τ, common/drafter/decode_tau.py).

The campaign (what the data gives: samples, tokens, supervised tokens per epoch) is counted by the
producers while they tokenize and published in the spool (``state/campaign-n<node>.json``); consumers
read it to print the plan and size the learning-rate schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CAMPAIGN_STATE = "campaign"  # spool state name prefix: state/campaign-n<node>.json


@dataclass(frozen=True)
class Epochs:
    """The sample-id layout of a run: ``rows`` dataset rows trained ``epochs`` times, shuffled by ``seed``."""

    rows: int
    epochs: int = 1
    seed: int = 0
    eval_samples: int = 0
    """Rows held out for evaluation (drawn by ``seed``, never trained, spooled once per campaign)."""

    def __post_init__(self) -> None:
        if self.rows < 0:
            raise ValueError(f"rows must be >= 0, got {self.rows}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if not 0 <= self.eval_samples < max(self.rows, 1):
            raise ValueError(
                f"eval samples must be in [0, {self.rows}) for {self.rows} rows, got {self.eval_samples}"
            )

    @classmethod
    def from_plan(cls, plan: dict) -> Epochs:
        """From the run record's plan (state/run.json ``plan``: rows, epochs, shuffle_seed, eval_samples)."""
        return cls(
            rows=int(plan["rows"]),
            epochs=int(plan.get("epochs", 1)),
            seed=int(plan.get("shuffle_seed", 0)),
            eval_samples=int(plan.get("eval_samples", 0)),
        )

    def held_out(self) -> np.ndarray:
        """The held-out rows, sorted; their sample ids are the rows themselves (epoch 0's ids, never trained)."""
        rng = np.random.default_rng([self.seed, 1 << 30])  # a stream no epoch order uses
        return np.sort(rng.permutation(self.rows)[: self.eval_samples]).astype(np.int64)

    @property
    def num_ids(self) -> int:
        """Ids of the rows' first samples (a row's further samples have ids above these)."""
        return self.rows * self.epochs

    def ids(self, epoch: int, rows: np.ndarray, segments: np.ndarray | None = None) -> np.ndarray:
        """Sample ids of ``rows`` in ``epoch``; ``segments``: which sample of its row each is (default 0)."""
        if not 0 <= epoch < self.epochs:
            raise ValueError(f"epoch {epoch} not in [0, {self.epochs})")
        ids = np.asarray(rows, dtype=np.int64) + epoch * self.rows
        if segments is not None:
            ids = ids + np.asarray(segments, dtype=np.int64) * self.num_ids
        return ids

    def epoch_of(self, ids) -> np.ndarray:
        return (np.asarray(ids, dtype=np.int64) // max(self.rows, 1)) % self.epochs

    def row_of(self, ids) -> np.ndarray:
        return np.asarray(ids, dtype=np.int64) % max(self.rows, 1)

    def segment_of(self, ids) -> np.ndarray:
        """Which sample of its row an id names (0 for a row's first or only sample)."""
        return np.asarray(ids, dtype=np.int64) // max(self.num_ids, 1)

    def order(self, epoch: int) -> np.ndarray:
        """The rows in epoch ``epoch``'s order (a permutation drawn from (seed, epoch))."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.rows).astype(np.int64)

    def slice_order(self, epoch: int, mine: np.ndarray) -> np.ndarray:
        """Positions into ``mine`` (a producer's rows, any order) that walk them in ``epoch``'s order."""
        rank = np.empty(self.rows, dtype=np.int64)
        rank[self.order(epoch)] = np.arange(self.rows, dtype=np.int64)
        return np.argsort(rank[np.asarray(mine, dtype=np.int64)], kind="stable")


@dataclass(frozen=True)
class Campaign:
    """What the data gives per epoch, summed over every producer of every node."""

    epochs: int
    samples: int
    """Trainable samples per epoch (dataset rows the producers keep)."""
    tokens: int
    """Tokens of those samples per epoch (what the consumers pack into streams)."""
    loss_tokens: int
    """Supervised (assistant) tokens per epoch."""

    @classmethod
    def from_states(cls, states: list[dict], epochs: int) -> Campaign:
        return cls(
            epochs=epochs,
            samples=sum(int(s["samples"]) for s in states),
            tokens=sum(int(s["tokens"]) for s in states),
            loss_tokens=sum(int(s["loss_tokens"]) for s in states),
        )

    def steps_per_epoch(self, context_tokens: int, world: int) -> int:
        """Optimizer steps one epoch makes: every rank packs ``context_tokens`` per step (documents split
        across streams, so streams are full but for the last ones)."""
        return max(1, math.ceil(self.tokens / (context_tokens * world)))

    def total_steps(self, context_tokens: int, world: int) -> int:
        """Steps of the whole campaign: epochs overlap (streams mix the end of one with the start of the
        next), so the campaign is rounded up once, not once per epoch."""
        return max(1, math.ceil(self.tokens * self.epochs / (context_tokens * world)))
