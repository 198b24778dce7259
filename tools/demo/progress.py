"""The demo's live progress line and its run-average rates, both read from the run's metrics JSONL.

Why from the metrics files: producers and consumers already append one record per heartbeat / step to
``<run_dir>/metrics/*.jsonl`` (and their console output goes to per-process logs), so the demo can say
what is happening without any new channel between processes, and the numbers it prints are the very
records ``dflash-status`` and the plots read.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from dflash.common.metrics import format_bytes, format_duration, format_rate, read_metrics


def _records(path: Path) -> list[dict]:
    try:
        return read_metrics(path)
    except FileNotFoundError:
        return []


def producer_records(run_dir: Path) -> list[dict]:
    """The last heartbeat of each producer (it carries the producer's running totals)."""
    last = []
    for path in sorted((run_dir / "metrics").glob("producer-*.jsonl")):
        recs = [r for r in _records(path) if "tokens" in r]
        if recs:
            last.append(recs[-1])
    return last


def consumer_steps(run_dir: Path) -> list[dict]:
    """The training records (one per logged interval) of rank 0."""
    return [r for r in _records(run_dir / "metrics" / "consumer-0.jsonl") if "loss" in r]


def consumer_phase(run_dir: Path) -> str | None:
    """What rank 0 said it is doing before its first step ("compiling", "evaluating"), if it said so."""
    phases = [
        r["phase"] for r in _records(run_dir / "metrics" / "consumer-0.jsonl") if r.get("event") == "phase"
    ]
    return phases[-1] if phases else None


def producer_avg_tok_s(last: list[dict]) -> float | None:
    """Tokens produced by all producers / the longest producer's wall time (their last heartbeats).

    Not the last heartbeat's ``tok_s``: that is the rate since the previous heartbeat, which swings with
    spool-budget waits and shard writes (and is ~0 in the final, forced one)."""
    elapsed = max((float(r.get("elapsed_s", 0.0)) for r in last), default=0.0)
    if elapsed <= 0:
        return None
    return sum(float(r["tokens"]) for r in last) / elapsed


def consumer_avg_tok_s(steps: list[dict]) -> float | None:
    """Tokens trained / seconds training, summed over the logged intervals after the first.

    The first interval also holds the wait for the first shard and the compile, which is start-up, not
    training speed. A run with a single interval reports that one."""
    rows = [r for r in steps if "interval_tokens" in r and "interval_s" in r]
    rows = rows[1:] if len(rows) > 1 else rows
    seconds = sum(float(r["interval_s"]) for r in rows)
    return sum(float(r["interval_tokens"]) for r in rows) / seconds if seconds > 0 else None


@dataclass(kw_only=True)
class Snapshot:
    """What the run's metrics say right now."""

    samples_produced: int = 0
    tokens_produced: int = 0
    producer_tok_s: float | None = None
    step: int | None = None
    samples_trained: int = 0
    loss: float | None = None
    tau: float | None = None
    spool_shards: int | None = None
    spool_bytes: float | None = None
    consumer_phase: str | None = None


def snapshot(run_dir: Path) -> Snapshot:
    prod, steps = producer_records(run_dir), consumer_steps(run_dir)
    s = Snapshot(
        samples_produced=int(sum(float(r.get("samples", 0)) for r in prod)),
        tokens_produced=int(sum(float(r.get("tokens", 0)) for r in prod)),
        producer_tok_s=producer_avg_tok_s(prod),
        consumer_phase=consumer_phase(run_dir),
    )
    if prod:
        s.spool_bytes = max(float(r.get("spool_bytes", 0.0)) for r in prod)
    if steps:
        last = steps[-1]
        s.step, s.samples_trained = int(last["step"]), int(last.get("samples", 0))
        s.loss, s.tau = float(last["loss"]), float(last["tau"])
        s.spool_shards = last.get("spool_shards")
        s.spool_bytes = last.get("spool_bytes", s.spool_bytes)
    return s


PHASES = {
    "compiling": "compiling its kernels (the first step; later launches find them in the cache)",
    "evaluating": "measuring the untrained drafter on the held-out documents",
}


def format_progress(s: Snapshot, elapsed_s: float) -> str:
    """One compact line, e.g. ``[demo 42s] produced 96 samples / 31.2K tok (1.1K tok/s) | step 14:
    40 samples, loss 5.21, τ 2.31 | spool 3 shards, 12.0 MB``."""
    head = f"[demo {format_duration(elapsed_s)}]"
    doing = PHASES.get(s.consumer_phase or "", "waiting for the first shard")
    if s.tokens_produced == 0 and s.step is None:
        if s.consumer_phase:
            return f"{head} starting: the producer loads the target, the consumer is {doing}"
        return f"{head} starting: the producer loads the target, the consumer builds the drafter"
    parts = [
        f"produced {s.samples_produced} samples / {format_rate(s.tokens_produced)} tok"
        + (f" ({format_rate(s.producer_tok_s)} tok/s)" if s.producer_tok_s else "")
    ]
    if s.step is None:
        parts.append(f"consumer {doing}")
    else:
        parts.append(f"step {s.step}: {s.samples_trained} samples trained, loss {s.loss:.2f}, τ {s.tau:.2f}")
    spool = []
    if s.spool_shards is not None:
        spool.append(f"{s.spool_shards} shards")
    if s.spool_bytes is not None:
        spool.append(format_bytes(s.spool_bytes))
    if spool:
        parts.append("spool " + ", ".join(spool))
    return f"{head} " + " | ".join(parts)


class ProgressPrinter:
    """A daemon thread printing :func:`format_progress` every ``every_s`` seconds until ``stop``.

    Why a fixed period and not "on change": a person watching a quiet terminal cannot tell a slow step
    from a hang, so a line comes even when nothing moved (its numbers then say so)."""

    def __init__(self, run_dir: Path, *, every_s: float = 5.0, out: TextIO = sys.stdout) -> None:
        self.run_dir, self.every_s, self.out = run_dir, every_s, out
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="demo-progress", daemon=True)

    def start(self) -> ProgressPrinter:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._print()

    def _print(self) -> None:
        try:
            line = format_progress(snapshot(self.run_dir), time.monotonic() - self.t0)
        except (OSError, ValueError, KeyError, TypeError) as err:  # a half-written file: say so, go on
            line = f"[demo] progress unavailable this time: {err}"
        print(line, file=self.out, flush=True)

    def stop(self) -> None:
        """Stop the thread, then print one last line: where the run ended, however short it was."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._print()
