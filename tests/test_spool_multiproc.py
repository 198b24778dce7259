"""Multi-process spool tests: real processes exchange shards through one spool directory, some get
SIGKILLed, and every sample index is counted.

This file is also the worker script: ``python test_spool_multiproc.py writer|reader '<json args>'``.
Shards are tiny dummy directories (``samples.txt`` with the sample indices, optional padding) so these
tests exercise the spool protocol only, not the shard codec.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from dflash.common.contract.names import parse_shard_name, shard_name
from dflash.common.contract.spool import Spool

pytestmark = pytest.mark.pipeline  # every test here starts processes

PAD = 16384
TIMEOUT_S = 120  # hang guard only (every wait below ends on a condition)


# ---- workers ----


def writer(
    root: str,
    producer: str,
    indices: list[int],
    per_shard: int,
    *,
    num_buckets: int = 3,
    budget: int = 1 << 40,
    pad: int = 0,
    corrupt_every: int = 0,
    hang_after: int = -1,
    hang_marker: str = "",
) -> None:
    sp = Spool(root)
    cleaned = sp.clean_tmp(producer)
    seq = sp.next_seq(producer)
    blocked_s = 0.0
    chunks = [indices[i : i + per_shard] for i in range(0, len(indices), per_shard)]
    for k, chunk in enumerate(chunks):
        t0 = time.monotonic()
        sp.wait_for_budget(budget, poll_s=0.002)
        blocked_s += time.monotonic() - t0
        tmp = sp.new_tmp_path(shard_name(seq % num_buckets, producer, seq))
        tmp.mkdir()
        body = (
            "garbage"
            if corrupt_every and k % corrupt_every == corrupt_every - 1
            else ",".join(map(str, chunk))
        )
        if k == hang_after:  # die mid-write: half a shard under tmp/, then wait for SIGKILL
            (tmp / "pad.bin").write_bytes(b"\0" * 1000)
            Path(hang_marker + ".part").write_text(tmp.name)
            os.rename(hang_marker + ".part", hang_marker)
            time.sleep(TIMEOUT_S)
            raise SystemExit("writer was not killed")
        (tmp / "samples.txt").write_text(body)
        if pad:
            (tmp / "pad.bin").write_bytes(b"\0" * pad)
        sp.publish(tmp)
        seq += 1
        if k % 10 == 0:
            sp.heartbeat("producer", producer, {"shards": k + 1, "blocked_s": blocked_s})
    sp.heartbeat("producer", producer, {"shards": len(chunks), "blocked_s": blocked_s})
    sp.mark_done(producer)
    print(json.dumps({"cleaned": cleaned, "blocked_s": blocked_s}))


def reader(
    root: str,
    consumer: str,
    log_path: str,
    *,
    bucket=None,
    batch: int = 1,
    delay_s: float = 0.0,
    hang_after: int = -1,
) -> None:
    """Claim up to ``batch`` shards, then for each: log 'claim', read, log 'done <indices>', ack, log
    'ack'. The log (flushed per line) tells the test what a killed reader had in hand. ``hang_after``:
    after that many acks, read one more shard and hang before its ack, holding the rest of the batch
    (a consumer killed between its forward pass and its optimizer step)."""
    sp = Spool(root)
    n = 0
    with open(log_path, "a", buffering=1) as out:
        while True:
            got = []
            while len(got) < batch and (p := sp.claim(consumer, bucket=bucket)) is not None:
                out.write(f"claim {p.name}\n")
                got.append(p)
            if not got:
                if sp.is_drained():
                    break
                sp.recover_dead_claims(heartbeat_timeout_s=60)
                time.sleep(0.003)
                continue
            for p in got:
                body = (p / "samples.txt").read_text()
                if not body.replace(",", "").isdigit():
                    sp.quarantine(p, f"cannot parse samples.txt: {body[:20]!r}")
                    out.write(f"quarantined {p.name}\n")
                    continue
                time.sleep(delay_s)
                out.write(f"done {p.name} {body}\n")
                if n == hang_after:
                    out.write("hang\n")
                    time.sleep(TIMEOUT_S)
                    raise SystemExit("reader was not killed")
                sp.ack(p)
                out.write(f"ack {p.name}\n")
                n += 1
            sp.heartbeat("consumer", consumer, {"shards": n})


# ---- harness ----


def spawn(role: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, role, json.dumps(kwargs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(procs: list[subprocess.Popen]) -> list[str]:
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=TIMEOUT_S)
        assert p.returncode == 0, f"{p.args[2]} exited {p.returncode}: {err[-2000:]}"
        outs.append(out)
    return outs


def parse_log(path: Path) -> dict[str, dict]:
    """name -> {'claim': bool, 'done': [indices] | None, 'ack': bool, 'quarantined': bool}"""
    shards: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        if line == "hang":
            continue
        what, name, *rest = line.split(" ")
        s = shards.setdefault(name, {"claim": False, "done": None, "ack": False, "quarantined": False})
        if what == "done":
            s["done"] = [int(i) for i in rest[0].split(",")]
        else:
            s[what] = True
    return shards


def delivered(logs: list[dict[str, dict]]) -> Counter:
    return Counter(i for log in logs for s in log.values() if s["done"] for i in s["done"])


def split_indices(num_samples: int, num_producers: int) -> list[list[int]]:
    return [list(range(p, num_samples, num_producers)) for p in range(num_producers)]


def test_four_writers_four_readers_deliver_every_sample_exactly_once(tmp_path):
    root = tmp_path / "spool"
    producers = [f"p{i}" for i in range(4)]
    Spool(root).register_producers(producers)
    num_samples = 4 * 130 * 4  # 130 shards of 4 samples per writer: 520 shards
    buckets = [None, "fullest", 0, 2]
    readers = [
        spawn(
            "reader",
            root=str(root),
            consumer=f"c{i}",
            log_path=str(tmp_path / f"c{i}.log"),
            bucket=buckets[i],
            batch=1 + i % 2,
        )
        for i in range(4)
    ]
    writers = [
        spawn("writer", root=str(root), producer=p, indices=idx, per_shard=4)
        for p, idx in zip(producers, split_indices(num_samples, 4), strict=True)
    ]
    finish(writers + readers)

    logs = [parse_log(tmp_path / f"c{i}.log") for i in range(4)]
    assert sum(len(log) for log in logs) == 520
    assert delivered(logs) == Counter(range(num_samples))  # every index exactly once
    assert all(s["ack"] for log in logs for s in log.values())
    for log, b in zip(logs, buckets, strict=True):
        if isinstance(b, int):
            assert log and {parse_shard_name(n)[0] for n in log} == {b}
    assert min(len(log) for log in logs) > 0
    sp = Spool(root, create=False)
    assert sp.is_drained() and sp.total_bytes() == 0
    st = sp.stats()
    assert {p["id"] for p in st["processes"]} == {*producers, "c0", "c1", "c2", "c3"}
    assert all(not p["alive"] for p in st["processes"])  # all exited


def test_reader_killed_with_sigkill_has_its_claims_redelivered(tmp_path):
    root = tmp_path / "spool"
    Spool(root).register_producers(["p0", "p1"])
    num_samples = 2 * 40 * 3
    writers = [
        spawn("writer", root=str(root), producer=f"p{i}", indices=idx, per_shard=3)
        for i, idx in enumerate(split_indices(num_samples, 2))
    ]
    victim_log = tmp_path / "victim.log"
    victim = spawn(
        "reader", root=str(root), consumer="victim", log_path=str(victim_log), batch=4, hang_after=5
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not (victim_log.exists() and "hang" in victim_log.read_text()):
        assert time.monotonic() < deadline and victim.poll() is None
        time.sleep(0.005)
    os.kill(victim.pid, signal.SIGKILL)  # not reaped until the end: a zombie must count as dead too
    victim_shards = parse_log(victim_log)
    held = sorted(n for n, s in victim_shards.items() if not s["ack"])
    assert held and sum(s["ack"] for s in victim_shards.values()) == 5
    assert held == sorted(os.listdir(Spool(root, create=False).claimed_dir / "victim"))
    survivors = [
        spawn("reader", root=str(root), consumer=f"c{i}", log_path=str(tmp_path / f"c{i}.log"))
        for i in range(2)
    ]
    finish(writers + survivors)
    victim.wait()

    logs = [parse_log(tmp_path / f"c{i}.log") for i in range(2)]
    redelivered = {n for log in logs for n in log} & set(held)
    assert redelivered == set(held)
    # exactly once, except shards the victim read but did not ack: those twice (at-least-once)
    read_not_acked = [s["done"] for s in victim_shards.values() if s["done"] and not s["ack"]]
    expected = Counter(range(num_samples)) + Counter(i for d in read_not_acked for i in d)
    assert delivered([victim_shards, *logs]) == expected
    sp = Spool(root, create=False)
    assert sp.is_drained() and not (sp.claimed_dir / "victim").exists()


def test_writer_killed_mid_write_leaves_nothing_in_ready_and_restart_cleans_tmp(tmp_path):
    root = tmp_path / "spool"
    marker = tmp_path / "hanging"
    w = spawn(
        "writer",
        root=str(root),
        producer="p0",
        indices=list(range(12)),
        per_shard=4,
        hang_after=2,
        hang_marker=str(marker),
    )
    other = Spool(root).new_tmp_path(shard_name(0, "p1", 0))  # another producer's in-progress shard
    other.mkdir()
    deadline = time.monotonic() + TIMEOUT_S
    while not marker.exists():
        assert time.monotonic() < deadline and w.poll() is None, (
            w.stderr.read() if w.poll() is not None else ""
        )
        time.sleep(0.005)
    os.kill(w.pid, signal.SIGKILL)
    assert w.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
    sp = Spool(root, create=False)
    half = marker.read_text()
    assert sorted(os.listdir(sp.ready_dir)) == [shard_name(0, "p0", 0), shard_name(1, "p0", 1)]
    assert sorted(os.listdir(sp.tmp_dir)) == sorted([half, other.name])
    assert sp.claim("c0", bucket=parse_shard_name(half)[0]) is None

    (out,) = finish([spawn("writer", root=str(root), producer="p0", indices=[8, 9, 10, 11], per_shard=4)])
    assert json.loads(out)["cleaned"] == 1
    assert os.listdir(sp.tmp_dir) == [other.name]
    assert sorted(os.listdir(sp.ready_dir)) == [shard_name(0, "p0", 0), shard_name(1, "p0", 1), half]
    got = sorted(
        int(i)
        for n in os.listdir(sp.ready_dir)
        for i in (sp.ready_dir / n / "samples.txt").read_text().split(",")
    )
    assert got == list(range(12))


def test_backpressure_blocks_writer_until_readers_ack_and_drops_nothing(tmp_path):
    root = tmp_path / "spool"
    sp = Spool(root)
    sp.register_producers(["p0"])
    shard_max = PAD + len(",".join(map(str, range(40 * 2 - 2, 40 * 2))))
    budget = 4 * PAD
    w = spawn(
        "writer", root=str(root), producer="p0", indices=list(range(80)), per_shard=2, pad=PAD, budget=budget
    )

    samples, stop = [], threading.Event()

    def sample() -> None:
        probe = Spool(root, create=False)
        while not stop.is_set():
            samples.append(probe.total_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(os.listdir(sp.ready_dir)) < 4:  # no reader yet: the writer fills up to the budget ...
            assert time.monotonic() < deadline and w.poll() is None
            time.sleep(0.005)
        time.sleep(0.3)  # ... and stays parked there
        assert w.poll() is None
        assert len(os.listdir(sp.ready_dir)) == 4
        got: list[int] = []
        while not sp.is_drained():
            p = sp.claim("c0")
            if p is None:
                time.sleep(0.002)
                continue
            got += [int(i) for i in (p / "samples.txt").read_text().split(",")]
            # hold the claim until the sampler has looked 3 more times (a condition, not a sleep: on a
            # loaded box a sleep may pass without a single sample)
            seen = len(samples)
            while len(samples) < seen + 3:
                assert sampler.is_alive() and time.monotonic() < deadline + TIMEOUT_S
                time.sleep(0.001)
            sp.ack(p)
        (out,) = finish([w])
    finally:
        stop.set()
        sampler.join()
    assert sorted(got) == list(range(80))
    assert json.loads(out)["blocked_s"] > 0.3
    assert len(samples) > 100 and max(samples) >= budget
    assert max(samples) <= budget + shard_max


def test_corrupt_shards_are_quarantined_and_readers_continue(tmp_path):
    root = tmp_path / "spool"
    Spool(root).register_producers(["p0", "p1"])
    idx = split_indices(2 * 20 * 2, 2)
    writers = [
        spawn("writer", root=str(root), producer=f"p{i}", indices=idx[i], per_shard=2, corrupt_every=5)
        for i in range(2)
    ]
    readers = [
        spawn("reader", root=str(root), consumer=f"c{i}", log_path=str(tmp_path / f"c{i}.log"))
        for i in range(2)
    ]
    finish(writers + readers)
    logs = [parse_log(tmp_path / f"c{i}.log") for i in range(2)]
    sp = Spool(root, create=False)
    bad = sorted(n for log in logs for n, s in log.items() if s["quarantined"])
    assert len(bad) == 2 * 4  # every 5th of 20 shards per writer
    assert sorted(os.listdir(sp.quarantine_dir)) == sorted(bad + [n + ".why" for n in bad])
    for n in bad:
        assert "cannot parse samples.txt: 'garbage'" in (sp.quarantine_dir / f"{n}.why").read_text()
    lost = {i for p in range(2) for k in range(4, 20, 5) for i in idx[p][2 * k : 2 * k + 2]}
    assert delivered(logs) == Counter(i for i in range(80) if i not in lost)
    assert sp.is_drained()


if __name__ == "__main__":
    role, args = sys.argv[1], json.loads(sys.argv[2])
    {"writer": writer, "reader": reader}[role](**args)
