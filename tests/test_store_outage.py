"""A checkpoint store that stops taking saves mid-run: the consumer trains on for a bounded number of failed
saves, then writes its state to local disk and stops with one line; the same command, once the store is
back, resumes from that state, uploads it and trains every remaining sample, each sample trained once
(consumer/checkpointing/outage.py, docs/reliability.md)."""

from __future__ import annotations

import subprocess
import uuid
from collections import Counter

import pytest
from conftest import FAKE_SECRET_ACCESS_KEY, wait_until
from ledger_audit import read_jsonl
from pipeline_helpers import consume_cmd
from test_faults import FaultProxy, _publish_synthetic, _s3_env

from dflash.common.contract.spool import Spool
from dflash.consumer.checkpointing.outage import OutagePolicy, with_retries

SAVE_EVERY = 2
OUTAGE_SAVES = 2


def test_outage_policy_stops_after_the_failed_saves_or_the_minutes():
    p = OutagePolicy(max_failed_saves=3, max_minutes=10)
    assert p.exceeded(now=0) is None
    p.save_failed(now=100.0)
    p.save_failed(now=160.0)
    assert p.exceeded(now=161.0) is None
    assert "no checkpoint saved for 10.0 min" in p.exceeded(now=700.0)  # timed from the first failure
    p.saved()
    assert p.exceeded(now=10_000.0) is None and p.failed == 0
    for t in range(3):
        p.save_failed(now=float(t))
    assert "3 checkpoint saves in a row failed" in p.exceeded(now=3.0)


def test_a_failed_write_is_tried_again_then_raises():
    from dflash.common.checkpoints.store import CheckpointStoreError

    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 2:
            raise CheckpointStoreError("injected")
        return "ok"

    assert with_retries(flaky, pause_s=0.0) == "ok" and len(calls) == 2
    with pytest.raises(CheckpointStoreError, match="down"):
        with_retries(lambda: (_ for _ in ()).throw(CheckpointStoreError("down")), pause_s=0.0)


@pytest.mark.slow
def test_a_store_outage_stops_training_within_the_bound_and_the_same_command_resumes_every_sample_once(
    s3_endpoint, _s3_admin_client, tiny_target, tmp_path
):
    bucket = f"dflash-outage-{uuid.uuid4().hex[:10]}"
    _s3_admin_client.create_bucket(Bucket=bucket)
    proxy = FaultProxy(s3_endpoint, seed=11)
    env = _s3_env(proxy)
    run_dir = tmp_path / "run"
    ledger = run_dir / "metrics" / "ledger-r0.jsonl"
    metrics = run_dir / "metrics" / "consumer-0.jsonl"
    spool = Spool(tmp_path / "spool")
    spool.register_producers(["p0"])
    cmd = consume_cmd(
        spool.root,
        tiny_target,
        "--checkpoint",
        f"s3://{bucket}/ckpt",
        "--run",
        "outage",
        "--run-dir",
        str(run_dir),
        "--compile-backend",
        "eager",
        "--eval-every",
        "0",
        "--save-every",
        str(SAVE_EVERY),
        "--outage-saves",
        str(OUTAGE_SAVES),
    )

    def latest() -> str | None:
        try:
            body = _s3_admin_client.get_object(Bucket=bucket, Key="ckpt/outage/latest")["Body"]
            return body.read().decode().strip()
        except _s3_admin_client.exceptions.NoSuchKey:
            return None

    try:
        # life 1: the first checkpoint lands, then the store refuses everything
        samples = _publish_synthetic(spool, range(0, 2))
        log1 = tmp_path / "consumer1.log"
        proc = subprocess.Popen(cmd, env=env, stdout=open(log1, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
        try:
            wait_until(
                lambda: (
                    any(r.get("event") == "checkpoint" for r in read_jsonl(metrics))
                    or proc.poll() is not None
                ),
                timeout_s=180,
                what="the first checkpoint",
            )
            proxy.set("deny")
            samples += _publish_synthetic(spool, range(2, 14), seed=1)  # 12 more steps: more than the bound
            rc1 = proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text1 = log1.read_text()
        assert rc1 == 1, text1[-3000:]
        last = text1.strip().splitlines()[-1]
        steps1 = [r["step"] for r in read_jsonl(ledger)]
        stop_step = max(steps1)
        fallback = run_dir / "fallback-checkpoint" / "outage"
        assert last.startswith("dflash-consume: error: StoreOutageError: checkpoint step"), last
        assert f"--outage-saves {OUTAGE_SAVES}" in last and f"stopped at step {stop_step}" in last, last
        assert str(fallback) in last and "run the same command" in last, last
        assert "Traceback" not in text1 and FAKE_SECRET_ACCESS_KEY not in text1
        assert latest() == f"step-{SAVE_EVERY:08d}"  # the store still names the last good checkpoint
        # the bound: at most (outage-saves + 1 in flight) x save-every steps past the store's latest,
        # and all of them are in the local state, so none is lost
        assert stop_step - SAVE_EVERY <= (OUTAGE_SAVES + 1) * SAVE_EVERY, steps1
        assert stop_step < 14  # it stopped, it did not train everything into nothing
        from dflash.common.checkpoints.load import load_checkpoint
        from dflash.common.checkpoints.store import LocalStore

        local = load_checkpoint(LocalStore(run_dir / "fallback-checkpoint"), "outage")
        assert local.step == stop_step
        trained1 = {s for r in read_jsonl(ledger) for s in r["samples"]}
        assert set(local.trained.indices().tolist()) == trained1

        # the store is back: the same command uploads the local state, resumes from it and drains the spool
        proxy.set("pass")
        spool.mark_done("p0")
        p2 = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        text2 = p2.stdout + p2.stderr
        assert p2.returncode == 0, text2[-3000:]
        assert f"resumed from step {stop_step}" in text2, text2[-3000:]
        assert not fallback.exists()  # uploaded, then removed
        final = load_checkpoint(_store(_s3_admin_client, bucket), "outage")
        assert sorted(final.trained.indices().tolist()) == sorted(samples)
        trained = Counter(s for r in read_jsonl(ledger) for s in r["samples"])
        assert set(trained) == set(samples) and set(trained.values()) == {1}, trained  # each sample once
    finally:
        proxy.close()


def _store(client, bucket: str):
    from dflash.common.checkpoints.s3 import S3Store

    return S3Store(bucket, "ckpt", client=client)
