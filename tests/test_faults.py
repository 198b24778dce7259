"""Faults and bad input, each against the real processes: a full spool, a producer parent killed under its
workers, S3 failing (a fault-injecting HTTP proxy in front of moto's server), a corrupt checkpoint, fuzzed
dataset rows, and the security rules (0700 spool dirs, weights-only torch.load, no credentials in logs or
checkpoint metadata). docs/reliability.md maps every fault to the test that proves it.
"""

from __future__ import annotations

import ast
import http.client
import json
import os
import random
import signal
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch
from conftest import FAKE_ACCESS_KEY_ID, FAKE_SECRET_ACCESS_KEY, wait_until
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from ledger_audit import read_jsonl
from pipeline_helpers import BIN, REPO, consume_cmd, cpu_env, process_alive

from dflash.common.contract.names import shard_name
from dflash.common.contract.shard import Shard, ShardMeta
from dflash.common.contract.shard_writer import write_shard
from dflash.common.contract.spool import Spool
from dflash.common.contract.spool_records import BUDGET_PHASE
from dflash.tools.demo.assets import demo_dataset_path

HIDDEN, LAYERS, VOCAB, TOKENS_PER_SAMPLE, SAMPLES_PER_SHARD = 256, [1, 2, 3, 4, 5], 4096, 96, 5


# ----------------------------------------------------------------------------------------------- helpers
def _vmrss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _heartbeat(spool: Path, producer_id: str = "n0p0.1") -> dict:  # .1: the spool's first launch
    try:
        return json.loads((spool / "state" / f"producer-{producer_id}.json").read_text())
    except (OSError, ValueError):
        return {}


def _demo_rows(path: Path, n: int) -> Path:
    with open(demo_dataset_path(), encoding="utf-8") as f:
        rows = [{"messages": json.loads(line)["messages"]} for _, line in zip(range(n), f, strict=False)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _eligible(data: Path, target: Path, cache: Path, *, max_length: int) -> set[int]:
    """Samples a producer keeps (min_loss_tokens = 2 x block size, as dflash-produce sets it)."""
    from transformers import AutoTokenizer

    from dflash.common.target.chat import tokenize_slice
    from dflash.common.target.data import DataConfig, load_raw_dataset

    cfg = DataConfig(dataset=str(data), max_length=max_length, min_loss_tokens=32, cache_dir=str(cache))
    ds = load_raw_dataset(cfg)
    out = tokenize_slice(ds, AutoTokenizer.from_pretrained(target), cfg, np.arange(len(ds)))
    return {int(i) for i, s in zip(out["sample_index"], out["status"], strict=True) if s == "ok"}


def _produce_cmd(spool: Path, target: Path, data: Path, *extra: str) -> list[str]:
    return [
        str(BIN / "dflash-produce"),
        "--gpus",
        "cpu:1",
        "--model",
        str(target),
        "--dataset",
        str(data),
        "--spool",
        str(spool),
        "--max-length",
        "512",
        "--progress-s",
        "1",
        *extra,
    ]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return cpu_env(
        HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false", **extra
    )


def _publish_synthetic(spool: Spool, seqs: range, *, seed: int = 0) -> list[int]:
    """Random shards with sample indices seq*5 .. seq*5+4 (consumer tests that need no real target)."""
    g = torch.Generator().manual_seed(seed)
    indices: list[int] = []
    for seq in seqs:
        n, t = SAMPLES_PER_SHARD, SAMPLES_PER_SHARD * TOKENS_PER_SAMPLE
        shard = Shard(
            input_ids=torch.randint(0, VOCAB, (t,), generator=g, dtype=torch.int32),
            loss_mask=torch.rand(t, generator=g) > 0.3,
            cu_seqlens=torch.arange(0, t + 1, TOKENS_PER_SAMPLE, dtype=torch.int64),
            sample_index=torch.arange(seq * n, (seq + 1) * n, dtype=torch.int64),
            hidden=torch.randn(t, len(LAYERS) * HIDDEN, generator=g).to(torch.bfloat16),
            meta=ShardMeta(
                target_model="tiny",
                layer_ids=LAYERS,
                hidden_size=HIDDEN,
                producer_id="p0",
                bucket=TOKENS_PER_SAMPLE,
            ),
        )
        tmp = spool.new_tmp_path(shard_name(TOKENS_PER_SAMPLE, "p0", seq))
        spool.publish(tmp, nbytes=write_shard(tmp, shard))
        indices.extend(range(seq * n, (seq + 1) * n))
    return indices


# ------------------------------------------------------------------------------------------- spool full
@pytest.mark.slow
def test_spool_full_blocks_the_producer_drops_nothing_and_bounds_bytes_and_memory(tmp_path, tiny_target):
    """A budget far below one shard: the producer publishes one shard and blocks (no sample dropped, the
    spool never holds more than budget + one shard, the worker's RSS stays flat) until a consumer drains
    the spool; then every sample is trained exactly once. The spool's directories are 0700 under umask 022."""
    data = _demo_rows(tmp_path / "data.jsonl", 20)
    spool, run_dir, ckpt = tmp_path / "spool", tmp_path / "run", tmp_path / "ckpt"
    budget = 100_000  # bytes; a shard of this dataset is ~0.3-1.5 MB
    env = _env(tmp_path)
    prod_log = open(tmp_path / "produce.log", "w")  # noqa: SIM115 - closed in finally
    producer = subprocess.Popen(
        _produce_cmd(
            spool,
            tiny_target,
            data,
            "--batch-tokens",
            "1024",
            "--budget-gb",
            str(budget / 1e9),
            "--run",
            "full",
            "--run-dir",
            str(run_dir),
        ),
        env=env,
        stdout=prod_log,
        stderr=subprocess.STDOUT,
        umask=0o022,
    )
    consumer = None
    # (time, spool bytes, largest shard so far, worker RSS MB), every 20 ms
    samples: list[tuple[float, int, int, float | None]] = []
    modes: dict[str, int] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            if (spool / "state").is_dir():
                # one walk gives the total AND each entry's size at that moment, so the bound below is
                # checked per sample, whatever this thread's sampling rate on a loaded box
                entries = [
                    size for *_, size in Spool(spool, create=False).scan.entries(("tmp", "ready", "claimed"))
                ]
                owners = [d for d in (spool / "claimed").iterdir() if d.is_dir()]
                for d in [spool, *(spool / name for name in (*Spool.STATES, "state")), *owners]:
                    try:
                        modes[str(d.relative_to(spool))] = d.stat().st_mode & 0o777
                    except OSError:
                        pass
                pid = _heartbeat(spool).get("pid")
                samples.append(
                    (time.monotonic(), sum(entries), max(entries, default=0), pid and _vmrss_mb(pid))
                )
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        # 1. the producer fills the spool past its budget and blocks: its writers wait, then its forward loop
        wait_until(
            lambda: (
                _heartbeat(spool).get("counters", {}).get("phase") == BUDGET_PHASE
                or producer.poll() is not None
            ),
            timeout_s=300,  # hang guard: start-up + tokenization on a loaded box
            what="the producer to block on the spool budget",
        )
        assert producer.poll() is None, (tmp_path / "produce.log").read_text()[-3000:]
        t_blocked = time.monotonic()
        time.sleep(3.0)  # stays blocked: nothing published, memory flat
        blocked_ready = sorted(p.name for p in (spool / "ready").iterdir())
        assert len(blocked_ready) == 1, blocked_ready
        assert _heartbeat(spool)["counters"]["samples"] < 20

        # 2. a consumer drains the spool: the producer resumes and finishes
        consumer = subprocess.Popen(
            consume_cmd(
                spool,
                tiny_target,
                "--checkpoint",
                str(ckpt),
                "--run",
                "full",
                "--run-dir",
                str(run_dir),
                "--save-every",
                "1000",
                "--log-every",
                "1",
                "--compile-backend",
                "eager",
                "--fill-wait-s",
                "0.2",
            ),  # short steps are the point here: do not wait to fill
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            umask=0o022,
        )
        c_out, _ = consumer.communicate(timeout=300)
        assert consumer.returncode == 0, c_out[-3000:]
        assert producer.wait(timeout=60) == 0, (tmp_path / "produce.log").read_text()[-3000:]
    finally:
        stop.set()
        sampler.join(timeout=5)
        for p in (producer, consumer):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        prod_log.close()

    counters = _heartbeat(spool)["counters"]
    assert counters["done"] is True and counters["samples"] + counters["dropped"] == counters["total"] == 20
    assert counters["budget_wait_s"] > 2.0, counters  # it really waited on the budget

    # nothing dropped, nothing twice: the ledger and the checkpoint hold every kept sample exactly once
    eligible = _eligible(data, tiny_target, tmp_path / "hf-audit", max_length=512)
    assert len(eligible) == counters["samples"]
    trained = Counter(
        s for rec in read_jsonl(run_dir / "metrics" / "ledger-r0.jsonl") for s in rec["samples"]
    )
    assert set(trained) == eligible and set(trained.values()) == {1}, trained
    from dflash.common.checkpoints.load import load_checkpoint

    assert set(load_checkpoint(str(ckpt), "full").trained.indices().tolist()) == eligible

    # bytes: never more than the budget plus one shard (one producer): in every sample, all the entries
    # but the largest fit in the budget; and the spool did hold a shard past the budget
    assert max(s[2] for s in samples) > budget
    over = [(total, largest) for _, total, largest, _ in samples if total - largest > budget]
    assert not over, f"{len(over)} samples over budget + one shard (total, largest): {over[:5]}"

    # memory: the blocked worker's RSS stays flat (bounded queues), and under a stated bound overall
    rss = [(t, m) for t, _, _, m in samples if m is not None]
    blocked = [m for t, m in rss if t_blocked <= t <= t_blocked + 3.0]
    assert blocked and max(blocked) - min(blocked) < 32, (min(blocked), max(blocked))
    assert max(m for _, m in rss) < 1024, "producer worker RSS above 1 GiB"

    # security: every spool directory is 0700 although the processes ran under umask 022
    assert modes and all(m == 0o700 for m in modes.values()), {k: oct(v) for k, v in modes.items()}
    assert any(k.startswith("claimed/") for k in modes), modes


def test_writer_threads_together_overshoot_the_budget_by_one_shard_at_most(tmp_path):
    """The producer's writer threads (2 by default) each check the budget before writing: checked at the
    same moment, both pass and the spool overshoots by one shard per thread. The bound is one shard per
    producer: a thread is admitted past the budget only when nothing else of its producer is in flight."""
    from dflash.common.target.data import DataConfig
    from dflash.producer.buckets import Batch, Sample
    from dflash.producer.config import ProducerConfig, Worker
    from dflash.producer.writers import Counters, ShardWriters, WriteJob

    spool = Spool(tmp_path / "spool")
    budget, tokens = 1000, 1024
    cfg = ProducerConfig(model="tiny", data=DataConfig(dataset="unused"))
    worker = Worker(producer_id="p0", spool=str(spool.root), budget_bytes=budget, writer_threads=2)
    stop = threading.Event()
    writers = ShardWriters(
        cfg,
        worker,
        dict(target_model="tiny", layer_ids=LAYERS, hidden_size=HIDDEN, producer_id="p0"),
        Counters(),
        stop,
    )

    def job(i: int) -> WriteJob:
        sample = Sample(sample_index=i, input_ids=np.zeros(tokens, np.int32), loss_mask=np.ones(tokens, bool))
        hidden = torch.randn(tokens, len(LAYERS) * HIDDEN).to(torch.bfloat16)
        return WriteJob(
            batch=Batch(bucket=tokens, pad_len=tokens, samples=[sample]),
            hidden=hidden,
            event=None,
            buffer=None,
            seq=writers.next_seq(),
        )

    for i in range(2):  # queued before the threads start: both pick one up at once
        writers.jobs.put(job(i))
    peak, largest, published, hold_until = 0, 0, [], None
    writers.start()
    try:
        writers.jobs.put(job(2))
        deadline = time.monotonic() + 30
        while len(published) < 3 and time.monotonic() < deadline:
            peak = max(peak, spool.total_bytes())
            ready = list(spool.ready_dir.iterdir())
            assert len(ready) <= 1, f"{len(ready)} shards published while the spool was over budget"
            if ready and hold_until is None:
                hold_until = time.monotonic() + 0.5  # the other thread must stay blocked meanwhile
            elif ready and time.monotonic() >= hold_until:
                largest = max(largest, spool.total_bytes())
                path = spool.claim("c0")
                spool.ack(path)
                published.append(path.name)
                hold_until = None
            time.sleep(0.005)
    finally:
        stop.set()  # a thread still waiting for the budget gives up
        writers.close()
    assert writers.error is None and len(published) == 3, (writers.error, published)
    assert budget < largest and peak <= budget + largest, (peak, largest)


@pytest.mark.slow
def test_producer_workers_die_with_their_parent(tmp_path, tiny_target):
    """kill -9 of dflash-produce takes its worker down at once: an orphaned worker would keep publishing
    and write its DONE marker into the next life's spool (run_all.sh --restarts), ending it too early."""
    data = _demo_rows(tmp_path / "data.jsonl", 12)
    spool = tmp_path / "spool"
    parent = subprocess.Popen(
        _produce_cmd(spool, tiny_target, data, "--batch-tokens", "512", "--budget-gb", "1e-6"),
        env=_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # one shard published and the budget exhausted: the worker lives on, blocked
        wait_until(
            lambda: any((spool / "ready").glob("*.zarr")) or parent.poll() is not None,
            timeout_s=120,
            what="the worker's first shard",
        )
        assert parent.poll() is None
        worker = _heartbeat(spool)["pid"]
        assert worker != parent.pid and process_alive(worker)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        # PR_SET_PDEATHSIG kills it at once; the bound only covers a slow teardown on a loaded box (an
        # orphan blocked on the budget would live on forever, so a missing death still fails here)
        wait_until(
            lambda: not process_alive(worker), timeout_s=60, what=f"worker {worker} to die with its parent"
        )
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert not (spool / "state" / "DONE-n0p0.1").exists()
    assert len(list((spool / "ready").iterdir())) == 1  # what it published before; tmp/ is cleaned on restart


# ------------------------------------------------------------------------------------------- S3 faults
class FaultProxy:
    """A threaded HTTP proxy in front of moto's S3 server that forwards requests or fails them.

    mode "pass": forward everything; "flaky": a share ``rate`` of requests fails at random with 503
    SlowDown, 500 InternalError, a connection reset before forwarding, or a reset after forwarding (the
    request happened, the client never hears of it); "outage": every request gets 503; "deny": every
    request gets 403 AccessDenied whose message echoes the request's Authorization header (a server that
    leaks credentials into errors)."""

    def __init__(self, upstream: str, *, seed: int = 0, rate: float = 0.3):
        up = urlsplit(upstream)
        self.up_host, self.up_port = up.hostname, up.port
        self.mode, self.rate = "pass", rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.saw_key_id = False
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, and "100 Continue" for botocore's PUTs

            def log_message(self, *_args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                proxy._handle(self)

            do_PUT = do_POST = do_HEAD = do_DELETE = do_GET  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def set(self, mode: str) -> None:
        with self.lock:
            self.mode = mode

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _decide(self) -> str:
        with self.lock:
            self.counts["requests"] += 1
            if self.mode == "flaky" and self.rng.random() < self.rate:
                fault = self.rng.choice(["503", "500", "reset", "drop"])
            else:
                fault = {"pass": "pass", "flaky": "pass", "outage": "503", "deny": "deny"}[self.mode]
            self.counts[fault] += 1
            return fault

    @staticmethod
    def _read_body(h: BaseHTTPRequestHandler) -> bytes:
        if "chunked" in h.headers.get("Transfer-Encoding", "").lower():
            body = b""
            while True:
                size = int(h.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return body
                body += h.rfile.read(size)
                h.rfile.readline()
        return h.rfile.read(int(h.headers.get("Content-Length") or 0))

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        body = self._read_body(h)
        if FAKE_ACCESS_KEY_ID in h.headers.get("Authorization", ""):
            self.saw_key_id = True
        fault = self._decide()
        if fault == "reset":
            return self._reset(h)
        if fault in ("503", "500", "deny"):
            return self._error(h, fault)
        conn = http.client.HTTPConnection(self.up_host, self.up_port, timeout=60)
        try:
            conn.putrequest(h.command, h.path, skip_host=True, skip_accept_encoding=True)
            for k, v in h.headers.items():
                if k.lower() not in ("expect", "transfer-encoding", "connection", "content-length"):
                    conn.putheader(k, v)
            if body or h.command in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if fault == "drop":
            return self._reset(h)
        h.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in (
                "transfer-encoding",
                "connection",
                "keep-alive",
                "content-length",
                "server",
                "date",
            ):
                h.send_header(k, v)
        length = resp.getheader("Content-Length", "0") if h.command == "HEAD" else str(len(data))
        h.send_header("Content-Length", length)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    @staticmethod
    def _reset(h: BaseHTTPRequestHandler) -> None:
        h.close_connection = True
        try:
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, fault: str) -> None:
        status, code = {
            "503": (503, "SlowDown"),
            "500": (500, "InternalError"),
            "deny": (403, "AccessDenied"),
        }[fault]
        message = f"injected {code}"
        if fault == "deny":
            message += f" for {h.headers.get('Authorization', '')}"
        xml = (
            f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message>"
            f"<AWSAccessKeyId>{FAKE_ACCESS_KEY_ID}</AWSAccessKeyId><RequestId>faults</RequestId></Error>"
        ).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/xml")
        h.send_header("Content-Length", "0" if h.command == "HEAD" else str(len(xml)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(xml)


S3_RUN = "s3faults"


@pytest.fixture(scope="module")
def s3_scenario(s3_endpoint, _s3_admin_client, tiny_target, tmp_path_factory):
    """One dflash-consume run against S3 through the fault proxy, in phases driven by the shards the test
    publishes: flaky (30 % of requests fail) -> outage (every request 503 for >= 3 s) -> deny (every request
    403: checkpoints fail) -> pass (drain, final checkpoint). Then the latest checkpoint's weights are
    corrupted and a second consumer resumes. Returns what the tests below check."""
    tmp = tmp_path_factory.mktemp("s3-faults")
    admin = _s3_admin_client
    bucket = f"dflash-faults-{uuid.uuid4().hex[:10]}"
    admin.create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/ckpt"
    proxy = FaultProxy(s3_endpoint, seed=1234)
    env = cpu_env(
        AWS_ENDPOINT_URL=proxy.url,
        AWS_ACCESS_KEY_ID=FAKE_ACCESS_KEY_ID,
        AWS_SECRET_ACCESS_KEY=FAKE_SECRET_ACCESS_KEY,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_EC2_METADATA_DISABLED="true",
    )
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_DEFAULT_PROFILE"):
        env.pop(name, None)
    run_dir = tmp / "run"
    metrics_path = run_dir / "metrics" / "consumer-0.jsonl"

    def latest() -> str | None:
        try:
            return (
                admin.get_object(Bucket=bucket, Key=f"ckpt/{S3_RUN}/latest")["Body"].read().decode().strip()
            )
        except admin.exceptions.NoSuchKey:
            return None

    def events(kind: str) -> list[dict]:
        return [r for r in read_jsonl(metrics_path) if r.get("event") == kind]

    def consume(spool: Path, log: Path) -> subprocess.Popen:
        cmd = consume_cmd(
            spool,
            tiny_target,
            "--checkpoint",
            url,
            "--run",
            S3_RUN,
            "--run-dir",
            str(run_dir),
            "--save-every",
            "2",
            "--log-every",
            "1",
            "--compile-backend",
            "eager",
            "--keep-last",
            "3",
        )
        return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115

    sc = SimpleNamespace(bucket=bucket, url=url, run_dir=run_dir, proxy=proxy, admin=admin, phase={})
    spool = Spool(tmp / "spool")
    spool.register_producers(["p0"])
    procs: list[subprocess.Popen] = []
    try:
        # flaky: start-up (resume probe) and the first checkpoints go through 30 % failing requests.
        # Shards are published phase by phase (4 shards = 4 steps), so the consumer never runs ahead.
        proxy.set("flaky")
        sc.samples = _publish_synthetic(spool, range(0, 4))
        procs.append(consume(spool.root, tmp / "consumer1.log"))
        wait_until(
            lambda: len(events("checkpoint")) >= 2 or procs[0].poll() is not None,
            timeout_s=180,
            what="two checkpoints through the flaky proxy",
        )
        sc.phase["flaky"] = dict(proxy.counts)

        # outage: every request fails for >= 3 s and >= 3 requests (only a checkpoint talks to S3 here, so
        # one is in the outage); the retries outlast it and the checkpoint lands afterwards
        n_ckpt = len(events("checkpoint"))
        proxy.set("outage")
        t0, refused0 = time.monotonic(), proxy.counts["503"]
        sc.samples += _publish_synthetic(spool, range(4, 6), seed=1)
        wait_until(
            lambda: (
                time.monotonic() - t0 >= 3
                and proxy.counts["503"] - refused0 >= 3
                or procs[0].poll() is not None
            ),
            timeout_s=60,
            what="the outage to refuse requests",
        )
        sc.phase["outage_refused"] = proxy.counts["503"] - refused0
        proxy.set("pass")
        wait_until(
            lambda: len(events("checkpoint")) > n_ckpt or procs[0].poll() is not None,
            timeout_s=120,
            what="the checkpoint caught in the outage",
        )
        sc.phase["after_outage_failed"] = len(events("checkpoint_failed"))

        # deny: checkpoints fail (one error line each), training goes on, latest stays the last good one
        sc.good_before_deny = latest()
        sc.last_good_step = events("checkpoint")[-1]["step"]
        proxy.set("deny")
        sc.samples += _publish_synthetic(spool, range(6, 11), seed=2)
        wait_until(
            lambda: len(events("checkpoint_failed")) >= 2 or procs[0].poll() is not None,
            timeout_s=120,
            what="two failed checkpoints",
        )
        failed_step = events("checkpoint_failed")[-1]["step"]
        wait_until(
            lambda: (
                any(r["step"] > failed_step for r in read_jsonl(run_dir / "metrics" / "ledger-r0.jsonl"))
                or procs[0].poll() is not None
            ),
            timeout_s=60,
            what="a step after the failed checkpoint",
        )
        sc.latest_during_deny = latest()
        sc.failed_in_deny = [e["step"] for e in events("checkpoint_failed")]
        sc.last_step_in_deny = max(r["step"] for r in read_jsonl(run_dir / "metrics" / "ledger-r0.jsonl"))

        # pass: drain and finish
        proxy.set("pass")
        sc.samples += _publish_synthetic(spool, range(11, 13), seed=3)
        spool.mark_done("p0")
        sc.rc1 = procs[0].wait(timeout=180)
        sc.log1 = (tmp / "consumer1.log").read_text()
        sc.latest_final = latest()
        sc.checkpoint_events = events("checkpoint")
        sc.failed_events = events("checkpoint_failed")
        sc.ledger = read_jsonl(run_dir / "metrics" / "ledger-r0.jsonl")
        from dflash.common.checkpoints.load import load_checkpoint

        store = _store(sc)
        sc.final1 = load_checkpoint(store, S3_RUN)
        sc.previous1 = max(e["step"] for e in sc.checkpoint_events if e["step"] != sc.final1.step)
        sc.previous1_trained = set(
            load_checkpoint(store, S3_RUN, step=sc.previous1).trained.indices().tolist()
        )

        # corrupt the latest checkpoint's weights (same size, flipped bytes), resume with a second consumer
        key = f"ckpt/{S3_RUN}/{sc.latest_final}/model.safetensors"
        raw = bytearray(admin.get_object(Bucket=bucket, Key=key)["Body"].read())
        raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(
            b ^ 0xFF for b in raw[len(raw) // 2 : len(raw) // 2 + 64]
        )
        admin.put_object(Bucket=bucket, Key=key, Body=bytes(raw))
        spool2 = Spool(tmp / "spool2")
        spool2.register_producers(["p0"])
        sc.samples2 = _publish_synthetic(spool2, range(100, 102), seed=4)
        spool2.mark_done("p0")
        procs.append(consume(spool2.root, tmp / "consumer2.log"))
        sc.rc2 = procs[1].wait(timeout=180)
        sc.log2 = (tmp / "consumer2.log").read_text()
        sc.metrics_text = "".join(p.read_text() for p in (run_dir / "metrics").glob("*.jsonl"))
        sc.metas = {
            obj["Key"]: admin.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read().decode()
            for obj in admin.list_objects_v2(Bucket=bucket, Prefix=f"ckpt/{S3_RUN}/").get("Contents", [])
            if obj["Key"].endswith("/meta.json")
        }
        yield sc
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        proxy.close()


def _store(sc):
    from dflash.common.checkpoints.s3 import S3Store

    return S3Store(sc.bucket, "ckpt", client=sc.admin)


@pytest.mark.slow
def test_s3_faults_are_retried_and_a_store_outage_costs_checkpoints_not_training(s3_scenario):
    sc = s3_scenario
    assert sc.rc1 == 0, sc.log1[-3000:]
    # flaky + outage: faults were injected and every checkpoint still made it
    flaky = sc.phase["flaky"]
    assert sum(flaky.get(k, 0) for k in ("503", "500", "reset", "drop")) >= 3, flaky
    assert sc.phase["outage_refused"] >= 3
    assert sc.phase["after_outage_failed"] == 0, sc.log1[-3000:]
    # deny: >= 2 checkpoints failed, training went on past them, latest kept naming the last good one
    assert len(sc.failed_in_deny) >= 2
    assert sc.last_step_in_deny > max(sc.failed_in_deny)
    assert sc.latest_during_deny == sc.good_before_deny == f"step-{sc.last_good_step:08d}"
    # ONE clear error line per failed checkpoint, nothing else at ERROR, no traceback
    errors = [line for line in sc.log1.splitlines() if " ERROR " in line]
    assert len(errors) == len(sc.failed_events) == len({e["step"] for e in sc.failed_events}), errors
    for line, ev in zip(errors, sc.failed_events, strict=True):
        assert f"checkpoint step {ev['step']} failed" in line and "access denied" in line, line
        assert "training goes on" in line
    assert "Traceback" not in sc.log1
    # after the outage: the final checkpoint is latest and holds every sample, each trained once
    final_step = max(r["step"] for r in sc.ledger)
    assert sc.latest_final == f"step-{final_step:08d}" and sc.final1.step == final_step
    assert sorted(sc.final1.trained.indices().tolist()) == sc.samples
    trained = Counter(s for r in sc.ledger for s in r["samples"])
    assert set(trained) == set(sc.samples) and set(trained.values()) == {1}


@pytest.mark.slow
def test_corrupt_latest_checkpoint_is_a_clear_error_and_resume_falls_back(s3_scenario):
    """The latest checkpoint's weights corrupted in the store (same size, flipped bytes): dflash-consume
    --resume auto says which file failed its sha256, falls back to the previous checkpoint and resumes."""
    sc = s3_scenario
    assert sc.rc2 == 0, sc.log2[-3000:]
    corrupt, previous = sc.latest_final, f"step-{sc.previous1:08d}"
    errors = [line for line in sc.log2.splitlines() if " ERROR " in line]
    assert len(errors) == 1, errors
    assert f"{corrupt}/model.safetensors" in errors[0] and "sha256" in errors[0], errors[0]
    assert f"falling back to {previous}" in errors[0], errors[0]
    assert (
        f"resumed from step {sc.previous1} ({len(sc.previous1_trained)} samples already trained)" in sc.log2
    )
    from dflash.common.checkpoints.load import load_checkpoint

    final = load_checkpoint(_store(sc), S3_RUN)
    assert final.step == sc.previous1 + len(sc.samples2) // SAMPLES_PER_SHARD
    assert set(final.trained.indices().tolist()) == sc.previous1_trained | set(sc.samples2)


@pytest.mark.slow
def test_no_credentials_in_consumer_logs_metrics_or_checkpoint_meta(s3_scenario):
    sc = s3_scenario
    assert sc.proxy.saw_key_id  # the consumer did sign its requests with the fake credentials
    assert sc.metas, "no meta.json found"
    texts = {"consumer1.log": sc.log1, "consumer2.log": sc.log2, "metrics": sc.metrics_text, **sc.metas}
    for name, text in texts.items():
        for secret in (FAKE_SECRET_ACCESS_KEY, FAKE_ACCESS_KEY_ID):
            assert secret not in text, f"{secret[:4]}... leaked into {name}"
    assert "access denied" in sc.log1  # the deny errors (which echo credentials) did reach the log, redacted


# ------------------------------------------------------------------------------------- fuzzed dataset rows
# no subnormals: a Trainer built in this process (set_flush_denormal, CPU) makes hypothesis refuse them
_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_subnormal=False)
    | st.text(max_size=30)
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
_roles = (
    st.sampled_from(["user", "assistant", "system", "human", "gpt", "chatgpt", "tool", "", "Assistant"])
    | _json
)
_contents = (
    st.text(max_size=300)
    | st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": _json | st.text()}),
        max_size=3,
    )
    | _json
)
_turn = (
    st.fixed_dictionaries(
        {}, optional={"role": _roles, "content": _contents, "from": _roles, "value": _contents}
    )
    | _json
)
_row = (
    st.fixed_dictionaries(
        {},
        optional={
            "messages": st.lists(_turn, max_size=5) | _json,
            "conversations": st.lists(_turn, max_size=5) | _json,
        },
    )
    | _json
)
_GOOD = {
    "messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4. " * 40}]
}


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    from dflash.tools.demo.assets import tiny_target_dir

    return AutoTokenizer.from_pretrained(tiny_target_dir())


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(rows=st.lists(_row, max_size=6))
@example(rows=[_GOOD, {"messages": [{"role": ["user"], "content": "x"}, _GOOD["messages"][1]]}])
@example(
    rows=[{"messages": [{"role": "user", "content": "\ud800 lone surrogate"}, _GOOD["messages"][1]]}, _GOOD]
)
@example(
    rows=[{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "é€𝄞 " * 20_000}]}]
)
@example(
    rows=[{"messages": [{"role": "user", "content": "<|im_start|>{% generation %}"}, _GOOD["messages"][1]]}]
)
@example(
    rows=[
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok " * 50}]},
        None,
        7,
        "x",
    ]
)
def test_fuzzed_rows_never_crash_tokenization_and_bad_rows_are_counted(tiny_tokenizer, rows):
    """Arbitrary JSON rows through the producer's tokenization map function (raw-JSON rows: the path a
    mixed-type dataset takes) and the worker's sample iterator: never an exception; every row gets a
    status; bad and short rows carry no tokens, are counted and never reach a shard."""
    import datasets

    from dflash.common.contract.epochs import Epochs
    from dflash.common.target.chat import _Tokenize
    from dflash.common.target.data import RAW_JSON_COLUMN
    from dflash.producer.slice_plan import plan_epochs, samples_at

    max_length, min_loss = 64, 8
    indices = np.arange(len(rows), dtype=np.int64) + 1000
    fn = _Tokenize(tiny_tokenizer, RAW_JSON_COLUMN, max_length, min_loss, indices)
    out = fn({RAW_JSON_COLUMN: [json.dumps(r) for r in rows]}, list(range(len(rows))))
    assert out["sample_index"] == indices.tolist()
    assert all(len(out[k]) == len(rows) for k in out)
    for ids, mask, n_loss, status in zip(
        out["input_ids"], out["loss_mask"], out["num_loss_tokens"], out["status"], strict=True
    ):
        assert status in ("ok", "short") or status.startswith("bad:"), status
        assert len(ids) == len(mask) <= max_length and n_loss == sum(mask)
        if status.startswith("bad:"):
            assert ids == [] and n_loss == 0
        else:
            assert (status == "ok") == (n_loss >= min_loss) and all(0 <= t < len(tiny_tokenizer) for t in ids)
    # the worker's plan and iterator: only "ok" rows become samples, the others are counted as dropped
    tok_ds = datasets.Dataset.from_dict(out)
    plan = Epochs(rows=1000 + len(rows))
    positions, ids, c = plan_epochs(tok_ds, indices, plan, None)
    kept = [s.sample_index for s in samples_at(tok_ds, positions, ids)]
    status = Counter("bad" if s.startswith("bad:") else s for s in out["status"])
    assert sorted(kept) == [i for i, s in zip(out["sample_index"], out["status"], strict=True) if s == "ok"]
    assert (c["bad"], c["short"], c["dropped"]) == (
        status["bad"],
        status["short"],
        status["bad"] + status["short"],
    )
    # the same rows as structured python objects (a well-typed dataset's column): same statuses
    fn_col = _Tokenize(tiny_tokenizer, "messages", max_length, min_loss, indices)
    msgs = [r.get("messages") if isinstance(r, dict) else r for r in rows]
    out_col = fn_col({"messages": msgs}, list(range(len(rows))))
    assert all(s in ("ok", "short") or s.startswith("bad:") for s in out_col["status"])


# ------------------------------------------------------------------------------------------- security
def test_every_torch_load_in_the_source_tree_is_weights_only():
    """An AST scan: torch.load without weights_only=True would unpickle arbitrary code from a checkpoint."""
    offenders, calls = [], 0
    paths = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [
            d for d in dirs if not d.startswith(".") and d not in ("runs", "build", "dist", "__pycache__")
        ]
        paths += [Path(root, f) for f in files if f.endswith(".py")]
    for path in sorted(paths):
        rel = path.relative_to(REPO)
        tree = ast.parse(path.read_text(), filename=str(rel))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization"):
                if any(a.name == "load" for a in node.names):
                    offenders.append(f"{rel}:{node.lineno}: imports torch's load by name")
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if (
                isinstance(f, ast.Attribute)
                and f.attr == "load"
                and ast.unparse(f.value) in ("torch", "torch.serialization")
            ):
                calls += 1
                kw = {k.arg: k.value for k in node.keywords}
                ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                if not ok:
                    offenders.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:100]}")
    assert calls >= 1, "the scan found no torch.load call at all (common/checkpoints/save.py has one)"
    assert not offenders, "torch.load without weights_only=True:\n" + "\n".join(offenders)


# ------------------------------------------------------------- the first checkpoint of a run cannot be lost
def _s3_env(proxy: FaultProxy) -> dict:
    env = cpu_env(
        AWS_ENDPOINT_URL=proxy.url,
        AWS_ACCESS_KEY_ID=FAKE_ACCESS_KEY_ID,
        AWS_SECRET_ACCESS_KEY=FAKE_SECRET_ACCESS_KEY,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_EC2_METADATA_DISABLED="true",
    )
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_DEFAULT_PROFILE"):
        env.pop(name, None)
    return env


@pytest.mark.slow
def test_a_store_that_refuses_writes_fails_the_run_before_its_first_step_or_at_its_first_save(
    s3_endpoint, _s3_admin_client, tiny_target, tmp_path
):
    """(1) A store that refuses every write (403 from the start) is refused before step 1: exit 2,
    one line, nothing trained; (2) a store that refuses writes once training runs, before any checkpoint
    exists, stops the run at the first failed save (exit 1, one line saying why and where its state went)
    instead of training on with nothing saved."""
    bucket = f"dflash-first-{uuid.uuid4().hex[:10]}"
    _s3_admin_client.create_bucket(Bucket=bucket)
    proxy = FaultProxy(s3_endpoint, seed=7)
    env = _s3_env(proxy)
    try:
        # (1) denied from the start: the write probe fails, no step runs
        proxy.set("deny")
        spool = Spool(tmp_path / "spool1")
        spool.register_producers(["p0"])
        _publish_synthetic(spool, range(0, 2))
        run_dir = tmp_path / "run1"
        cmd = consume_cmd(
            spool.root,
            tiny_target,
            "--checkpoint",
            f"s3://{bucket}/ckpt",
            "--run",
            "first",
            "--run-dir",
            str(run_dir),
            "--compile-backend",
            "eager",
        )
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert p.returncode == 2, p.stderr[-3000:]
        line = p.stderr.strip().splitlines()[-1]
        assert line.startswith("dflash-consume: error: checkpoint store s3://") and "not writable" in line, (
            line
        )
        assert "Traceback" not in p.stderr and FAKE_SECRET_ACCESS_KEY not in p.stderr
        assert not read_jsonl(run_dir / "metrics" / "ledger-r0.jsonl")  # before step 1

        # (2) writable at start (the probe passes), denied before the first save (step 2)
        proxy.set("pass")
        spool = Spool(tmp_path / "spool2")
        spool.register_producers(["p0"])
        _publish_synthetic(spool, range(0, 1))
        run_dir = tmp_path / "run2"
        ledger = run_dir / "metrics" / "ledger-r0.jsonl"
        cmd = consume_cmd(
            spool.root,
            tiny_target,
            "--checkpoint",
            f"s3://{bucket}/ckpt2",
            "--run",
            "first",
            "--run-dir",
            str(run_dir),
            "--compile-backend",
            "eager",
            "--save-every",
            "2",
        )
        log = tmp_path / "consumer2.log"
        proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
        try:
            wait_until(lambda: read_jsonl(ledger) or proc.poll() is not None, timeout_s=180, what="step 1")
            proxy.set("deny")
            _publish_synthetic(spool, range(1, 8), seed=1)  # step 2 saves (and fails); six more steps wait
            rc = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = log.read_text()
        assert rc == 1, text[-3000:]
        last = text.strip().splitlines()[-1]
        assert last.startswith("dflash-consume: error: StoreOutageError: checkpoint step 2 failed"), last
        assert "no checkpoint of run 'first' exists yet" in last and "stopped at step" in last, last
        assert "fallback-checkpoint" in last and "run the same command" in last, last  # the state is kept
        steps = [r["step"] for r in read_jsonl(ledger)]
        assert max(steps) < 8, steps  # it stopped at the failure, not after training everything
        assert "Traceback" not in text
    finally:
        proxy.close()


@pytest.mark.slow
def test_a_checkpoint_folder_nothing_can_be_written_into_is_refused_before_step_1(tiny_target, tmp_path):
    """A local --checkpoint folder the run's checkpoints cannot be written into is refused before
    the first step (exit 2, one line naming the folder and the cause). The folder exists; the run's place
    in it is taken by a file, which stops every write as a read-only mount does (and does so for root too,
    whom a 0555 mode does not stop)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "first").write_text("not a folder\n")
    spool = Spool(tmp_path / "spool")
    spool.register_producers(["p0"])
    _publish_synthetic(spool, range(0, 2))
    run_dir = tmp_path / "run"
    cmd = consume_cmd(
        spool.root,
        tiny_target,
        "--checkpoint",
        str(ckpt),
        "--run",
        "first",
        "--run-dir",
        str(run_dir),
        "--compile-backend",
        "eager",
    )
    p = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 2, p.stderr[-3000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith(f"dflash-consume: error: checkpoint store {ckpt}/first is not writable"), line
    assert f"{ckpt}/first is a file, not a folder" in line and "pass another --checkpoint" in line, line
    assert "Traceback" not in p.stderr
    assert not read_jsonl(run_dir / "metrics" / "ledger-r0.jsonl")
    assert (ckpt / "first").read_text() == "not a folder\n"  # nothing of the user's was touched
