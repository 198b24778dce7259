"""``dflash-spool audit RUN_DIR``: the exactly-once audit a user can run on a run's sample ledgers
(tools/spool/audit.py): launches, lost tails, twice, and with the checkpoint store, missing samples."""

from __future__ import annotations

import json

import torch

from dflash.common.checkpoints.save import save_checkpoint
from dflash.common.contract.sample_set import SampleSet
from dflash.tools.spool import cli as spool_cli


def _ledger(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _two_launches(run_dir, *, retrain: list[int]):
    """Launch 1 (ranks 0, 1; pids 10, 11) checkpointed at step 2 and died after step 3 (its lost tail);
    launch 2 (rank 0 only, pid 20) resumed from step 2 and redid step 3's samples plus ``retrain``."""
    _ledger(
        run_dir / "metrics" / "ledger-r0.jsonl",
        [
            {"step": 1, "pid": 10, "epoch": 0, "samples": [0, 1]},
            {"step": 2, "pid": 10, "epoch": 0, "samples": [2]},
            {"step": 3, "pid": 10, "epoch": 0, "samples": [6]},
            {"step": 3, "pid": 20, "epoch": 0, "samples": [6, 7, *retrain]},
            {"step": 4, "pid": 20, "epoch": 1, "samples": [10, 11]},
        ],
    )
    _ledger(
        run_dir / "metrics" / "ledger-r1.jsonl",
        [
            {"step": 1, "pid": 11, "epoch": 0, "samples": [3]},
            {"step": 2, "pid": 11, "epoch": 0, "samples": [4, 5]},
            {"step": 3, "pid": 11, "epoch": 0, "samples": [8]},
        ],
    )


def test_an_exact_run_passes_with_its_lost_tail_and_epochs(tmp_path, capsys):
    _two_launches(tmp_path, retrain=[8])
    assert spool_cli.main(["audit", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 launch(es) of the consumers; final step 4; 11 samples trained durably" in out
    assert "launch 1: steps 1..2, lost tail 2 samples (redone)" in out and "launch 2: steps 3..4" in out
    assert "epoch 1: 9 samples, 0 twice" in out and "epoch 2: 2 samples, 0 twice" in out
    assert "exactly once: twice 0" in out and "missing: not checked" in out


def test_a_sample_trained_twice_or_missing_from_the_ledgers_fails(tmp_path, capsys):
    _two_launches(tmp_path, retrain=[8, 1])  # sample 1 was durable in launch 1
    assert spool_cli.main(["audit", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["twice"] == 1 and report["twice_first"] == [1]
    # the final checkpoint holds a sample no ledger line trained durably: missing
    store = tmp_path / "ckpt"
    save_checkpoint(
        str(store),
        "r",
        4,
        model_state={"w": torch.zeros(1)},
        optimizer_state={},
        scheduler_state={},
        rng_state={},
        trained=SampleSet.from_indices([*range(12), 99]),
        config={},
    )
    _two_launches(tmp_path, retrain=[8])
    assert spool_cli.main(["audit", str(tmp_path), "--checkpoint", str(store), "--run", "r"]) == 1
    out = capsys.readouterr().out
    assert "NOT exactly once" in out and "missing 2 (e.g. [9, 99])" in out, out


def test_no_ledger_is_one_line_exit_2(tmp_path, capsys):
    assert spool_cli.main(["audit", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-spool: error: no sample ledger in") and "\n" not in err


def test_a_missing_run_dir_is_one_line_exit_2(capsys):
    assert spool_cli.main(["audit", "/nonexistent/run"]) == 2
    assert capsys.readouterr().err.strip() == "dflash-spool: error: run dir /nonexistent/run: no such folder"
