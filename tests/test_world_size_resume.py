"""A campaign resumed in another world size (2 ranks -> 1 -> 2): the learning rate continues the same curve
at each resume (it runs on the tokens trained, consumer/campaign.py), the step counts printed are the ones
the schedule uses, no step trains at lr 0, and every sample is trained once (the ledgers)."""

from __future__ import annotations

import re
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from conftest import free_port, wait_until
from ledger_audit import read_jsonl
from pipeline_helpers import consume_cmd, cpu_env, write_synthetic_spool

from dflash.common.contract.spool import Spool
from dflash.tools.spool.audit import audit, exactly_once

SHARDS, PER_SHARD, TOKENS = 10, 6, 96
SAMPLES = SHARDS * PER_SHARD
CONTEXT = 256
PLAN_LINE = re.compile(r"campaign: .* = (\d+) steps, warm-up (\d+)")


def _spool(root: Path) -> Spool:
    spool = write_synthetic_spool(
        root,
        hidden_size=256,
        layer_ids=[1, 2, 3, 4, 5],
        num_shards=SHARDS,
        samples_per_shard=PER_SHARD,
        tokens_per_sample=TOKENS,
        vocab=4096,
    )
    # what producers record before their first shard: the run's plan and the data's size
    spool.bind_run({"run": "ws", "plan": {"rows": SAMPLES, "epochs": 1}})
    spool.write_campaign(
        0,
        {
            "node_rank": 0,
            "num_nodes": 1,
            "epochs": 1,
            "samples": SAMPLES,
            "tokens": SAMPLES * TOKENS,
            "loss_tokens": SAMPLES * TOKENS // 2,
        },
    )
    return spool


def _life(tmp_path: Path, spool: Spool, target: Path, world: int, name: str, stop_after: int | None) -> str:
    """One launch of ``world`` consumer ranks; SIGTERM to every rank once rank 0's ledger reaches step
    ``stop_after`` (None: run until the spool is drained). Returns rank 0's log."""
    run_dir = tmp_path / "run"
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = cpu_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        cmd = consume_cmd(
            spool.root,
            target,
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--run",
            "ws",
            "--run-dir",
            str(run_dir),
            "--context-tokens",
            str(CONTEXT),
            "--log-every",
            "1",
            "--save-every",
            "1000",
            "--eval-every",
            "0",
            "--fill-wait-s",
            "1",
            "--compile-backend",
            "eager",
            "--lr",
            "1e-3",
        )
        log = tmp_path / f"{name}-r{rank}.log"
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT))  # noqa: SIM115
    try:
        if stop_after is not None:
            ledger = run_dir / "metrics" / "ledger-r0.jsonl"
            wait_until(
                lambda: (
                    any(r["step"] >= stop_after for r in read_jsonl(ledger)) or procs[0].poll() is not None
                ),
                timeout_s=300,
                what=f"{name}: step {stop_after}",
            )
            for p in procs:  # as run_all.sh stops a group: every rank
                p.send_signal(signal.SIGTERM)
        rcs = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = [log.read_text() for log in logs]
    want = 0 if stop_after is None else 130
    assert rcs == [want] * world, "\n".join(t[-3000:] for t in texts)
    return texts[0]


@pytest.mark.slow
def test_a_campaign_resumed_in_another_world_size_keeps_its_learning_rate_curve(tmp_path, tiny_target):
    from dflash.common.checkpoints.load import load_checkpoint

    spool, ckpt, metrics = _spool(tmp_path / "spool"), str(tmp_path / "ckpt"), tmp_path / "run" / "metrics"
    log_a = _life(tmp_path, spool, tiny_target, 2, "a", stop_after=3)
    step_a = load_checkpoint(ckpt, "ws").step
    log_b = _life(tmp_path, spool, tiny_target, 1, "b", stop_after=step_a + 4)
    step_b = load_checkpoint(ckpt, "ws").step
    log_c = _life(tmp_path, spool, tiny_target, 2, "c", stop_after=None)
    final = load_checkpoint(ckpt, "ws")
    assert 3 <= step_a < step_b < final.step, (step_a, step_b, final.step)

    # every sample trained once over the three lives (each ended with its checkpoint: no lost tail)
    assert sorted(final.trained.indices().tolist()) == list(range(SAMPLES))
    counts = Counter(s for p in metrics.glob("ledger-r*.jsonl") for r in read_jsonl(p) for s in r["samples"])
    assert set(counts) == set(range(SAMPLES)) and set(counts.values()) == {1}, counts
    # the user's audit (dflash-spool audit) finds the three launches, whatever their world size
    report = audit(metrics.parent, final_step=final.step, trained=set(final.trained.indices().tolist()))
    assert exactly_once(report) and len(report["lives"]) == 3, report
    assert [life["durable"] for life in report["lives"]] == [step_a, step_b, final.step]

    # the learning rate: one curve, no step at lr 0, each resume moves it by about one step's change
    by_step = {r["step"]: r for r in read_jsonl(metrics / "consumer-0.jsonl") if "lr" in r and "step" in r}
    assert sorted(by_step) == list(range(1, final.step + 1))
    lrs = [by_step[s]["lr"] for s in sorted(by_step)]
    assert min(lrs) > 0, lrs
    # past the warm-up (one step here) it only decays: a schedule re-sized at a resume jumped up (2 -> 1 rank)
    assert all(b <= a + 1e-12 for a, b in zip(lrs, lrs[1:], strict=False)), lrs
    deltas = [abs(b - a) for a, b in zip(lrs, lrs[1:], strict=False)]  # deltas[i]: step i+1 -> i+2
    for resume in (step_a, step_b):
        jump, around = deltas[resume - 1], max(deltas[resume - 2], deltas[resume])
        assert jump <= 1.5 * around + 1e-9, (resume, lrs)

    # the step counts printed are the schedule's: each launch's plan line = its first step's total, and the
    # last step's total is the step count the campaign took
    for log, resumed in ((log_a, 0), (log_b, step_a), (log_c, step_b)):
        (line,) = [ln for ln in log.splitlines() if "campaign: " in ln]
        planned = int(PLAN_LINE.search(line).group(1))
        assert abs(planned - by_step[resumed + 1]["total_steps"]) <= 1, (line, by_step[resumed + 1])
        assert (f"resumed at step {resumed}," in line) == bool(resumed), line
    assert by_step[final.step]["total_steps"] == final.step
