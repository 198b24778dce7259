"""The decode-order τ on the held-out documents, measured while training: before the first step, every
``--eval-every`` steps and after the last (rank 0 only; the other ranks wait at the next collective).

Why a budget: walking every held-out document through the drafter costs time the GPU is not training, so a
periodic evaluation that would take the evaluations past ``--eval-budget`` of the run's time is skipped
and said; the first and the last always run (they are the run's before and after). The walk itself is the
drafter's (common/drafter/decode_tau.py) and runs eagerly, so it never recompiles the training graphs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from torch import nn

from dflash.common.contract.spool import Spool
from dflash.common.drafter.decode_tau import HeldOutDoc, decode_order_tau, read_held_out
from dflash.common.metrics import MetricsLog

log = logging.getLogger(__name__)


@dataclass
class EvalBudget:
    """The periodic evaluations' share of a run's time (``--eval-budget``, 3 % by default): one runs only
    when it, priced at what the last one took, keeps the evaluations within ``share`` of the time elapsed.
    The first and the last evaluation of a run are not asked: they are its before and after."""

    share: float
    spent_s: float = 0.0
    last_s: float | None = None

    def allows(self, elapsed_s: float) -> bool:
        return self.last_s is None or self.spent_s + self.last_s <= self.share * elapsed_s

    def add(self, took_s: float) -> None:
        self.spent_s += took_s
        self.last_s = took_s


class HeldOutEval:
    """The held-out documents of a spool's eval/ shards and the evaluations of one training process."""

    def __init__(self, spool: Spool, *, budget: float, metrics: MetricsLog | None, wandb=None) -> None:
        self.spool, self.metrics, self.wandb = spool, metrics, wandb
        self.budget = EvalBudget(budget)
        self.last_step: int | None = None
        """The step last evaluated (a skipped evaluation does not count: the last step still runs)."""
        self._docs: list[HeldOutDoc] = []
        self._shards = 0
        self._t0 = time.monotonic()

    def docs(self) -> list[HeldOutDoc]:
        """The held-out documents (re-read when more eval shards have landed)."""
        shards = self.spool.eval_shards()
        if len(shards) != self._shards:
            self._docs = read_held_out(shards)
            self._shards = len(shards)
        return self._docs

    def evaluate(
        self, model: nn.Module, step: int, *, in_loop_tau: float | None, periodic: bool = False
    ) -> None:
        """Walk every held-out document (nothing when producers spool none: --eval-samples 0); a periodic
        evaluation over the budget is skipped. Logs one line and writes an ``eval`` metrics event."""
        docs = self.docs()
        if not docs:
            return
        if periodic and not self.budget.allows(time.monotonic() - self._t0):
            log.info(
                "eval step %d skipped: evaluations would take more than %.0f%% of the run (--eval-budget)",
                step,
                100 * self.budget.share,
            )
            return
        self.last_step = step
        t0 = time.monotonic()
        report = decode_order_tau(model, docs)
        took = time.monotonic() - t0
        self.budget.add(took)
        rec = {
            "event": "eval",
            "time": time.time(),
            "step": step,
            "decode_tau": report.tau,
            "accept_rate": report.accept_rate,
            "eval_docs": report.prompts,
            "verify_steps": report.verify_steps,
            "eval_s": took,
            "in_loop_tau": in_loop_tau,
        }
        if self.metrics:
            self.metrics.write(rec)
        if self.wandb is not None:
            self.wandb.log({"decode_tau": report.tau}, step=step)
        loop = f", in-loop τ {in_loop_tau:.2f}" if in_loop_tau is not None else ""
        share = self.budget.spent_s / max(1e-9, time.monotonic() - self._t0)
        log.info(
            "eval step %d: decode-order τ %.2f on %d held-out docs%s (%.1f s; evaluation %.1f%% of the run)",
            step,
            report.tau,
            report.prompts,
            loop,
            took,
            100 * share,
        )
