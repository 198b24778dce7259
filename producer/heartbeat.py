"""A producer's heartbeat: its counters, rates and phase, to the spool's state file, the run's metrics and
the launch's progress line, at most every ``heartbeat_s``.

Why rate-limited in one object: the main loop calls it after every batch and while it waits, and three
readers (dflash-status, the metrics files, the CLI) must see the same record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from dflash.common.metrics import MetricsLog
from dflash.producer.config import ProducerConfig, Worker
from dflash.producer.writers import Counters


class Heartbeat:
    """Rate-limited heartbeat: spool state file, metrics JSONL, and a callback (the CLI's progress)."""

    def __init__(
        self, cfg: ProducerConfig, worker: Worker, spool, counters: Counters, on_heartbeat: Callable | None
    ):
        self.cfg, self.worker, self.spool, self.counters, self.on_heartbeat = (
            cfg,
            worker,
            spool,
            counters,
            on_heartbeat,
        )
        self.device = torch.device(worker.device)
        self.t0 = self.last_t = time.monotonic()
        self.last_tokens = 0.0
        self.metrics = None
        if cfg.run_dir:
            self.metrics = MetricsLog(Path(cfg.run_dir) / "metrics" / f"producer-{worker.producer_id}.jsonl")

    def __call__(self, *, force: bool = False, **extra) -> None:
        now = time.monotonic()
        if not force and now - self.last_t < self.cfg.heartbeat_s:
            return
        c = self.counters.snapshot()
        rec = {
            **c,
            "tok_s": (c["tokens"] - self.last_tokens) / max(now - self.last_t, 1e-9),
            "avg_tok_s": c["tokens"] / max(now - self.t0, 1e-9),
            "padding_waste": 1.0 - c["fwd_tokens"] / c["padded_tokens"] if c["padded_tokens"] else 0.0,
            "spool_bytes": self.spool.total_bytes(),
            "elapsed_s": now - self.t0,
            **extra,
        }
        if self.device.type == "cuda":
            rec["gpu_mem_gb"] = torch.cuda.memory_allocated(self.device) / 1e9
            rec["gpu_max_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        self.last_t, self.last_tokens = now, c["tokens"]
        self.spool.heartbeat("producer", self.worker.producer_id, rec)
        if self.metrics is not None:
            self.metrics.write(rec)
        if self.on_heartbeat is not None:
            self.on_heartbeat({"id": self.worker.producer_id, **rec})

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
