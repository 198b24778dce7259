"""Background checkpoints: the snapshot is the state at the save step, a kill during the background upload
leaves the previous checkpoint as ``latest``, and the resumed run trains exactly the rest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from ledger_audit import read_jsonl
from pipeline_helpers import consume_cmd, cpu_env, write_synthetic_spool

from dflash.common.checkpoints.load import list_steps, load_checkpoint
from dflash.consumer.checkpointing.background import AsyncCheckpointer


def test_snapshot_is_the_state_at_the_save_not_after():
    """The copy is taken when snapshot_and_write is called: later in-place updates (the next optimizer
    steps) do not leak into the checkpoint being written."""
    ckpt = AsyncCheckpointer(torch.device("cpu"))
    w = torch.ones(1000)
    state = {
        "model": {"w": w},
        "optimizer": {"state": {0: {"exp_avg": w * 2}}, "param_groups": [{"lr": 1.0}]},
    }
    written = {}

    def write(host):
        time.sleep(0.2)  # the loop has moved on meanwhile
        written.update(w=host["model"]["w"].clone(), m=host["optimizer"]["state"][0]["exp_avg"].clone())
        return "url"

    ckpt.snapshot_and_write(5, state, write)
    w.add_(1.0)  # the next step
    [out] = ckpt.wait()
    assert out.error is None and out.url == "url" and out.step == 5
    assert torch.equal(written["w"], torch.ones(1000)) and torch.equal(written["m"], torch.full((1000,), 2.0))


def test_a_failed_background_write_is_reported_once():
    ckpt = AsyncCheckpointer(torch.device("cpu"))

    def write(_host):
        raise OSError("bucket gone\nsecond line")

    ckpt.snapshot_and_write(3, {"model": {"w": torch.zeros(3)}}, write)
    outs = ckpt.wait()
    assert [(o.step, o.error) for o in outs] == [(3, "bucket gone")]
    assert ckpt.wait() == []


# The consumer as a user runs it, except that its checkpoint store hangs while uploading one step's files
# (a stalled S3 upload): the test kills it with SIGKILL right then.
CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from dflash.consumer import cli
    from dflash.consumer import trainer as trainer_mod

    marker, hang_step = Path(sys.argv[1]), sys.argv[2]
    real_init = trainer_mod.Trainer.__init__

    def init(self, cfg, **kw):
        real_init(self, cfg, **kw)
        put_file = self.checkpoints.store.put_file

        def hanging_put_file(key, path):
            if hang_step in key:
                marker.write_text(key)
                time.sleep(3600)
            return put_file(key, path)

        self.checkpoints.store.put_file = hanging_put_file

    trainer_mod.Trainer.__init__ = init
    sys.exit(cli.main(sys.argv[3:]))
    """
)


def _ledger(run_dir) -> list[dict]:
    return read_jsonl(run_dir / "metrics" / "ledger-r0.jsonl")


def _spool(root):
    """24 samples in 6 shards of 4 x 96 tokens (random hidden states)."""
    return write_synthetic_spool(
        root,
        hidden_size=256,
        layer_ids=[1, 2, 3, 4, 5],
        num_shards=6,
        samples_per_shard=4,
        tokens_per_sample=96,
        vocab=4096,
    )


@pytest.mark.pipeline
def test_kill9_during_background_upload_resumes_from_the_previous_checkpoint(tmp_path, tiny_target):
    spool = _spool(tmp_path / "spool")
    store, run_dir, marker = tmp_path / "ckpt", tmp_path / "run", tmp_path / "uploading"
    args = consume_cmd(spool.root, tiny_target)[1:] + [
        "--context-tokens",
        "192",
        "--save-every",
        "3",
        "--checkpoint",
        str(store),
        "--run",
        "bg",
        "--run-dir",
        str(run_dir),
        "--compile-backend",
        "eager",
        "--log-every",
        "1",
    ]
    first = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(marker), "step-00000006", *args],
        env=cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300  # hang guard only
    while not marker.exists():
        assert first.poll() is None, first.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the upload of step 6 never started"
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=60)
    # latest still names the previous complete checkpoint, and it loads
    assert max(list_steps(str(store), "bg")) == 3
    ckpt3 = load_checkpoint(str(store), "bg")
    assert ckpt3.step == 3
    before = set(ckpt3.trained.indices().tolist())
    life1 = _ledger(run_dir)
    assert max(r["step"] for r in life1) >= 6  # training went on past the save while it uploaded

    # The re-run: producers re-produce every sample the checkpoint does not hold (here: a fresh spool of
    # all 24, as the first life acked shards it trained after step 3); the consumer resumes from step 3.
    spool2 = _spool(tmp_path / "spool2")
    args2 = [str(spool2.root) if a == str(spool.root) else a for a in args]
    again = subprocess.run(
        [consume_cmd(spool.root, tiny_target)[0], *args2],
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    life2 = _ledger(run_dir)[len(life1) :]
    trained2 = [i for r in life2 for i in r["samples"]]
    assert len(trained2) == len(set(trained2)), "a sample trained twice in one life"
    assert not before & set(trained2), "a sample of the resumed checkpoint trained again"
    final = load_checkpoint(str(store), "bg")
    assert sorted(final.trained.indices().tolist()) == list(range(24))
    assert before | set(trained2) == set(range(24))
    assert min(r["step"] for r in life2) == 4  # the step after the resumed checkpoint
