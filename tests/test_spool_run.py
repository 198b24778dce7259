"""The spool's parts: its run record, launch locks that die with their holder, and what a new
launch discards (``dflash-spool prepare``). Fast, in-process except for the lock holders."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from dflash.common.contract.liveness import lock_is_held
from dflash.common.contract.names import shard_name
from dflash.common.contract.spool import Spool
from dflash.common.contract.spool_records import RunMismatchError, SpoolBusyError
from dflash.tools.spool.cli import main as spool_main

IDENT = {
    "run": "alpha",
    "model": "/models/tiny",
    "layer_ids": [1, 2, 3],
    "dataset": {"spec": "/d.jsonl", "split": "train", "fingerprint": "f" * 32},
    "plan": {"epochs": 1, "rows": 80, "max_length": 512, "min_loss_tokens": 32, "format": "auto"},
}


def test_the_run_record_is_filled_in_then_enforced(tmp_path):
    sp = Spool(tmp_path / "s")
    assert sp.read_run() is None
    sp.bind_run({"run": "alpha"}, who="this consumer")  # a consumer (or run_all) binds the name first
    rec = sp.bind_run(IDENT, who="this producer")  # the producer fills in the rest
    assert {k: rec[k] for k in IDENT} == IDENT
    assert sp.bind_run({"run": "alpha"}) == rec  # the same run: accepted, unchanged
    with pytest.raises(RunMismatchError) as err:
        sp.bind_run({**IDENT, "run": "beta"}, who="this producer")
    msg = str(err.value)
    assert "\n" not in msg and "belongs to run 'alpha'" in msg and "this producer is run 'beta'" in msg
    with pytest.raises(RunMismatchError, match="the same run name with another dataset"):
        sp.bind_run({**IDENT, "dataset": {**IDENT["dataset"], "fingerprint": "0" * 32}})
    assert [sp.next_launch() for _ in range(3)] == [1, 2, 3]
    assert sp.read_run()["launches"] == 3 and sp.bind_run(IDENT)  # the counter is not identity


def _hold(path_root, name: str) -> subprocess.Popen:
    """A child process that takes lock-<name> and then sleeps (until killed)."""
    code = (
        "import sys, time\nfrom dflash.common.contract.spool import Spool\n"
        f"Spool({str(path_root)!r}).acquire_lock({name!r}, 'the test child')\nprint('held', flush=True)\ntime.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


@pytest.mark.pipeline
def test_a_lock_is_refused_while_its_holder_lives_and_free_once_it_is_killed(tmp_path):
    sp = Spool(tmp_path / "s")
    child = _hold(sp.root, "producer-n0")
    try:
        assert lock_is_held(sp.root / "lock-producer-n0")
        with pytest.raises(SpoolBusyError) as err:
            sp.acquire_lock("producer-n0", "me")
        assert "the test child" in str(err.value) and f"pid {child.pid}" in str(err.value)
        assert "producer-n0" in sp.live_locks()
    finally:
        child.send_signal(signal.SIGKILL)  # no cleanup runs: the kernel drops the lock
        child.wait()
    assert not lock_is_held(sp.root / "lock-producer-n0")
    lock = sp.acquire_lock("producer-n0", "me")  # the stale lock is no obstacle
    assert "me (pid" in (sp.root / "lock-producer-n0").read_text()
    lock.release()


def _publish(sp: Spool, producer: str, seq: int, where: str = "ready") -> None:
    import torch

    from dflash.common.contract.shard import Shard, ShardMeta
    from dflash.common.contract.shard_writer import write_shard

    t = 8
    shard = Shard(
        input_ids=torch.zeros(t, dtype=torch.int32),
        loss_mask=torch.ones(t, dtype=torch.bool),
        cu_seqlens=torch.tensor([0, 4, 8]),
        sample_index=torch.tensor([2 * seq, 2 * seq + 1]),
        hidden=torch.zeros(t, 4, dtype=torch.bfloat16),
        meta=ShardMeta(target_model="t", layer_ids=[1], hidden_size=4, producer_id=producer, bucket=8),
    )
    tmp = sp.new_tmp_path(shard_name(8, producer, seq))
    if where == "tmp":
        write_shard(tmp, shard)
        return
    sp.publish(tmp, nbytes=write_shard(tmp, shard))
    if where == "claimed":
        sp.claim("r0-1")
    elif where == "quarantine":
        sp.quarantine(sp.ready_dir / tmp.name, "test: corrupt")


@pytest.mark.pipeline
def test_prepare_refuses_another_run_and_discards_a_previous_launch(tmp_path, capsys):
    root = tmp_path / "s"
    assert spool_main(["prepare", str(root), "--run", "alpha"]) == 0
    assert "new, bound to run 'alpha'" in capsys.readouterr().out
    sp = Spool(root)
    sp.bind_run(IDENT)
    _publish(sp, "n0p0.1", 0, "tmp")
    _publish(sp, "n0p0.1", 1)
    _publish(sp, "n0p0.1", 2, "claimed")
    _publish(sp, "n0p0.1", 3, "quarantine")
    sp.register_producers(["n0p0.1"])
    sp.mark_done("n0p0.1")
    sp.heartbeat("producer", "n0p0.1", {"samples": 4})

    assert spool_main(["prepare", str(root), "--run", "beta"]) == 2  # another run: refused, untouched
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "belongs to run 'alpha'" in err[0] and "this launch is run 'beta'" in err[0]
    assert len(sp.leftover_shards()) == 2

    child = _hold(root, "consumer-r0")  # a live consumer of the run: refused, untouched
    try:
        assert spool_main(["prepare", str(root), "--run", "alpha"]) == 2
        assert "in use by a live process" in capsys.readouterr().err
    finally:
        child.kill()
        child.wait()

    assert spool_main(["prepare", str(root), "--run", "alpha"]) == 0
    out = capsys.readouterr().out
    assert "run 'alpha' continues; discarded 2 shards (4 samples)" in out, out
    assert not sp.leftover_shards() and not any(sp.tmp_dir.iterdir())
    assert not list(sp.quarantine_dir.glob("*.zarr")) and len(list(sp.quarantine_dir.glob("*.why"))) == 1
    assert sp.registered_producers() == [] and sp.done_producers() == [] and sp.heartbeats() == []
    assert {k: sp.read_run()[k] for k in IDENT} == IDENT  # the identity stays

    assert spool_main(["prepare", str(root), "--run", "beta", "--fresh"]) == 0
    assert "fresh, bound to run 'beta'" in capsys.readouterr().out
    assert (
        sp.read_run()["run"] == "beta"
        and json.loads((root / "state" / "run.json").read_text())["run"] == "beta"
    )
