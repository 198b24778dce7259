"""Crash recovery: kill -9 the whole pipeline mid-run, restart, resume from `latest` on a real S3 endpoint —
with exact sample accounting across both runs.

Cost: the first ROWS rows of the bundled chat data (about 32 steps of 512 tokens), a checkpoint every 4
steps, the kill once a checkpoint at step >= KILL_AFTER_STEP exists and the consumer has committed two steps
past the latest one (work that must be redone). No verdict depends on timing: the waits are on conditions,
their deadlines only catch a hung pipeline.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time

from pipeline_helpers import REPO, cpu_env

from dflash.common.checkpoints.layout import STEP_DIR, as_store, read_latest_name
from dflash.common.checkpoints.load import load_checkpoint
from dflash.common.contract.shard_reader import read_shard
from dflash.consumer.schedule import WarmupCosine

RUN = "resume"
TOTAL_STEPS = 150
LR = 3e-3
ROWS = 64  # dataset rows (sample indices 0..ROWS-1 of the bundled chat data)
SAVE_EVERY = 4
KILL_AFTER_STEP = 8  # the first run is killed once a checkpoint at >= this step exists


def _pipeline_cmd(tiny_target, dataset, run_dir, spool, store):
    return [
        "bash",
        str(REPO / "ops" / "run_all.sh"),
        "--producers",
        "cpu:1",
        "--consumers",
        "cpu:1",
        "--model",
        str(tiny_target),
        "--dataset",
        str(dataset),
        "--run",
        RUN,
        "--run-dir",
        str(run_dir),
        "--spool",
        str(spool),
        "--checkpoint",
        store,
        "--producer-args",
        "--max-length 512 --batch-tokens 4096",
        "--consumer-args",
        f"--context-tokens 512 --num-anchors 32 --max-anchors-per-doc 8 --save-every {SAVE_EVERY} "
        f"--log-every 1 --total-steps {TOTAL_STEPS} --lr {LR} --compile-backend eager",
    ]


def _subset(path, n):
    """The first ``n`` rows of the bundled chat data: row i keeps sample index i."""
    from dflash.tools.demo.assets import demo_dataset_path

    with open(demo_dataset_path(), encoding="utf-8") as f:
        rows = [line for _, line in zip(range(n), f, strict=False)]
    assert len(rows) == n
    path.write_text("".join(rows))
    return path


def _ledger(run_dir):
    rows = []
    path = run_dir / "metrics" / "ledger-r0.jsonl"
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line torn by kill -9
    return rows


def test_kill9_whole_pipeline_then_resume_from_latest(tmp_path, tiny_target, s3_server, demo_spool):
    # eligible = what a producer keeps of these rows: the session's producer run over the full dataset
    # (same --max-length, same tokenizer), restricted to the subset's indices
    eligible = set()
    for shard in demo_spool.joinpath("ready").iterdir():
        eligible |= {i for i in read_shard(shard).sample_index.tolist() if i < ROWS}
    assert len(eligible) > 40
    run_dir, spool = tmp_path / "run", tmp_path / "spool"
    cmd = _pipeline_cmd(tiny_target, _subset(tmp_path / "data.jsonl", ROWS), run_dir, spool, s3_server)

    store = as_store(s3_server)

    def ready_to_kill() -> bool:
        # the checkpoint `latest` names (written after every file of its step): the one the resume loads. A
        # step directory alone can still be uploading (list_steps lists it), so a kill then left `latest` at
        # the step before, on a loaded box
        latest = read_latest_name(store, RUN)
        step = int(STEP_DIR.match(latest).group(1)) if latest else 0
        if step < KILL_AFTER_STEP:
            return False
        committed = [r["step"] for r in _ledger(run_dir)]
        return bool(committed) and max(committed) >= step + 2  # steps past the checkpoint: redone later

    first = subprocess.Popen(
        cmd, env=cpu_env(), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 600  # only catches a hung pipeline
    try:
        while not ready_to_kill():
            assert first.poll() is None, "the pipeline ended before it was killed"
            assert time.monotonic() < deadline, "no checkpoint + 2 steps within 600 s"
            time.sleep(0.1)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the whole pipeline: run_all, producer workers, consumer
        first.wait()
        killed_at = time.time()
    ckpt = load_checkpoint(s3_server, RUN)
    assert ckpt is not None and ckpt.step >= KILL_AFTER_STEP
    c = ckpt.step
    run1 = _ledger(run_dir)
    durable1 = {i for r in run1 if r["step"] <= c for i in r["samples"]}
    assert durable1 == set(ckpt.trained.indices().tolist()), "checkpoint's trained set != ledger up to it"
    lost1 = {i for r in run1 if r["step"] > c for i in r["samples"]}

    second = subprocess.run(
        [*cmd, "--fresh-spool"], env=cpu_env(), capture_output=True, text=True, timeout=900
    )
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    log = (run_dir / "logs" / "consumer-0.log").read_text()
    assert f"resumed from step {c} " in log

    final = load_checkpoint(s3_server, RUN)
    assert set(final.trained.indices().tolist()) == eligible  # no sample skipped
    pids = [r["pid"] for r in run1]
    run2 = [r for r in _ledger(run_dir) if r["pid"] not in set(pids)]
    assert run2 and run2[0]["step"] == c + 1  # resumed at the checkpoint's step
    trained2 = [i for r in run2 for i in r["samples"]]
    assert len(trained2) == len(set(trained2)), "a sample trained twice within the resumed run"
    assert not set(trained2) & durable1, "a checkpointed sample was trained again"
    assert set(trained2) & set(durable1 | lost1) <= lost1  # re-trained only what the checkpoint had not
    assert durable1 | set(trained2) == eligible

    # schedule and optimizer continue: lr at the first resumed step is the schedule's value there
    recs = [
        json.loads(x)
        for x in (run_dir / "metrics" / "consumer-0.jsonl").read_text().splitlines()
        if x.strip() and '"loss"' in x
    ]
    after = next(r for r in recs if r["step"] == c + 1 and r["time"] > killed_at)
    lam = WarmupCosine(max(1, int(0.04 * TOTAL_STEPS)), TOTAL_STEPS)
    assert math.isclose(after["lr"], LR * lam(c + 1), rel_tol=1e-6), (after["lr"], LR * lam(c + 1))
    assert ckpt.optimizer_state["state"], "optimizer moments were checkpointed"
