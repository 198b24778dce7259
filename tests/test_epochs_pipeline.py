"""a two-epoch campaign on the user's path. ``ops/run_all.sh --epochs 2`` with 2 CPU producers and
2 CPU consumers (one gloo group) is killed (-9, a consumer) once it trains epoch 2, then run again with the
same command. Verdicts from the ledgers and checkpoints (tests/ledger_audit.py): every eligible row trained
exactly once per epoch along the final timeline; the consumer's printed plan matches the steps taken.
"""

from __future__ import annotations

import os
import re
import signal

import pytest
from ledger_audit import audit, eligible_lengths, read_jsonl
from test_rerun import CONSUMER_ARGS, MAX_LENGTH, Life, _dataset, _env, _ledger_lines, _wait_for

from dflash.common.checkpoints.load import load_checkpoint
from dflash.common.contract.epochs import Epochs

ROWS = 24
EPOCHS = 2
HELD_OUT = 3
PLAN_LINE = re.compile(r"campaign: (\d+) samples x (\d+) epoch\(s\).* = (\d+) steps, warm-up (\d+)")


def _checkpoint_in_epoch_2(ckpt, rows: int) -> int | None:
    """The step of the latest checkpoint once it holds more than one epoch's worth of samples (more than
    ``rows``, the dataset's size), some of them epoch 2's (ids >= rows); else None."""
    from dflash.common.checkpoints.layout import TRAINED_FILE
    from dflash.common.contract.sample_set import SampleSet

    try:
        name = (ckpt / "epochs" / "latest").read_text().strip()
        trained = SampleSet.from_bytes((ckpt / "epochs" / name / TRAINED_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    ids = trained.indices()
    return int(name.rsplit("-", 1)[1]) if len(ids) > rows and int(ids.max()) >= rows else None


@pytest.mark.slow
def test_two_epochs_kill9_mid_epoch_2_then_the_same_command_trains_each_row_once_per_epoch(
    tmp_path, tiny_target
):
    from test_rerun import REPO

    data = _dataset(tmp_path / "data.jsonl", ROWS)
    run_dir, spool, ckpt = tmp_path / "run", tmp_path / "spool", tmp_path / "ckpt"
    cmd = [
        "bash",
        str(REPO / "ops" / "run_all.sh"),
        "--keep-spool",
        "--producers",
        "cpu:2",
        "--consumers",
        "cpu:2",
        "--model",
        str(tiny_target),
        "--dataset",
        str(data),
        "--run",
        "epochs",
        "--run-dir",
        str(run_dir),
        "--spool",
        str(spool),
        "--checkpoint",
        str(ckpt),
        "--epochs",
        str(EPOCHS),
        "--producer-args",
        f"--max-length {MAX_LENGTH} --batch-tokens 2048 --eval-samples {HELD_OUT}",
        "--consumer-args",
        CONSUMER_ARGS + " --min-split-tokens 32 --eval-every 4 --eval-budget 1",
    ]
    env = _env(tmp_path)
    lives: list[Life] = []
    try:
        lives.append(life := Life(cmd, env, tmp_path, 1))
        _wait_for(lambda: "consumer-0" in life.launch(), life, "a consumer")
        c1 = life.launch()["consumer-0"]
        # mid-epoch 2: a checkpoint holds part of epoch 2, and a step more is trained (a lost tail)
        _wait_for(lambda: _checkpoint_in_epoch_2(ckpt, ROWS) is not None, life, "a checkpoint in epoch 2")
        at = _ledger_lines(run_dir, c1)
        _wait_for(lambda: _ledger_lines(run_dir, c1) > at, life, "a step after it")
        os.kill(c1, signal.SIGKILL)
        assert life.wait() != 0
        lives.append(life := Life(cmd, env, tmp_path, 2))
        assert life.wait() == 0, life.text()[-4000:]
    finally:
        for life in lives:
            life.kill_all()

    launches = [life.launch() for life in lives]
    final = load_checkpoint(str(ckpt), "epochs")
    lengths = eligible_lengths(data, tiny_target, tmp_path / "hf-audit", max_length=MAX_LENGTH)
    rows = set(lengths)
    epochs = Epochs(rows=ROWS, epochs=EPOCHS, eval_samples=HELD_OUT)
    held = set(epochs.held_out().tolist()) & rows
    assert held, "no held-out row survived tokenization"
    train_rows = sorted(rows - held)
    eligible = {int(i) for k in range(EPOCHS) for i in epochs.ids(k, train_rows)}
    got = audit(run_dir, launches, final.step, eligible, ranks=(0, 1))
    print(f"epochs audit: {got}")
    assert got["duplicates"] == 0 and got["missing"] == 0
    resumed = got["resumed"][max(got["resumed"])]
    assert resumed > 0, got  # the second launch resumed mid-campaign, not from scratch
    assert set(final.trained.indices().tolist()) == eligible
    # no step of the group (both ranks' samples of one step, in any life) mixes epochs or trains
    # a row twice: a rank whose step is of a later epoch than another's holds it and pads
    life_of = {launch[f"consumer-{r}"]: i for i, launch in enumerate(launches) for r in (0, 1)}
    group_steps: dict[tuple[int, int], list[int]] = {}
    for r in (0, 1):
        for rec in read_jsonl(run_dir / "metrics" / f"ledger-r{r}.jsonl"):
            group_steps.setdefault((life_of[rec["pid"]], rec["step"]), []).extend(rec["samples"])
    for (life_no, step), ids in sorted(group_steps.items()):
        assert len({i // ROWS for i in ids}) <= 1, f"life {life_no} step {step} mixes epochs: {ids}"
        assert len({i % ROWS for i in ids}) == len(ids), (
            f"life {life_no} step {step} trains a row twice: {ids}"
        )
    assert final.epoch == EPOCHS - 1 and final.meta["epoch"] == EPOCHS - 1  # the checkpoint records the epoch

    # the plan each launch printed: samples x epochs and the steps they make in full streams. Steps taken
    # exceed it only by streams packed short (data slower than training, the last ones): the fills of the
    # final timeline's steps add up to the tokens of the plan. (How many streams are short depends
    # on the box's speed, so the plan is checked against that identity, not against a step count.)
    log = (run_dir / "logs" / "consumer-0.log").read_text()
    plans = PLAN_LINE.findall(log)
    assert len(plans) == 2, log[-3000:]
    # the first launch's line is the plan; the resumed one's is the schedule's own count (the steps taken +
    # those the rest of the data makes), said as a resume
    samples, n_epochs, planned, warmup = map(int, plans[0])
    assert "; resumed at step" in [ln for ln in log.splitlines() if "campaign: " in ln][-1]
    assert (samples, n_epochs) == (len(train_rows), EPOCHS)
    tokens = EPOCHS * sum(lengths[r] for r in train_rows)
    assert planned == -(-tokens // (512 * 2)), (planned, tokens)
    assert warmup == max(1, int(0.04 * planned))
    steps = [r for r in read_jsonl(run_dir / "metrics" / "consumer-0.jsonl") if "loss" in r]
    # the final timeline: per step, the last record (life 2 redid life 1's lost tail, appended later)
    timeline = sorted({r["step"]: r for r in steps}.values(), key=lambda r: r["step"])
    assert [r["step"] for r in timeline] == list(range(1, final.step + 1))
    # a document split across the kill's step boundary (its head in a durable step, its tail lost) is
    # trained whole again: at most one such head per rank
    trained_tokens = round(sum(r["fill"] for r in timeline) * 512 * 2)
    assert tokens <= trained_tokens <= tokens + 2 * 512, (trained_tokens, tokens)
    print(f"planned {planned} steps, took {final.step} (fill {tokens / (final.step * 1024):.2f})")
    assert final.step >= planned
    # the console's step count follows the data: a stream packed short makes the schedule one step longer
    # (WarmupCosine.replan), so the last line's total is the steps taken
    last = re.findall(r"step=(\d+)/(\d+) epoch=(\d+)/(\d+)", log)[-1]
    assert last == (str(final.step), str(final.step), str(EPOCHS), str(EPOCHS)), last

    # the held-out set: spooled once into eval/ (never claimed, never trained), evaluated before the first
    # step, every --eval-every steps and after the last, with the real decode loop's rule
    from dflash.common.contract.spool import Spool

    assert sorted(Spool(spool, create=False).eval_sample_ids().tolist()) == sorted(held)
    evals = [r for r in read_jsonl(run_dir / "metrics" / "consumer-0.jsonl") if r.get("event") == "eval"]
    steps = [r["step"] for r in evals]
    assert steps[0] == 0 and steps[-1] == final.step and all(s % 4 == 0 for s in steps[1:-1]), steps
    # an evaluation walks the held-out documents spooled so far (consumer/held_out.py re-reads eval/ as
    # shards land): one run before the second producer has spooled its part sees fewer, on a loaded box;
    # the last one sees them all
    assert all(1 <= r["eval_docs"] <= len(held) and r["decode_tau"] >= 1.0 for r in evals), evals
    assert evals[-1]["eval_docs"] == len(held), evals
    assert "decode-order τ" in log
