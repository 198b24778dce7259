"""The training loop's waits charged to the data path stage that ran meanwhile (consumer/data_clock.py):
the arithmetic on given stage times, then the real feed -> input pipeline chain with one stage made slow
(a shard decode, a batch build, an empty spool) and the loop's interval naming that stage."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dflash.common.contract.shard_reader import read_shard
from dflash.common.contract.spool import Spool
from dflash.common.drafter.batch import build_draft_batch
from dflash.consumer import feed as feed_module
from dflash.consumer.data_clock import DataPathClock, StageClock, describe_wait
from dflash.consumer.feed import ShardFeed
from dflash.consumer.input_pipeline import InputPipeline
from dflash.consumer.loop_watch import LoopWatch
from tests.test_feed import finish, make_shard, publish

SLOW_S = 0.5
"""A slowed stage's extra time per call: far above what a tiny shard's other stages take on a loaded box."""


def test_a_stage_clock_counts_the_running_stage_and_pauses_an_outer_one():
    clock = StageClock(("pack", "wait_shards"))
    with clock.stage("pack"):
        time.sleep(0.02)
        with clock.stage("wait_shards"):
            time.sleep(0.05)
            running = clock.snapshot()
        time.sleep(0.02)
    done = clock.snapshot()
    assert running["wait_shards"] >= 0.05 and running["pack"] >= 0.02  # counted while still inside
    assert done["wait_shards"] >= 0.05 and done["pack"] >= 0.04
    assert clock.snapshot() == done  # nothing runs: the totals stand still
    with pytest.raises(KeyError, match="unknown stage 'decode'"):
        with clock.stage("decode"):
            pass


def test_a_wait_is_split_over_the_pipeline_stages_and_its_shard_wait_over_the_feeds():
    clock = DataPathClock()
    feed = {"claim": 0.01, "spool_empty": 0.0, "decode": 0.03, "handoff": 0.5}
    pipeline = {"wait_shards": 0.06, "pack": 0.02, "build": 0.02, "copy": 0.0, "handoff": 0.0}
    clock.charge(0.1, feed, pipeline)  # 100 ms waited over one step
    fig = clock.interval(steps=1)
    # pack and build 20 ms each of the pipeline's 100 ms; its 60 ms on shards: decode 3/4, claim 1/4
    assert fig["wait_ms_by_cause"] == {"claim": 15.0, "decode": 45.0, "pack": 20.0, "build": 20.0}
    assert fig["wait_cause"] == "decode"
    clock.charge(0.01, dict.fromkeys(feed, 0.0), dict.fromkeys(pipeline, 0.0))  # nothing ran: other
    assert clock.interval(steps=2)["wait_ms_by_cause"] == {"other": 5.0}
    assert "wait_cause" not in clock.interval(steps=1)  # a fresh interval with no wait names no cause


def test_the_console_names_the_causes_by_size():
    rec = {
        "host_wait_ms": 56.2,
        "wait_ms_by_cause": {"pack": 10.0, "decode": 40.4, "copy": 5.8, "claim": 0.2},
    }
    assert describe_wait(rec) == "wait 56 ms/step (decode 40, pack 10, copy 6)"
    assert describe_wait({"host_wait_ms": 0.0}) == "wait 0 ms/step"


def _consume(spool: Spool, *, steps: int, build_s: float = 0.0, late_shards: list | None = None) -> dict:
    """The trainer's data path on the CPU (feed -> input pipeline -> the loop's waits), ``steps`` steps
    of a tiny stream, no training: the watch's interval over them."""
    clock = DataPathClock()
    feed = ShardFeed(
        spool, "c0", context_tokens=64, poll_s=0.01, clock=clock.feed, packing_clock=clock.pipeline
    )

    gen = torch.Generator().manual_seed(0)

    def build(packed):
        time.sleep(build_s)
        return build_draft_batch(
            packed,
            block_size=4,
            num_anchors=8,
            max_anchors_per_doc=4,
            mask_token_id=1,
            gamma=7.0,
            generator=gen,
        )

    pipe = InputPipeline(
        lambda w: feed.next_packed(wait_s=w),
        build,
        feed.exhausted,
        device=torch.device("cpu"),
        hidden_dtype=torch.float32,
        clock=clock.pipeline,
    )
    watch = LoopWatch(torch.device("cpu"), data_clock=clock)
    if late_shards:
        threading.Timer(SLOW_S, late_shards[0]).start()
    done = 0
    try:
        while done < steps:
            with watch.waiting():
                item = pipe.get(timeout=0.5)
            if item is None:
                assert not pipe.exhausted(), "the data ran out before the steps"
                continue
            watch.begin()
            watch.end(done)
            feed.commit()
            done += 1
        return watch.interval()
    finally:
        watch.close()
        pipe.close()
        feed.close()


def _spool_of(tmp_path, shards: int) -> Spool:
    spool = Spool(tmp_path / "spool")
    for seq in range(shards):
        publish(spool, make_shard([30, 34], first_index=2 * seq), seq)  # one 64-token stream each
    finish(spool)
    return spool


def test_a_slow_decode_is_named_as_the_cause(tmp_path, monkeypatch):
    def slow_read(path):
        time.sleep(SLOW_S)
        return read_shard(path)

    monkeypatch.setattr(feed_module, "read_shard", slow_read)
    fig = _consume(_spool_of(tmp_path, 4), steps=4)
    assert fig["wait_cause"] == "decode", fig
    assert fig["wait_ms_by_cause"]["decode"] >= 0.5 * fig["host_wait_ms"]
    assert fig["feed_ms"]["decode"] >= 1e3 * SLOW_S * 0.9  # the feed thread's own time per step


def test_a_slow_build_is_named_as_the_cause(tmp_path):
    fig = _consume(_spool_of(tmp_path, 4), steps=4, build_s=SLOW_S)
    assert fig["wait_cause"] == "build", fig
    assert fig["pipeline_ms"]["build"] >= 1e3 * SLOW_S * 0.9


def test_an_empty_spool_is_named_as_the_producers_being_behind(tmp_path):
    spool = Spool(tmp_path / "spool")
    spool.register_producers(["p0"])

    def produce_late():
        for seq in range(2):
            publish(spool, make_shard([30, 34], first_index=2 * seq), seq)
        spool.mark_done("p0")

    fig = _consume(spool, steps=2, late_shards=[produce_late])
    assert fig["wait_cause"] == "spool_empty", fig
    assert fig["feed_ms"]["spool_empty"] >= 1e3 * SLOW_S / 2 * 0.9
