"""The data path in its own process (consumer/data_worker.py): exactly the in-process batches, a worker
killed mid-run restarted with nothing lost or trained twice, an error in it one clear line, no process or
/dev/shm semaphore left behind."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import subprocess
import time

import pytest
import torch
from conftest import wait_until
from ledger_audit import audit, read_jsonl
from pipeline_helpers import SemaphoreSpy, consume_cmd, cpu_env, process_alive, run, write_synthetic_spool
from test_input_pipeline import H, K
from test_input_pipeline import _publish as publish_shard

from dflash.common.contract.sample_set import SampleSet
from dflash.common.contract.spool import Spool
from dflash.common.drafter.batch import DraftBatch, build_draft_batch
from dflash.consumer.data_worker import DataWorker, WorkerSpec
from dflash.consumer.feed import ShardFeed

CONTEXT, SEED = 256, 7 * 1000 + 0  # H, K: the shards of test_input_pipeline
FEED = dict(context_tokens=CONTEXT, bucket=None, pool_streams=2, min_split_tokens=32, fill_wait_s=1e9, poll_s=0.01, expected_layer_ids=[1, 2])  # fmt: skip
BATCH = dict(block_size=4, num_anchors=24, max_anchors_per_doc=6, mask_token_id=1, gamma=7.0)


def _spool(root, *, shards: int = 10, seed: int = 3) -> tuple[Spool, int]:
    """Shards of chat-like lengths (documents get split). Its producer is done but its heartbeat (this
    test's process) says it still produces, so a feed packs only from a full pool or the run's last
    samples: the streams do not depend on how fast the decode thread was (they must be compared)."""
    spool = Spool(root)
    rng = random.Random(seed)
    index = 0
    for seq in range(shards):
        lengths = [rng.choice([20, 40, 90, 150, 200, 250]) for _ in range(6)]
        publish_shard(spool, lengths, index, seq, seed * 100 + seq)
        index += len(lengths)
    spool.register_producers(["p0"])
    spool.heartbeat("producer", "p0", {})
    spool.mark_done("p0")
    return spool, index


def _spec(spool: Spool) -> WorkerSpec:
    return WorkerSpec(spool=str(spool.root), consumer_id="c0", feed=FEED, batch=BATCH, seed=SEED, hidden_width=K * H)


def _in_process(spool: Spool) -> list[tuple[DraftBatch, list[int]]]:
    """Today's path, serially: the feed packs, the trainer's seeded generator builds, commit in order."""
    feed = ShardFeed(spool, "c0", skip=SampleSet(), **FEED)
    gen = torch.Generator().manual_seed(SEED)
    out = []
    try:
        while not feed.exhausted():
            packed = feed.next_packed(wait_s=0.2)
            if packed is not None:
                batch = build_draft_batch(packed, generator=gen, **BATCH)
                out.append((batch, feed.commit()))
    finally:
        feed.close()
    return out


def _drain(worker: DataWorker, trained: SampleSet, *, kill_after: int | None = None, timeout_s: float = 60):
    """Train-loop stand-in: take every step, commit it, grow the trained set; kill -9 the worker once."""
    steps, t0 = [], time.monotonic()
    while not worker.exhausted():
        assert time.monotonic() - t0 < timeout_s, "the data worker hung"
        item = worker.get(timeout=0.5)
        if item is None:
            continue
        done = worker.commit()
        trained.add(done)
        steps.append((item, done))
        if kill_after is not None and len(steps) == kill_after:
            os.kill(worker.pid, signal.SIGKILL)
    return steps


def test_worker_process_yields_exactly_the_in_process_batches(tmp_path):
    """Same spool, same seed: every tensor of every DraftBatch, its tokens, weight, epoch and the samples
    each step completes are the in-process path's, in the same order; every shard is acked."""
    spool, n = _spool(tmp_path / "a")
    shutil.copytree(spool.root, tmp_path / "b")
    reference = _in_process(spool)
    other = Spool(tmp_path / "b")
    worker = DataWorker(_spec(other), SampleSet(), device=torch.device("cpu"), hidden_dtype=torch.bfloat16, slots=2)
    try:
        got = _drain(worker, SampleSet())
    finally:
        worker.close()
    assert len(got) == len(reference) >= 8
    for (ref, ref_done), (item, done) in zip(reference, got, strict=True):
        b = item.batch
        for f in dataclasses.fields(DraftBatch):
            x, y = getattr(ref, f.name), getattr(b, f.name)
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x, y), f.name
            else:
                assert x == y, f.name
        assert done == ref_done
        assert item.tokens == int((ref.doc_ids >= 0).sum())
        assert item.weight == float(ref.label_weights.sum(dtype=torch.float64))
    assert sorted(i for _, d in got for i in d) == list(range(n))
    assert worker.counters.tokens_packed == sum(item.tokens for item, _ in got)
    assert other.stats()["states"]["claimed"]["shards"] == 0 and not any(other.ready_dir.iterdir())
    assert not process_alive(worker.pid)


def test_a_killed_worker_is_restarted_and_nothing_is_lost_or_trained_twice(tmp_path, monkeypatch):
    """kill -9 of the worker after two steps: its claims go back at once, a new worker skips what was
    trained; every sample is completed exactly once. Closing leaves no process and no named semaphore."""
    spy = SemaphoreSpy(tmp_path)
    monkeypatch.setenv("PYTHONPATH", spy.env["PYTHONPATH"])  # the spawned workers load the spy
    spool, n = _spool(tmp_path / "s", shards=12)
    trained = SampleSet()
    worker = DataWorker(_spec(spool), trained, device=torch.device("cpu"), hidden_dtype=torch.float32, slots=3)
    first = worker.pid
    t0 = time.monotonic()
    try:
        steps = _drain(worker, trained, kill_after=2)
    finally:
        worker.close()
    print(f"drained with one restart in {time.monotonic() - t0:.1f} s")
    assert worker.restarts == 1 and worker.pid != first
    done = [i for _, d in steps for i in d]
    assert sorted(done) == list(range(n)), "every sample completed exactly once"
    assert spool.stats()["states"]["claimed"]["shards"] == 0 and not any(spool.ready_dir.iterdir())
    assert not process_alive(first) and not process_alive(worker.pid)
    assert spy.named() == [], spy.named()[0]
    assert spy.anonymous() > 0, "the spy did not run in the workers"


def test_a_worker_that_keeps_dying_stops_the_run_with_one_line(tmp_path):
    spool, _ = _spool(tmp_path / "s", shards=4)
    worker = DataWorker(
        _spec(spool), SampleSet(), device=torch.device("cpu"), hidden_dtype=torch.float32, max_restarts=1
    )
    try:
        os.kill(worker.pid, signal.SIGKILL)
        wait_until(lambda: worker.get(timeout=0.2) is None and worker.restarts == 1, timeout_s=20, what="restart")
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while True:
            try:
                worker.get(timeout=0.2)
            except RuntimeError as err:
                assert "the data worker died 2 times (last: pid" in str(err) and "SIGKILL" in str(err)
                break
            assert time.monotonic() < deadline, "a dead worker went unnoticed"
    finally:
        worker.close()
    assert not process_alive(worker.pid)
    assert spool.stats()["states"]["claimed"]["shards"] == 0  # its claims are back in ready/


# ------------------------------------------------------------------------------- dflash-consume, end to end
def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _data_worker_of(pid: int) -> int | None:
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            return child
    return None


def test_consume_survives_kill9_of_its_data_worker_with_an_exact_ledger(tmp_path, tiny_target):
    """dflash-consume --data-workers 1: kill -9 its worker mid-run; the run finishes (exit 0), the
    ledger audit finds no sample lost or trained twice, and no process of it is left."""
    num_shards, per_shard = 24, 8
    spool = write_synthetic_spool(
        tmp_path / "spool", hidden_size=256, layer_ids=[1, 2, 3, 4, 5], num_shards=num_shards,
        samples_per_shard=per_shard, tokens_per_sample=32, vocab=4096,
    )  # fmt: skip
    run_dir = tmp_path / "run"
    cmd = consume_cmd(spool.root, tiny_target, "--run-dir", str(run_dir), "--context-tokens", "256", "--num-anchors", "16", "--compile-backend", "eager", "--data-workers", "1", "--eval-every", "0", "--log-every", "2")  # fmt: skip
    run_dir.mkdir()
    with open(run_dir / "stderr.log", "w") as err:
        proc = subprocess.Popen(cmd, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=err)
    ledger = run_dir / "metrics" / "ledger-r0.jsonl"
    try:
        wait_until(lambda: len(read_jsonl(ledger)) >= 2, timeout_s=120, what="two trained steps")
        victim = _data_worker_of(proc.pid)
        assert victim is not None, "no data worker process"
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (run_dir / "stderr.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert f"data worker pid {victim} died (killed by SIGKILL)" in log, log[-3000:]
    lines = read_jsonl(ledger)
    assert len(read_jsonl(ledger)) > 2
    counts = audit(run_dir, [{"consumer-0": proc.pid}], max(x["step"] for x in lines), set(range(num_shards * per_shard)))
    assert counts["duplicates"] == 0 and counts["missing"] == 0
    assert not process_alive(victim) and not _children(proc.pid)
    assert not any(spool.ready_dir.iterdir()) and spool.stats()["states"]["claimed"]["shards"] == 0


def test_an_error_in_the_data_worker_is_one_line_and_exit_1(tmp_path, tiny_target):
    """Shards of other target layers: the worker's feed raises; its text comes back as one line, exit
    status 1 (a runtime failure, README "Errors and exit codes"), no traceback, the shard given back."""
    spool = write_synthetic_spool(
        tmp_path / "spool", hidden_size=256, layer_ids=[0, 1, 2, 3, 4], num_shards=1, samples_per_shard=4,
        tokens_per_sample=64, vocab=4096,
    )  # fmt: skip
    proc = run(consume_cmd(spool.root, tiny_target, "--max-steps", "2", "--data-workers", "1", "--compile-backend", "eager"), timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert lines[-1].startswith("dflash-consume: error: RuntimeError: data worker failed:"), lines[-1]
    assert "holds target layers [0, 1, 2, 3, 4]" in lines[-1], lines[-1]
    assert "Traceback" not in proc.stderr
    assert len(list(spool.ready_dir.iterdir())) == 1


def test_consume_trains_the_same_weights_with_and_without_the_data_worker(tmp_path, tiny_target):
    """End to end: the same spool, --data-workers 0 and 1: the same steps and the very same weights (the
    producer's heartbeat says it produces, so streams are packed only from full pools: see _spool)."""
    src = write_synthetic_spool(
        tmp_path / "src", hidden_size=256, layer_ids=[1, 2, 3, 4, 5], num_shards=12, samples_per_shard=6,
        tokens_per_sample=48, vocab=4096,
    )  # fmt: skip
    summaries, procs = {}, {}
    for workers in ("0", "1"):
        root = tmp_path / f"spool{workers}"
        shutil.copytree(src.root, root)
        Spool(root).heartbeat("producer", "p0", {})
        out = tmp_path / f"summary{workers}.json"
        cmd = consume_cmd(root, tiny_target, "--context-tokens", "256", "--num-anchors", "16", "--compile-backend", "eager", "--bucket", "oldest", "--eval-every", "0", "--data-workers", workers, "--summary-json", str(out))  # fmt: skip
        procs[workers] = (subprocess.Popen(cmd, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), out)  # fmt: skip
    for workers, (proc, out) in procs.items():
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        summaries[workers] = __import__("json").loads(out.read_text())
    a, b = summaries["0"], summaries["1"]
    assert a["steps"] == b["steps"] >= 6 and a["samples_trained"] == b["samples_trained"] == 72
    assert a["fill"] == b["fill"]
    assert a["weights_sha256"] == b["weights_sha256"]


def test_slots_that_dev_shm_cannot_hold_are_refused_in_one_line():
    from dflash.consumer.data_worker import _check_shm

    _check_shm(1 << 20)
    with pytest.raises(RuntimeError, match=r"input slots need \d+ MiB of /dev/shm.*--data-workers 0"):
        _check_shm(1 << 60)
