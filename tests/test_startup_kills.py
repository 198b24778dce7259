"""Start-up kills at named phases: no kill leaves a launch hanging, none trains on a made-up schedule.

Each kill is a ``DFLASH_FAULT`` fault point (common/fault.py): the process SIGKILLs itself when it reaches
the phase, so the phase a test checks is the one it names, on any box and under any load (a kill -9 timed
from outside lands wherever the box's speed puts it). Two tiers:

- dflash-produce's parent (producer/supervisor.py) with stand-in workers (tests/startup_standins.py: the
  real pipe protocol and fault points, no model): every worker phase, a second each. A worker dead before
  its report stops the launch before any shard, with no campaign; one dead after it is named at once and
  recorded in the spool, the others finish, the campaign counts every slice.
- one real ``ops/run_all.sh`` of the tiny target, two producers and two consumers, killed at a start-up
  phase in each of its first three launches (a worker as its model loads, the parent right after the
  workers' go, a consumer before its first step): each launch ends (``--restarts`` takes the next), the
  last finishes, and the sample ledgers show every eligible sample trained once along the timeline.
  Before: the worker's kill left one producer whose shards in flight a consumer rank held while the other
  rank waited for a shard: the launch hung at 0 tok/s for ever (a chaos run on a loaded box). That race is made
  certain by a launch of one producer and a rank that never gets a shard, which hung before.

docs/reliability.md, "Start-up kills", lists each phase with its behaviour and its bound.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port
from ledger_audit import audit, launches_from_output
from pipeline_helpers import REPO, consume_cmd, cpu_env, produce_cmd
from startup_standins import ROWS, standin_worker

from dflash.common.contract.spool import Spool
from dflash.common.target.data import DataConfig
from dflash.producer.config import LaunchConfig, ProducerConfig, Worker
from dflash.producer.launch import Launch
from dflash.producer.supervisor import Supervisor
from dflash.tools.demo.assets import demo_dataset_path

BEFORE_REPORT = ["start", "tokenized"]
AFTER_REPORT = ["load", "loaded", "first-shard"]


def _standin_launch(tmp_path: Path) -> tuple[Launch, LaunchConfig]:
    spool = Spool(tmp_path / "spool")
    ids = ["n0p0.1", "n0p1.1"]
    spool.register_producers(ids)
    workers = [Worker(producer_id=i, rank=r, world=2, spool=str(spool.root)) for r, i in enumerate(ids)]
    config = ProducerConfig(
        model="standin", data=DataConfig(dataset="standin"), run_dir=str(tmp_path / "run")
    )
    prepared = Launch(spool=spool, lock=None, workers=workers, config=config, num_rows=2 * ROWS)
    return prepared, LaunchConfig(gpus="cpu:2", spool=str(spool.root), progress_s=3600.0)


def _supervise(prepared: Launch, launch: LaunchConfig, bound_s: float = 60.0) -> tuple[Supervisor, int]:
    sup = Supervisor(prepared, launch, entry=standin_worker)
    watcher = threading.Thread(target=sup.watch, daemon=True)
    watcher.start()
    watcher.join(timeout=bound_s)  # a hang guard: the launch ends in about a second
    assert not watcher.is_alive(), f"the launch did not end within {bound_s:.0f} s"
    return sup, sup.exit_status()


@pytest.mark.pipeline
@pytest.mark.parametrize("phase", BEFORE_REPORT + AFTER_REPORT)
def test_a_worker_killed_at_a_start_up_phase_ends_the_launch_named_and_never_without_a_campaign(
    tmp_path, monkeypatch, capsys, phase
):
    monkeypatch.setenv("DFLASH_FAULT", f"n0p1@{phase}")
    monkeypatch.delenv("DFLASH_FAULT_ONCE", raising=False)
    prepared, launch = _standin_launch(tmp_path)
    sup, code = _supervise(prepared, launch)
    err = capsys.readouterr().err
    spool = prepared.spool
    before = phase in BEFORE_REPORT
    how = f"killed by SIGKILL {'before' if before else 'after'} reporting its slice"
    assert code == 1, err
    # named at once (not only when the others finish), in the spool for consumers and the epoch barrier,
    # and as the last record of its metrics file for dflash-status
    assert f"worker n0p1.1 {how}" in err
    assert spool.dead_producers() == {"n0p1.1": how}
    last = json.loads((tmp_path / "run" / "metrics" / "producer-n0p1.1.jsonl").read_text().splitlines()[-1])
    assert last["phase"] == "dead" and last["how"] == how
    if before:
        # no campaign from part of the data: the launch stops before any shard, the survivor aborted
        assert spool.read_campaign() is None
        assert sup.outcome["n0p0.1"][0] == "aborted"
        assert f"error: worker(s) n0p1.1 ({how}): the launch stopped before any shard (10 of 20 rows" in err
        assert "trainable" not in err  # no count of half the rows as if it were the dataset's
    else:
        # the campaign counts both slices (the dead worker reported its own); the survivor finished
        (campaign,) = spool.read_campaign()
        assert campaign["samples"] == 2 * ROWS
        assert sup.outcome["n0p0.1"][0] == "done"
        assert f"error: 1 worker(s) failed: n0p1.1: {how}" in err


def test_fault_points_are_inert_unless_named_and_fire_once_in_order(tmp_path, monkeypatch):
    from dflash.common.fault import fault_point

    fired: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: fired.append(sig))
    monkeypatch.delenv("DFLASH_FAULT", raising=False)
    fault_point("consumer0", "start")
    assert not fired
    monkeypatch.setenv("DFLASH_FAULT", "n0p1.2@load,consumer1@first-step")
    monkeypatch.setenv("DFLASH_FAULT_ONCE", str(tmp_path / "fired"))
    fault_point(("n0p1", "n0p1.1"), "load")  # launch 1: not this one's
    fault_point("consumer1", "first-step")  # the fault before it has not fired
    assert not fired
    fault_point(("n0p1", "n0p1.2"), "load")
    fault_point(("n0p1", "n0p1.2"), "load")  # once
    assert len(fired) == 1
    fault_point("consumer1", "first-step")
    assert len(fired) == 2 and (tmp_path / "fired.1").exists()


# ------------------------------------------------------------------------------------ the real launches
GOOD_ROWS = 12
EPOCHS = 2


def _demo_rows(path: Path, n: int) -> list[list[dict]]:
    with open(demo_dataset_path(), encoding="utf-8") as f:
        rows = [json.loads(line)["messages"] for _, line in zip(range(n), f, strict=False)]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return rows


@pytest.mark.pipeline
def test_a_real_worker_killed_before_its_report_stops_dflash_produce_before_any_shard(tmp_path, tiny_target):
    """dflash-produce itself, two CPU workers, worker n0p1 killed once its slice is tokenized and before
    it reports it: exit 1 within a bound, one line naming it with the rows counted, and nothing a consumer
    could train on a made-up schedule (no campaign, no shard, no DONE marker). Before: the other worker
    produced its slice and the consumers trained it on a 10000-step schedule."""
    data = tmp_path / "data.jsonl"
    _demo_rows(data, 8)
    spool = tmp_path / "spool"
    env = cpu_env(HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"), DFLASH_FAULT="n0p1@tokenized")
    cmd = [
        *produce_cmd(spool, tiny_target, data, "--run", "k", "--run-dir", str(tmp_path / "run")),
        "--gpus",
        "cpu:2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    how = "killed by SIGKILL before reporting its slice"
    lines = [ln for ln in err.splitlines() if ln.startswith("dflash-produce: ")]
    assert f"dflash-produce: worker n0p1.1 {how}; the launch stops" in lines[0], lines
    assert (
        f"dflash-produce: error: worker(s) n0p1.1 ({how}): the launch stopped before any shard (4 of 8 rows counted)"
        in lines[-1]
    ), lines
    assert not any("trainable" in ln for ln in lines), lines
    sp = Spool(spool, create=False)
    assert sp.read_campaign() is None and not any(sp.ready_dir.iterdir()) and not sp.done_producers()
    assert sp.dead_producers() == {"n0p1.1": how}


def _ok_rows(data: Path, target: Path, cache: Path) -> set[int]:
    """The rows the producers keep (max length, supervised tokens), from one clean tokenization pass."""
    from transformers import AutoTokenizer

    from dflash.common.target.chat import tokenize_slice
    from dflash.common.target.data import load_raw_dataset

    cfg = DataConfig(dataset=str(data), max_length=512, min_loss_tokens=32, cache_dir=str(cache))
    ds = load_raw_dataset(cfg)
    out = tokenize_slice(ds, AutoTokenizer.from_pretrained(target), cfg, np.arange(len(ds)))
    return {int(i) for i, s in zip(out["sample_index"], out["status"], strict=True) if s == "ok"}


@pytest.mark.pipeline
def test_one_producer_and_a_rank_that_gets_no_shard_end_instead_of_hanging(tmp_path, tiny_target):
    """The hang a worker's start-up kill left, made certain: one producer on a spool budget of
    about one shard, two consumer ranks of which rank 1 claims only a bucket that never comes, so rank 0
    claims every shard. Rank 0 packs a step; rank 1 has none and its one producer waits on the budget that
    rank 0's held shards fill. Now rank 1 is starved and rank 0 steps (rank 1 pads): the run ends with
    every sample trained. Before: rank 0 kept its step for rank 1 for ever (`samples 8/30 | 0 tok/s`,
    `waiting for producers ... 0 of 1 registered producers done`, 8 shards claimed by rank 0)."""
    data, spool = tmp_path / "data.jsonl", tmp_path / "spool"
    _demo_rows(data, 30)  # ~4 MB of shards: past the budget before the producer is done
    env = cpu_env(HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false")
    port = str(free_port())
    logs = [tmp_path / f"{name}.log" for name in ("producer", "consumer-0", "consumer-1")]
    procs = [
        subprocess.Popen(
            [
                *produce_cmd(spool, tiny_target, data, "--run", "st"),
                "--batch-tokens",
                "2048",
                "--budget-gb",
                "0.002",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=logs[0].open("w"),
        )
    ]
    for rank in (0, 1):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        rank_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        extra = ["--bucket", "7"] if rank == 1 else []  # no shard is ever of bucket 7
        cmd = consume_cmd(spool, tiny_target, "--run", "st", "--checkpoint", str(tmp_path / "ckpt"), *extra)
        procs.append(
            subprocess.Popen(
                [*cmd, "--compile-backend", "eager", "--spool-wait-s", "120"],
                env=rank_env,
                stdout=subprocess.DEVNULL,
                stderr=logs[1 + rank].open("w"),
            )
        )
    try:
        for p in procs:
            p.wait(timeout=300)  # a hang guard: about a minute on the 2-core box
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("the consumers never ended: rank 0 held its step for a rank that gets no shard")
    errs = [log.read_text(errors="replace") for log in logs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-1500:] for e in errs]
    summary = json.loads(errs[1].split("done: ", 1)[1].splitlines()[0])
    assert summary["samples_trained"] == len(_ok_rows(data, tiny_target, tmp_path / "hf-audit"))


@pytest.mark.slow
def test_kills_at_start_up_phases_end_each_launch_and_the_run_trains_every_sample_once(tmp_path, tiny_target):
    data = tmp_path / "data.jsonl"
    rows = _demo_rows(data, GOOD_ROWS)
    run_dir, spool, ckpt = tmp_path / "run", tmp_path / "spool", tmp_path / "ckpt"
    # launch 1: worker n0p1 as its model loads (after its report: the campaign is whole); launch 2: the
    # parent right after its go; launch 3: consumer rank 1 before its first step; launch 4 finishes
    faults = "n0p1.1@load,producer.2@decided,consumer1@first-step"
    env = cpu_env(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path / "hf"),
        TOKENIZERS_PARALLELISM="false",
        DFLASH_FAULT=faults,
        DFLASH_FAULT_ONCE=str(tmp_path / "fired"),
    )
    cmd = [
        "bash",
        str(REPO / "ops" / "run_all.sh"),
        "--keep-spool",
        "--restarts",
        "3",
        "--producers",
        "cpu:2",
        "--consumers",
        "cpu:2",
        "--model",
        str(tiny_target),
        "--dataset",
        str(data),
        "--run",
        "kills",
        "--run-dir",
        str(run_dir),
        "--spool",
        str(spool),
        "--checkpoint",
        str(ckpt),
        "--epochs",
        str(EPOCHS),
        # a spool of about one shard: the worker's death leaves one producer and one shard in flight
        "--producer-args",
        "--max-length 512 --batch-tokens 2048 --budget-gb 0.002",
        "--consumer-args",
        "--context-tokens 512 --num-anchors 32 --max-anchors-per-doc 8 --save-every 2 --log-every 1 "
        "--compile-backend eager --heartbeat-timeout 120",
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=540)
    wall = time.monotonic() - t0
    out, err = proc.stdout, proc.stderr
    print(f"start-up kills: 4 launches in {wall:.0f} s")
    diag = f"rc={proc.returncode} wall={wall:.0f}s\n--- stderr\n{err[-4000:]}"
    assert proc.returncode == 0, diag
    assert all((tmp_path / f"fired.{k}").exists() for k in range(3)), diag
    launches = launches_from_output(out)
    assert len(launches) == 4 and err.count("run_all.sh: restart ") == 3, diag
    # each death named in one line: the worker by its parent (at once), the parent and the consumer by
    # run_all.sh
    assert "dflash-produce: worker n0p1.1 killed by SIGKILL after reporting its slice" in err, diag
    assert f"run_all.sh: producer (pid {launches[1]['producer']}) failed with exit code 137" in err, diag
    assert f"run_all.sh: consumer-1 (pid {launches[2]['consumer-1']}) failed with exit code 137" in err, diag
    # no step ever trained on a schedule made up without the campaign
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("consumer-*.log"))
    assert "no campaign in spool" not in logs
    # every eligible sample trained once along the timeline (lost tails redone, nothing else)
    from dflash.common.checkpoints.load import load_checkpoint

    ok = _ok_rows(data, tiny_target, tmp_path / "hf-audit")
    eligible = {k * len(rows) + r for k in range(EPOCHS) for r in ok}
    final = load_checkpoint(str(ckpt), "kills")
    assert set(final.trained.indices().tolist()) == eligible
    audit(run_dir, launches, final.step, eligible, ranks=(0, 1))


# ------------------------------------------------------------------------ the consumer's side, in-process
def test_a_consumer_waits_for_the_campaign_and_names_a_dead_producer(
    tmp_path, tiny_target, monkeypatch, caplog
):
    """A spool whose producers record a plan but no campaign yet (a launch that lost a worker before its
    report): the consumer holds its first step until the campaign comes, saying so, then sizes its schedule
    from it; a registered producer whose parent recorded its death is named as dead while the consumer
    waits for shards. Before: the first step trained at once on a made-up 10000-step schedule, and the
    wait for the dead producer's DONE marker said only `1 of 2 registered producers done`, for ever."""
    import torch
    from pipeline_helpers import write_synthetic_spool

    from dflash.common.drafter.layers import default_target_layer_ids
    from dflash.consumer import feed as feed_module
    from dflash.consumer import trainer as trainer_module
    from dflash.consumer.config import TrainConfig
    from dflash.consumer.trainer import Trainer

    monkeypatch.setattr(feed_module, "WAITING_LOG_S", 0.5)
    monkeypatch.setattr(trainer_module, "CAMPAIGN_WAIT_LOG_S", 0.5)
    cfg = json.loads((tiny_target / "config.json").read_text())
    layers = default_target_layer_ids(cfg["num_hidden_layers"])
    root = tmp_path / "spool"
    write_synthetic_spool(
        root,
        hidden_size=cfg["hidden_size"],
        layer_ids=layers,
        num_shards=2,
        samples_per_shard=4,
        tokens_per_sample=64,
        vocab=cfg["vocab_size"],
        producer_id="n0p0.1",
    )
    spool = Spool(root)
    spool.bind_run(
        {"run": "r", "model": str(tiny_target), "layer_ids": layers, "plan": {"rows": 8, "epochs": 1}}
    )
    spool.register_producers(["n0p0.1", "n0p1.1"])  # n0p1.1 never finishes: its parent saw it die
    how = "killed by SIGKILL after reporting its slice"
    spool.mark_dead("n0p1.1", how)
    train_cfg = TrainConfig.from_flat(
        spool=str(root),
        target=str(tiny_target),
        store=str(tmp_path / "store"),
        run="r",
        context_tokens=128,
        num_anchors=16,
        num_layers=1,
        log_every=1,
        eval_every=0,
        compile=False,
        fill_wait_s=0.0,
    )
    caplog.set_level(logging.INFO)
    said = lambda text: any(text in r.getMessage() for r in caplog.records)  # noqa: E731
    threads = torch.get_num_threads()
    trainer = Trainer(train_cfg)
    seen: dict[str, object] = {}

    def drive() -> None:
        try:
            deadline = time.monotonic() + 120
            while not said("waiting for the campaign"):
                assert time.monotonic() < deadline, "no 'waiting for the campaign' line"
                time.sleep(0.05)
            time.sleep(1.0)
            seen["steps_before_campaign"] = trainer.step
            spool.write_campaign(
                0,
                {
                    "samples": 8,
                    "tokens": 512,
                    "loss_tokens": 300,
                    "epochs": 1,
                    "node_rank": 0,
                    "num_nodes": 1,
                },
            )
            while not said(f"n0p1.1 ({how}) dead"):
                assert time.monotonic() < deadline, "the waiting line never named the dead producer"
                time.sleep(0.05)
        finally:
            trainer.stop_requested = True

    helper = threading.Thread(target=drive, daemon=True)
    helper.start()
    try:
        with torch.random.fork_rng(devices=[]):
            trainer.train()
    finally:
        trainer.close()
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    helper.join(timeout=10)
    assert seen["steps_before_campaign"] == 0  # no step on a schedule made up without the campaign
    assert trainer.step > 0 and not trainer.schedule.on_steps  # then trained on the campaign's curve
    assert said("campaign: 8 samples x 1 epoch(s)") and not said("no campaign in spool")
    assert said("run the producers' command again")
