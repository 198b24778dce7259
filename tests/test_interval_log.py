"""``IntervalLogger`` in-process: it decides when to log (``--log-every``), turns an interval's sums into
one record with the campaign's epoch and ETA, writes it to its sinks (rank 0) and keeps the heartbeat's
training counters current; nothing is written for an empty interval."""

from __future__ import annotations

import logging

import pytest
import torch
from ledger_audit import read_jsonl

from dflash.common.contract.epochs import Campaign, Epochs
from dflash.common.metrics import MetricsLog
from dflash.consumer.campaign import CampaignPlan
from dflash.consumer.checkpointing.state import TrainProgress, TrainState
from dflash.consumer.config import LogConfig
from dflash.consumer.distributed import DistInfo
from dflash.consumer.interval_log import IntervalLogger
from dflash.consumer.loop_watch import LoopWatch
from dflash.consumer.schedule import LrSchedule
from dflash.consumer.step import StepStats

CPU = torch.device("cpu")
BLOCK = 4


class _Heartbeat:
    """The part of ``ConsumerHeartbeat`` the logger uses: the counters it is handed, the spool it saw."""

    def __init__(self) -> None:
        self.counters: dict = {}
        self.spool_summary = {"spool_shards": 3}

    def update(self, **counters) -> None:
        self.counters.update(counters)


class _Wandb:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []

    def log(self, rec: dict, *, step: int) -> None:
        self.logged.append((rec, step))


def _logger(tmp_path, *, rank: int = 0, wandb=None) -> tuple[IntervalLogger, _Heartbeat]:
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=1e-3)
    state = TrainState(p, optimizer, LrSchedule(optimizer, 1, 100), None, TrainProgress(step=20, epoch=1))
    state.progress.trained.add(range(30))
    heartbeat = _Heartbeat()
    dist = DistInfo(rank=rank, world_size=1, local_rank=0, device=CPU)
    logger = IntervalLogger(
        LogConfig(log_every=10),
        state,
        block_size=BLOCK,
        context_tokens=64,
        dist=dist,
        device=CPU,
        watch=LoopWatch(CPU),
        heartbeat=heartbeat,
        metrics=MetricsLog(tmp_path / "metrics.jsonl"),
        wandb=wandb,
    )
    return logger, heartbeat


def _stats(steps: int = 2) -> StepStats:
    """Two steps' sums: loss 3.0 over weight 2, 3 of 4 predictions right after the anchor, τ 2.5."""
    return StepStats(
        loss_sum=torch.tensor(6.0),
        weight_sum=2.0,
        correct=torch.tensor([8, 3, 3, 3]),
        valid=torch.tensor([8, 4, 4, 4]),
        tau_sum=torch.tensor(10.0),
        blocks=4,
        tokens=96,
        samples=5,
        steps=steps,
        grad_norm=torch.tensor(0.5),
    )


def test_it_logs_every_log_every_steps(tmp_path):
    logger, _ = _logger(tmp_path)
    assert [s for s in range(1, 31) if logger.due(s)] == [10, 20, 30]


def test_a_record_says_the_interval_and_the_campaign_and_goes_to_every_sink(tmp_path, caplog):
    wandb = _Wandb()
    logger, heartbeat = _logger(tmp_path, wandb=wandb)
    plan = CampaignPlan(
        Campaign(epochs=3, samples=10, tokens=640, loss_tokens=600), Epochs(rows=10, epochs=3), 64, 1
    )
    with caplog.at_level(logging.INFO, logger="dflash.consumer.interval_log"):
        logger.log(_stats(), plan)
    (rec,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert rec["step"] == 20 and rec["loss"] == pytest.approx(3.0) and rec["tau"] == pytest.approx(2.5)
    assert rec["acc"] == pytest.approx(0.75) and rec["acc_per_pos"] == pytest.approx([1.0, 0.75, 0.75, 0.75])
    assert rec["fill"] == pytest.approx(96 / 128) and (rec["samples"], rec["interval_samples"]) == (30, 5)
    assert (rec["epoch"], rec["epochs"], rec["total_steps"]) == (2, 3, 100) and rec["eta_s"] > 0
    assert rec["lr"] == pytest.approx(1e-3) and rec["spool_shards"] == 3 and "host_wait_ms" in rec
    assert logger.history == [rec] and wandb.logged[0][1] == 20 and "acc_per_pos" not in wandb.logged[0][0]
    assert heartbeat.counters == {"step": 20, "samples": 30, "tok_s": rec["tok_s"], "world_size": 1}
    assert len([r for r in caplog.records if "step=20" in r.getMessage()]) == 1


def test_other_ranks_keep_the_history_but_write_nothing_and_an_empty_interval_is_no_record(tmp_path):
    logger, heartbeat = _logger(tmp_path, rank=1)
    logger.log(_stats(), None)
    logger.log(StepStats(), None)
    assert len(logger.history) == 1 and "epoch" not in logger.history[0] and heartbeat.counters["step"] == 20
    assert read_jsonl(tmp_path / "metrics.jsonl") == []
