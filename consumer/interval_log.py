"""The trainer's log lines: every ``--log-every`` steps the interval's sums are all-reduced (one small
collective), turned into one metrics record (JSONL, wandb) and one console line, with the campaign's epoch
and ETA. A mixin of ``Trainer``; nothing here runs per step, so it never syncs the GPU between log lines.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch._dynamo  # noqa: F401  first import in the main thread: concurrent first imports from threads crash

from dflash.common.metrics import format_console_line
from dflash.consumer import distributed as D
from dflash.consumer.campaign import eta_s
from dflash.consumer.step import (
    StepStats,
)

log = logging.getLogger(__name__)


class IntervalLogMixin:
    """``Trainer``'s metrics records and console lines (see the module docstring)."""

    def _campaign_fields(self, step_s: float) -> dict:
        """epoch k/N, the planned steps and the ETA at this interval's step time (metrics and console)."""
        if self.plan is None:
            return {}
        total = self.scheduler.lr_lambdas[0].total_steps
        out = {"epoch": self._step_epoch + 1, "epochs": self.plan.epochs.epochs, "total_steps": total}
        eta = eta_s(self.step, total, step_s)
        return {**out, "eta_s": eta} if eta is not None else out

    def _log(self, stats: StepStats) -> None:
        if stats.steps == 0:
            return
        if self.dist.is_main:
            self._report_saves(self.checkpointer.collect())
        B = self.cfg.block_size
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
        packed = torch.cat([sums, correct, valid])
        if self.dist.enabled and self.device.type == "cuda":
            packed = packed.to(self.device)
        D.all_reduce_sum(packed, self.dist)
        packed = packed.cpu()
        loss_sum, weight_sum, tau_sum, blocks, tokens, samples = packed[:6].tolist()
        correct, valid = packed[6 : 6 + B], packed[6 + B :]
        elapsed = time.monotonic() - stats.t0
        self.watch.at_log_line()  # gc_mode interval: the interval's one collection, counted in its own gc_ms
        loop = self.watch.interval()
        acc_per_pos = (correct / valid.clamp(min=1)).tolist()
        acc = float(correct[1:].sum() / valid[1:].sum().clamp(min=1))
        spool_stats = self._spool_summary()
        rec = {
            "time": time.time(),
            "step": self.step,
            "loss": loss_sum / max(weight_sum, 1e-9),
            "acc": acc,
            "acc_per_pos": acc_per_pos,
            "tau": tau_sum / max(blocks, 1.0),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(stats.grad_norm),
            "tok_s": tokens / max(elapsed, 1e-9),
            # share of the context slots that held real tokens (packing quality), over this interval
            "fill": tokens / max(1.0, stats.steps * self.dist.world_size * self.cfg.context_tokens),
            "samples": len(self.trained),
            "interval_samples": samples,
            # the interval's raw sums: averages over a run are sum(tokens) / sum(seconds), not mean(tok_s)
            "interval_tokens": int(tokens),
            "interval_s": elapsed,
            **self._campaign_fields(elapsed / stats.steps),
            "world_size": self.dist.world_size,
            **spool_stats,
            # where the interval's time went (consumer/loop_watch.py): a host stall vs a slow kernel
            **loop,
        }
        if self.device.type == "cuda":
            rec["mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.history.append(rec)
        self.feed.heartbeat_counters.update(
            step=self.step, samples=len(self.trained), tok_s=rec["tok_s"], world_size=self.dist.world_size
        )
        if not self.dist.is_main:
            return
        if self.metrics:
            self.metrics.write(rec)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in rec.items() if k not in ("acc_per_pos", "time")}, step=self.step)
        line = format_console_line(rec, elapsed_s=time.monotonic() - self._t_process, eta_s=rec.get("eta_s"))
        loop_line = f"wait {rec['host_wait_ms']:.0f} ms/step, gc {rec['gc_ms']:.0f} ms"
        if "gpu_busy" in rec:
            loop_line = f"gpu busy {100 * rec['gpu_busy']:.0f}% ({rec['gpu_ms']:.0f} ms/step), " + loop_line
        log.info("%s | %s", line, loop_line)

    def _spool_summary(self) -> dict:
        """Spool depth and the producers' summed rate, as the feed's heartbeat thread last saw them."""
        return dict(self.feed.spool_summary)

    def _init_wandb(self):
        if not self.cfg.wandb_project:
            return None

        import wandb  # seconds to import: only for a run that logs to wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        return wandb.init(
            project=self.cfg.wandb_project,
            name=self.cfg.run,
            mode=mode,
            dir=self.cfg.run_dir or None,
            config={k: v for k, v in self.cfg.to_dict().items() if k != "checkpoint"},
        )
