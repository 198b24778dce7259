"""The trainer's log lines: ``IntervalLogger`` is given its sinks (metrics JSONL, wandb, the console) and
decides when to log: every ``--log-every`` steps the interval's sums are all-reduced (one small
collective), turned into one metrics record and one console line, with the campaign's epoch and ETA.
Nothing here runs per step, so it never syncs the GPU between log lines.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from dflash.common.metrics import MetricsLog, format_console_line
from dflash.consumer import distributed as D
from dflash.consumer.campaign import CampaignPlan
from dflash.consumer.checkpointing.state import TrainState
from dflash.consumer.config import LogConfig
from dflash.consumer.data_clock import describe_wait
from dflash.consumer.heartbeat import ConsumerHeartbeat
from dflash.consumer.loop_watch import LoopWatch
from dflash.consumer.step import StepStats

log = logging.getLogger(__name__)


def init_wandb(project: str | None, *, run: str, run_dir: str | None, config: dict):
    """A wandb run when ``--wandb-project`` names one (rank 0 only: the caller decides), else None.
    ``config`` is the run's config as wandb shows it (the caller leaves the store's URL out)."""
    if not project:
        return None

    import wandb  # seconds to import: only for a run that logs to wandb

    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    return wandb.init(project=project, name=run, mode=mode, dir=run_dir or None, config=config)


def reduce_interval(stats: StepStats, block_size: int, dist: D.DistInfo, device: torch.device) -> dict:
    """The interval's sums over all ranks (one all-reduce): loss, accuracy per block position, τ, tokens;
    for DFlash2 the selector's loss, coverage (labels among the top-k) and accuracy over covered rows."""
    B = block_size
    sums = torch.tensor(
        [
            float(stats.loss_sum),
            stats.weight_sum,
            float(stats.tau_sum),
            float(stats.blocks),
            stats.tokens,
            stats.samples,
        ],
        dtype=torch.float64,
    )
    correct = torch.as_tensor(stats.correct).cpu().to(torch.float64).expand(B)
    valid = torch.as_tensor(stats.valid).cpu().to(torch.float64).expand(B)
    selector = torch.tensor([float(x) for x in stats.selector or [0, 0, 0, 0]], dtype=torch.float64)
    packed = torch.cat([sums, correct, valid, selector])
    if dist.enabled and device.type == "cuda":
        packed = packed.to(device)
    D.all_reduce_sum(packed, dist)
    packed = packed.cpu()
    loss_sum, weight_sum, tau_sum, blocks, tokens, samples = packed[:6].tolist()
    correct, valid = packed[6 : 6 + B], packed[6 + B : 6 + 2 * B]
    out = {
        "loss": loss_sum / max(weight_sum, 1e-9),
        "acc": float(correct[1:].sum() / valid[1:].sum().clamp(min=1)),
        "acc_per_pos": (correct / valid.clamp(min=1)).tolist(),
        "tau": tau_sum / max(blocks, 1.0),
        "tokens": tokens,
        "samples": samples,
    }
    if stats.selector is not None:  # DFlash2: the selector term (in "loss" at its scheduled weight)
        sel_loss, sel_correct, covered, rows = packed[6 + 2 * B :].tolist()
        out["selector_loss"] = sel_loss / max(weight_sum, 1e-9)
        out["selector_coverage"] = covered / max(rows, 1.0)
        out["selector_acc"] = sel_correct / max(covered, 1.0)
    return out


class IntervalLogger:
    """Every ``--log-every`` steps: one record into the history, the metrics file and wandb, one console
    line (the last two on rank 0), and the heartbeat's training counters brought up to date."""

    def __init__(
        self,
        cfg: LogConfig,
        state: TrainState,
        *,
        block_size: int,
        context_tokens: int,
        dist: D.DistInfo,
        device: torch.device,
        watch: LoopWatch,
        heartbeat: ConsumerHeartbeat,
        metrics: MetricsLog | None,
        wandb: Any,
    ) -> None:
        self.cfg, self.state, self.dist, self.device = cfg, state, dist, device
        self.block_size, self.context_tokens = block_size, context_tokens
        self.watch, self.heartbeat, self.metrics, self.wandb = watch, heartbeat, metrics, wandb
        self.history: list[dict] = []
        self._t_process = time.monotonic()

    def due(self, step: int) -> bool:
        return step % self.cfg.log_every == 0

    def log(self, stats: StepStats, plan: CampaignPlan | None) -> None:
        """The interval ``stats`` ends: its record, written to every sink."""
        if stats.steps == 0:
            return
        rec = self._record(stats, plan)
        self.history.append(rec)
        self.heartbeat.update(
            step=rec["step"], samples=rec["samples"], tok_s=rec["tok_s"], world_size=self.dist.world_size
        )
        if not self.dist.is_main:
            return
        if self.metrics:
            self.metrics.write(rec)
        if self.wandb is not None:
            self.wandb.log(
                {k: v for k, v in rec.items() if k not in ("acc_per_pos", "time")}, step=rec["step"]
            )
        line = format_console_line(rec, elapsed_s=time.monotonic() - self._t_process, eta_s=rec.get("eta_s"))
        loop_line = f"{describe_wait(rec)}, gc {rec['gc_ms']:.0f} ms"
        if "gpu_busy" in rec:
            loop_line = f"gpu busy {100 * rec['gpu_busy']:.0f}% ({rec['gpu_ms']:.0f} ms/step), " + loop_line
        log.info("%s | %s", line, loop_line)

    def _record(self, stats: StepStats, plan: CampaignPlan | None) -> dict:
        reduced = reduce_interval(stats, self.block_size, self.dist, self.device)
        tokens = reduced.pop("tokens")
        elapsed = time.monotonic() - stats.t0
        self.watch.at_log_line()  # gc_mode interval: the interval's one collection, counted in its own gc_ms
        loop = self.watch.interval()
        progress, schedule = self.state.progress, self.state.schedule
        campaign = {}
        if plan is not None:
            campaign = plan.progress_fields(
                step=progress.step,
                epoch=progress.epoch,
                total_steps=schedule.total_steps,
                step_s=elapsed / stats.steps,
            )
        rec = {
            "time": time.time(),
            "step": progress.step,
            **{k: reduced[k] for k in ("loss", "acc", "acc_per_pos", "tau")},
            **{k: v for k, v in reduced.items() if k.startswith("selector_")},  # DFlash2 only
            "lr": schedule.lr,
            "grad_norm": float(stats.grad_norm),
            "tok_s": tokens / max(elapsed, 1e-9),
            # share of the context slots that held real tokens (packing quality), over this interval
            "fill": tokens / max(1.0, stats.steps * self.dist.world_size * self.context_tokens),
            "samples": len(progress.trained),
            "interval_samples": reduced["samples"],
            # the interval's raw sums: averages over a run are sum(tokens) / sum(seconds), not mean(tok_s)
            "interval_tokens": int(tokens),
            "interval_s": elapsed,
            **campaign,
            "world_size": self.dist.world_size,
            # spool depth and the producers' summed rate, as the heartbeat's last scan saw them
            **self.heartbeat.spool_summary,
            # where the interval's time went (consumer/loop_watch.py): a host stall vs a slow kernel
            **loop,
        }
        if self.device.type == "cuda":
            rec["mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return rec
