"""epochs are trained in order and no step trains one row twice.

A 3-epoch campaign through ``ops/run_all.sh`` with two CPU producers (their epoch barrier) and one
consumer; verdicts from the consumer's sample ledger, where a sample id is ``epoch x rows + row``:

- every step's samples are of one epoch, and the steps' epochs never go down (epoch k's samples are all
  trained before epoch k+1's: with one consumer there is no overlap at all);
- no step holds two trainings of one row;
- every eligible row is trained once per epoch.

Before this, the producers' length buckets pooled samples across epoch boundaries (a batch, hence a
shard, mixed epochs), a fast producer ran into the next epoch while a slow one still wrote this one, and
consumers claimed any ready shard: epoch-2 samples appeared from step 3 and rows were trained twice in
one step.
"""

from __future__ import annotations

from collections import Counter

import pytest
from ledger_audit import eligible_lengths, read_jsonl
from test_rerun import CONSUMER_ARGS, MAX_LENGTH, Life, _dataset, _env

from dflash.common.contract.epochs import Epochs

ROWS = 24
EPOCHS = 3


@pytest.mark.slow
def test_three_epochs_two_producers_train_in_order_and_never_a_row_twice_in_a_step(tmp_path, tiny_target):
    from test_rerun import REPO

    data = _dataset(tmp_path / "data.jsonl", ROWS)
    run_dir = tmp_path / "run"
    cmd = [
        "bash",
        str(REPO / "ops" / "run_all.sh"),
        "--producers",
        "cpu:2",
        "--consumers",
        "cpu:1",
        "--model",
        str(tiny_target),
        "--dataset",
        str(data),
        "--run",
        "order",
        "--run-dir",
        str(run_dir),
        "--spool",
        str(tmp_path / "spool"),
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--epochs",
        str(EPOCHS),
        "--producer-args",
        f"--max-length {MAX_LENGTH} --batch-tokens 2048",
        "--consumer-args",
        CONSUMER_ARGS + " --save-every 1000 --eval-every 0",
    ]
    life = Life(cmd, _env(tmp_path), tmp_path, 1)
    try:
        assert life.wait() == 0, life.text()[-4000:]
    finally:
        life.kill_all()
    # a finished run frees its spool's RAM (a failed or stopped one keeps it: test_rerun, test_run_all)
    assert not (tmp_path / "spool").exists() and "removed the spool" in life.text()

    steps = sorted(read_jsonl(run_dir / "metrics" / "ledger-r0.jsonl"), key=lambda r: r["step"])
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    epochs_of_steps = []
    for rec in steps:
        ids = rec["samples"]
        epochs = {i // ROWS for i in ids}
        assert len(epochs) <= 1, f"step {rec['step']} mixes epochs {sorted(epochs)}: {ids}"
        rows = Counter(i % ROWS for i in ids)
        assert max(rows.values(), default=0) == 1, f"step {rec['step']} trains a row twice: {ids}"
        if epochs:
            epochs_of_steps.append(epochs.pop())
    assert epochs_of_steps == sorted(epochs_of_steps), f"epochs out of order: {epochs_of_steps}"

    lengths = eligible_lengths(data, tiny_target, tmp_path / "hf-audit", max_length=MAX_LENGTH)
    eligible = {
        int(i) for k in range(EPOCHS) for i in Epochs(rows=ROWS, epochs=EPOCHS).ids(k, sorted(lengths))
    }
    trained = Counter(i for rec in steps for i in rec["samples"])
    assert set(trained) == eligible and max(trained.values()) == 1
    # the console says which epoch a step belongs to (the step's data, not a count of samples)
    log = (run_dir / "logs" / "consumer-0.log").read_text()
    assert f"epoch={EPOCHS}/{EPOCHS}" in log and "epoch=1/3" in log
