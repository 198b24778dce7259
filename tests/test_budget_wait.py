"""A producer throttled by the spool budget, as dflash-plan and dflash-status read it. In-process on the CPU:
the producer loop (``produce``) runs the shipped tiny Qwen3 target over synthetic samples into a spool whose
budget holds one shard, and the test plays a slow consumer, acking each shard a fixed time after it lands.
The forwards end long before the last shards are published: that tail is a wait on the budget too.

Before: the producer's main loop counted its waits on the writers only at a hand-off, not while the last
shards of its slice waited (``writer.close``), and said nothing meanwhile; dflash-plan rated a producer
blocked 77 of 115 s at 552 tok/s (it makes ~1.6 K), dflash-status showed it ``alive`` during the wait and
``prod=0 tok/s`` after the run.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash.common.contract.spool import Spool
from dflash.common.metrics import read_run_metrics
from dflash.common.target.capture import LayerCapture
from dflash.common.target.data import DataConfig
from dflash.producer.buckets import BucketConfig, Sample
from dflash.producer.config import ProducerConfig, Worker
from dflash.producer.loop import produce
from dflash.tools.plan.rates import measure_rates
from dflash.tools.status import cli as status
from dflash.tools.status.render import render

HOLD_S = 0.25
"""How long each shard stays in the spool before the test's consumer acks it: many forwards' time."""


class SlowConsumer:
    """Removes each shard ``HOLD_S`` after it lands, as a consumer's ack does; once every forward is done (the producer's heartbeat says
    so), looks at the run as dflash-status shows it, once."""

    def __init__(self, spool: Path, run_dir: Path, total_tokens: int) -> None:
        self.spool, self.run_dir, self.total_tokens = Spool(spool), run_dir, total_tokens
        self.stop = threading.Event()
        self.tail_state: str | None = None
        self.tail_started: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _heartbeat(self) -> dict:
        files = list((self.spool.root / "state").glob("producer-*.json"))
        return json.loads(files[0].read_text()).get("counters", {}) if files else {}

    def _run(self) -> None:
        landed: dict[str, float] = {}
        while not self.stop.is_set():
            now = time.monotonic()
            for path in sorted(self.spool.ready_dir.iterdir()):
                landed.setdefault(path.name, now)
                if now - landed[path.name] >= HOLD_S:  # trained and acked (no consumer process to show)
                    shutil.rmtree(path)
            hb = self._heartbeat()
            forwards_done = hb.get("fwd_tokens") == self.total_tokens and hb.get("phase") != "done"
            if forwards_done and self.tail_started is None:
                self.tail_started = now
            if forwards_done and self.tail_state is None and now - self.tail_started > HOLD_S:
                snap = status.collect(self.run_dir, spool_dir=self.spool.root, stale_s=60)
                self.tail_state = next(p["state"] for p in snap["processes"] if p["role"] == "producer")
            time.sleep(0.02)


@pytest.fixture(scope="module")
def throttled_run(tmp_path_factory, tiny_target: Path) -> dict:
    """The tiny target's producer over 40 samples (~10 shards) into a one-shard budget, drained slowly."""
    tmp = tmp_path_factory.mktemp("budget")
    spool, run_dir = tmp / "spool", tmp / "run"
    rng = np.random.default_rng(0)
    samples = [
        Sample(i, rng.integers(4, 4000, n, dtype=np.int32), np.ones(n, bool))
        for i, n in enumerate(rng.integers(64, 240, 60))
    ]
    total = int(sum(len(s) for s in samples))
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    capture = LayerCapture(model, [1, 2, 3, 4, 5], free_unused=True)
    cfg = ProducerConfig(
        model=str(tiny_target),
        data=DataConfig(dataset="unused", max_length=256),
        buckets=BucketConfig(batch_tokens=512, pool_batches=1),
        run_dir=str(run_dir),
        heartbeat_s=0.05,
    )
    worker = Worker(producer_id="n0p0.1", spool=str(spool), budget_bytes=1, writer_threads=2)
    Spool(spool).register_producers([worker.producer_id])
    consumer = SlowConsumer(spool, run_dir, total)
    consumer.thread.start()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        result = produce(cfg, worker, capture, samples)
    finally:
        consumer.stop.set()
        consumer.thread.join(timeout=30)
        torch.set_num_threads(threads)
    return {"run_dir": run_dir, "spool": spool, "result": result, "consumer": consumer, "total": total}


def _unthrottled(records: list[dict], warmup_frac: float) -> float:
    """The producer's rate unthrottled over the records ``dflash-plan --warmup-frac`` reads: the tokens it
    forwarded over the time its forwards took (``launch_s``: the CPU forward is synchronous), which the
    plan does not read. Over the same records: the tiny batches' speed varies along a run."""
    first, last = records[math.ceil(warmup_frac * len(records))], records[-1]
    return (last["fwd_tokens"] - first["fwd_tokens"]) / (last["launch_s"] - first["launch_s"])


@pytest.mark.parametrize("warmup_frac", [0.0, 0.25])
def test_a_budget_throttled_producer_is_planned_at_its_unthrottled_rate(throttled_run, warmup_frac):
    result = throttled_run["result"]
    assert result["done"] and result["fwd_tokens"] == throttled_run["total"]
    records = [r for r in read_run_metrics(throttled_run["run_dir"] / "metrics")["producer-n0p0.1"]]
    unthrottled = _unthrottled([r for r in records if "event" not in r], warmup_frac)
    measured = measure_rates(throttled_run["run_dir"], warmup_frac=warmup_frac)  # dflash-plan RUN_DIR
    throttled = result["tokens"] / result["produce_s"]  # what it made over its run
    assert throttled < 0.5 * unthrottled  # it was throttled: the test means something
    assert measured.producer_tok_s == pytest.approx(unthrottled, rel=0.2), (measured, unthrottled)
    assert measured.producer_throttled > 0.5
    # the wait for the last shards (after the forwards) is a wait on the budget too
    assert throttled_run["consumer"].tail_started is not None
    assert result["budget_blocked_s"] > 0.8 * result["main_wait_s"] > HOLD_S


def test_status_shows_the_wait_for_the_last_shards_as_blocked(throttled_run):
    assert throttled_run["consumer"].tail_state == "blocked"


def test_status_after_the_run_gives_the_producers_rate_over_the_run_and_says_they_were_throttled(
    throttled_run,
):
    snap = status.collect(throttled_run["run_dir"], spool_dir=throttled_run["spool"])
    producer = next(p for p in snap["processes"] if p["role"] == "producer")
    rates = snap["rates"]
    assert snap["run_state"] == "finished" and producer["state"] == "finished"
    assert rates["producer_tok_s"] == pytest.approx(producer["tok_s"]) and rates["producer_tok_s"] > 0
    assert rates["producer_throttled"] > 0.2 and rates["producer_unthrottled_tok_s"] > rates["producer_tok_s"]
    text = render(snap)
    assert "rates over the run: prod=" in text and "prod=0 tok/s" not in text
    assert "producers waited on the spool budget" in text and "(throttled by the consumers)" in text
