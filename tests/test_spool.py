"""Single-process tests of the spool protocol: names, modes, lifecycle, recovery, accounting, quarantine."""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.common.contract import liveness, spool_files, spool_scan
from dflash.common.contract import spool as spool_mod
from dflash.common.contract.liveness import heartbeat_alive
from dflash.common.contract.names import parse_shard_name, shard_name
from dflash.common.contract.spool import Spool, SpoolError, default_budget_bytes


def put_dummy(sp: Spool, bucket: int, producer: str, seq: int, indices=(), pad: int = 0) -> Path:
    """A tiny stand-in shard: a directory holding its sample indices (the spool treats shards as opaque)."""
    tmp = sp.new_tmp_path(shard_name(bucket, producer, seq))
    tmp.mkdir()
    (tmp / "samples.txt").write_text(",".join(map(str, indices)))
    if pad:
        (tmp / "pad.bin").write_bytes(b"\0" * pad)
    return sp.publish(tmp)


def dummy_bytes(indices=(), pad: int = 0) -> int:
    return len(",".join(map(str, indices))) + pad


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


# ---- names ----


def test_shard_names_roundtrip_and_sort_by_bucket_producer_seq():
    rng = random.Random(0)
    keys = [
        (
            rng.randrange(0, 5000),
            rng.choice(["p0", "p1", "p10", "node-1.gpu_3", "a"]),
            rng.randrange(0, 10**9),
        )
        for _ in range(500)
    ]
    names = [shard_name(*k) for k in keys]
    assert [parse_shard_name(n) for n in names] == keys
    assert sorted(names, key=parse_shard_name) == [shard_name(*k) for k in sorted(keys)]
    assert shard_name(128, "p0", 7) == "b000128-p0-s00000007.zarr"
    # plain string order agrees for ids that are not prefixes of each other
    same = [shard_name(b, "p0", s) for b in (1, 20, 300) for s in (0, 5, 100)]
    assert sorted(same) == same


@pytest.mark.parametrize(
    "bad",
    [
        "x.zarr",
        "b000001-p0-s00000001",
        "b1-p0-s00000001.zarr",
        ".ack-b000001-p0-s00000001.zarr",
        "b000001--s00000001.zarr",
    ],
)
def test_parse_shard_name_rejects(bad):
    with pytest.raises(ValueError, match="not a shard name"):
        parse_shard_name(bad)


@pytest.mark.parametrize(
    "args", [(-1, "p0", 0), (0, "p/0", 0), (0, "", 0), (0, "p0", -2), (True, "p0", 0), (0, "-p", 0)]
)
def test_shard_name_rejects_bad_args(args):
    with pytest.raises(ValueError):
        shard_name(*args)


# ---- directories ----


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])  # 0o277 would leave 0500 without the chmod
def test_dirs_are_0700_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        sp = Spool(tmp_path / "a" / "b" / "spool")
        put_dummy(sp, 0, "p0", 0, [1])
        claimed = sp.claim("c0")
    finally:
        os.umask(old)
    for d in (
        tmp_path / "a",
        tmp_path / "a" / "b",
        sp.root,
        sp.tmp_dir,
        sp.ready_dir,
        sp.claimed_dir,
        sp.quarantine_dir,
        sp.state_dir,
        claimed.parent,
    ):
        assert mode(d) == 0o700, d


def test_open_existing_requires_a_spool(tmp_path):
    with pytest.raises(SpoolError, match="no spool directory"):
        Spool(tmp_path / "missing", create=False)
    (tmp_path / "plain").mkdir()
    with pytest.raises(SpoolError, match="not a spool"):
        Spool(tmp_path / "plain", create=False)
    assert not (tmp_path / "missing").exists()
    Spool(tmp_path / "s")
    assert Spool(tmp_path / "s", create=False).root == (tmp_path / "s").absolute()


# ---- lifecycle ----


def test_publish_claim_release_ack(tmp_path):
    sp = Spool(tmp_path)
    tmp = sp.new_tmp_path(shard_name(1, "p0", 0))
    assert tmp.parent == sp.tmp_dir
    tmp.mkdir()
    (tmp / "samples.txt").write_text("5,6")
    ready = sp.publish(tmp)
    assert (
        ready == sp.ready_dir / tmp.name and not tmp.exists() and (ready / "samples.txt").read_text() == "5,6"
    )

    c = sp.claim("c0")
    assert c == sp.claimed_dir / "c0" / tmp.name and c.is_dir() and not ready.exists()
    assert sp.claim("c0") is None and sp.claim("c1") is None
    sp.release(c)
    assert ready.is_dir() and not c.exists()
    c = sp.claim("c1")
    assert c.parent.name == "c1"
    sp.ack(c)
    assert not c.exists() and not ready.exists()
    assert os.listdir(sp.claimed_dir / "c1") == []
    sp.ack(c)  # already gone (e.g. recovered and re-delivered): a warning, not a crash
    sp.release(c)
    with pytest.raises(ValueError, match="not a claimed shard"):
        sp.ack(sp.ready_dir / tmp.name)


def test_file_shards_are_supported(tmp_path):
    sp = Spool(tmp_path)
    tmp = sp.new_tmp_path(shard_name(0, "p0", 0))
    tmp.write_bytes(b"x" * 100)
    sp.publish(tmp)
    assert sp.total_bytes() == 100
    c = sp.claim("c0")
    assert c.read_bytes() == b"x" * 100
    sp.ack(c)
    assert sp.total_bytes() == 0 and not c.exists()


def test_publish_rejects_foreign_paths_and_live_duplicates(tmp_path):
    sp = Spool(tmp_path)
    with pytest.raises(ValueError):
        sp.new_tmp_path("whatever.zarr")  # tmp names must carry the producer id
    with pytest.raises(ValueError, match="new_tmp_path"):
        sp.publish(tmp_path / "elsewhere.zarr")
    put_dummy(sp, 0, "p0", 0, [1])
    c = sp.claim("c0")
    tmp = sp.new_tmp_path(c.name)
    tmp.mkdir()
    with pytest.raises(SpoolError, match="already live"):
        sp.publish(tmp)
    assert tmp.exists() and c.exists()


def test_next_seq_skips_live_names(tmp_path):
    sp = Spool(tmp_path)
    assert sp.next_seq("p0") == 0
    put_dummy(sp, 0, "p0", 3)
    put_dummy(sp, 5, "p0", 7)
    put_dummy(sp, 0, "p1", 50)
    sp.claim("c0", bucket=5)
    sp.new_tmp_path(shard_name(0, "p0", 4)).mkdir()
    assert sp.next_seq("p0") == 8
    assert sp.next_seq("p1") == 51
    assert sp.next_seq("p2") == 0


def test_claim_by_bucket(tmp_path):
    sp = Spool(tmp_path)
    for seq in range(3):
        put_dummy(sp, 1, "p1", seq)
    for seq in range(5):
        put_dummy(sp, 2, "p0", seq)
    put_dummy(sp, 3, "p0", 0)
    assert sp.claim("c", bucket=3).name == shard_name(3, "p0", 0)
    assert sp.claim("c", bucket=3) is None
    assert sp.claim("c", bucket=7) is None
    assert sp.claim("c").name == shard_name(1, "p1", 0)  # lowest name first
    got = [sp.claim("c", bucket="fullest").name for _ in range(3)]
    assert got == [shard_name(2, "p0", s) for s in range(3)]  # bucket 2 has 5 ready, bucket 1 has 2
    # now bucket 1 and 2 both have 2 ready: ties go to the lower bucket
    assert sp.claim("c", bucket="fullest").name == shard_name(1, "p1", 1)
    assert parse_shard_name(sp.claim("c", bucket="fullest").name)[0] == 2
    for bad in ("most", -1, True, 1.5):
        with pytest.raises(ValueError, match="bucket must be"):
            sp.claim("c", bucket=bad)


@pytest.mark.pipeline
def test_ack_interrupted_mid_delete_is_never_a_shard(tmp_path):
    sp = Spool(tmp_path)
    put_dummy(sp, 0, "p0", 0, [1], pad=10)
    c = sp.claim("dead")
    # what a crash between the trash rename and the end of rmtree leaves behind
    trash = c.parent / f"{spool_files.ACK_PREFIX}{c.name}-deadbeef"
    os.rename(c, trash)
    (trash / "pad.bin").unlink()
    sp.register_producers(["p0"])
    sp.mark_done("p0")
    assert sp.claim("c1") is None
    assert sp.is_drained()
    st = sp.stats()
    assert st["states"]["claimed"]["shards"] == 0 and st["states"]["claimed"]["bytes"] == 1
    _write_heartbeat(sp, "dead", pid=_dead_pid())
    assert Spool(tmp_path).recover_dead_claims() == 0  # a fresh object: sp itself adopted "dead"
    assert not (sp.claimed_dir / "dead").exists()


@pytest.mark.pipeline
def test_an_acked_shard_counts_until_deleted_and_a_dead_consumers_are_finished(tmp_path):
    """The ack moves the shard into acked/ (not beside the claim: a listing during a rename within a
    folder can miss the entry, and the budget scan must never miss 1.6 GB being freed); its bytes count in
    total_bytes until its pages are freed; a dead consumer's half-deleted acks are deleted on recovery."""
    sp = Spool(tmp_path)
    put_dummy(sp, 0, "p0", 0, [1], pad=1000)
    before = sp.total_bytes()
    trash = sp.ack(sp.claim("c0"), delete=False)
    assert trash.parent == sp.acked_dir and not any((sp.claimed_dir / "c0").iterdir())
    assert sp.total_bytes() == before and sp.stats()["total_bytes"] == before
    Spool.remove_trash(trash)
    assert sp.total_bytes() == 0
    put_dummy(sp, 0, "p0", 1, [2], pad=10)
    left = sp.ack(sp.claim("dead"), delete=False)  # the consumer dies before freeing it
    _write_heartbeat(sp, "dead", pid=_dead_pid())
    Spool(tmp_path).recover_dead_claims()
    assert not left.exists() and sp.total_bytes() == 0


def test_quarantine_writes_one_line_why_and_flow_continues(tmp_path):
    sp = Spool(tmp_path)
    put_dummy(sp, 0, "p0", 0, [1])
    put_dummy(sp, 0, "p0", 1, [2])
    c = sp.claim("c0")
    q = sp.quarantine(c, "bad shard:\n  missing array 'hidden'")
    assert q == sp.quarantine_dir / c.name and q.is_dir() and not c.exists()
    why = (sp.quarantine_dir / (c.name + ".why")).read_text()
    assert why.count("\n") == 1 and why.endswith("bad shard: missing array 'hidden'\n")
    time.strptime(why.split(" ")[0], "%Y-%m-%dT%H:%M:%S%z")
    c2 = sp.claim("c0")
    assert c2.name == shard_name(0, "p0", 1)
    sp.ack(c2)
    # the same name quarantined again does not overwrite the first one
    put_dummy(sp, 0, "p0", 0, [1])
    q2 = sp.quarantine(sp.ready_dir / c.name, "again")
    assert q2 != q and q.is_dir() and q2.is_dir() and (q2.parent / (q2.name + ".why")).exists()
    assert sp.stats()["states"]["quarantine"]["bytes"] == 2
    # a shard that vanished meanwhile: no crash, no orphan .why
    assert sp.quarantine(sp.claimed_dir / "c0" / c.name, "gone") == sp.claimed_dir / "c0" / c.name
    assert sorted(os.listdir(sp.quarantine_dir)) == sorted(
        [q.name, q.name + ".why", q2.name, q2.name + ".why"]
    )


def test_clean_tmp_removes_only_own_leftovers(tmp_path):
    sp = Spool(tmp_path)
    for pid, seq in (("p0", 0), ("p0", 1), ("p1", 0), ("p01", 0)):
        t = sp.new_tmp_path(shard_name(0, pid, seq))
        t.mkdir()
        (t / "part").write_bytes(b"x")
    assert sp.clean_tmp("p0") == 2
    assert sorted(os.listdir(sp.tmp_dir)) == [shard_name(0, "p01", 0), shard_name(0, "p1", 0)]
    assert sp.clean_tmp("p0") == 0


# ---- recovery ----


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _write_heartbeat(sp: Spool, cid: str, **override) -> None:
    hb = {
        "role": "consumer",
        "id": cid,
        "pid": os.getpid(),
        "host": liveness.HOST,
        "boot_id": liveness.BOOT_ID,
    }
    hb["start_ticks"] = liveness.proc_stat(os.getpid())[1]
    hb["time"] = time.time()
    hb.update(override)
    (sp.state_dir / f"consumer-{cid}.json").write_text(json.dumps(hb))


def _claim_two(sp: Spool, cid: str, seq0: int) -> None:
    put_dummy(sp, 0, "p0", seq0)
    put_dummy(sp, 0, "p0", seq0 + 1)
    sp.claim(cid)
    sp.claim(cid)


@pytest.mark.pipeline
def test_recover_dead_claims_by_pid_reuse_staleness_and_missing_heartbeat(tmp_path):
    sp = Spool(tmp_path)
    claimer = Spool(tmp_path)
    now = time.time()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while liveness.proc_stat(zombie.pid)[0] != "Z":
        time.sleep(0.01)
    cases = {
        "gone": {"pid": _dead_pid()},
        "zombie": {"pid": zombie.pid, "start_ticks": None},
        "reused": {"start_ticks": liveness.proc_stat(os.getpid())[1] - 1},  # our pid, another process
        "stale": {"time": now - 100},
        "rebooted": {"boot_id": "another-boot"},
        "alive": {},
        "remote_fresh": {"host": "elsewhere", "pid": 1},
        "remote_stale": {"host": "elsewhere", "pid": 1, "time": now - 100},
    }
    for i, (cid, override) in enumerate(cases.items()):
        _claim_two(claimer, cid, 10 * i)
        _write_heartbeat(sp, cid, **override)
    _claim_two(claimer, "nohb_fresh", 100)
    _claim_two(claimer, "nohb_old", 200)
    for cid in ("nohb_fresh", "nohb_old"):
        (sp.state_dir / f"consumer-{cid}.json").unlink()
    os.utime(sp.claimed_dir / "nohb_old", (now - 100, now - 100))

    assert sp.recover_dead_claims(heartbeat_timeout_s=60) == 2 * 7
    assert sorted(os.listdir(sp.claimed_dir)) == ["alive", "nohb_fresh", "remote_fresh"]
    assert len(os.listdir(sp.ready_dir)) == 14
    assert sp.recover_dead_claims(heartbeat_timeout_s=60) == 0
    zombie.wait()


@pytest.mark.pipeline
def test_heartbeat_alive_rules():
    me = {"pid": os.getpid(), "host": liveness.HOST, "boot_id": liveness.BOOT_ID, "time": time.time()}
    assert heartbeat_alive(me, timeout_s=10)
    assert heartbeat_alive({**me, "start_ticks": liveness.proc_stat(os.getpid())[1]}, timeout_s=10)
    assert not heartbeat_alive({**me, "pid": _dead_pid()}, timeout_s=10)
    assert not heartbeat_alive({**me, "time": time.time() - 11}, timeout_s=10)


def test_restarted_consumer_gives_back_its_previous_claims(tmp_path):
    first = Spool(tmp_path)
    for seq in range(3):
        put_dummy(first, 0, "p0", seq)
    assert first.claim("c0") and first.claim("c0")
    # the process "dies"; a new one with the same consumer id starts (its pid is alive, so
    # recover_dead_claims would never free those claims)
    second = Spool(tmp_path)
    got = {second.claim("c0").name for _ in range(3)}
    assert got == {shard_name(0, "p0", s) for s in range(3)}
    assert second.claim("c0") is None
    assert len(os.listdir(second.claimed_dir / "c0")) == 3
    # another consumer must not steal claims of a live one
    assert Spool(tmp_path).recover_dead_claims() == 0


def test_consumer_whose_claims_were_recovered_keeps_claiming(tmp_path):
    """A live consumer whose heartbeat went stale (e.g. a long compile) loses its claims and its claimed
    dir; its next claim must still work."""
    slow = Spool(tmp_path)
    _claim_two(slow, "slow", 0)
    _write_heartbeat(slow, "slow", time=time.time() - 1000)
    assert Spool(tmp_path).recover_dead_claims(heartbeat_timeout_s=60) == 2
    assert not (slow.claimed_dir / "slow").exists()
    got = slow.claim("slow")
    assert got is not None and got.parent == slow.claimed_dir / "slow" and got.is_dir()
    assert mode(got.parent) == 0o700
    slow.ack(slow.claimed_dir / "slow" / shard_name(0, "p0", 1))  # the recovered one: a warning only
    assert (slow.ready_dir / shard_name(0, "p0", 1)).is_dir()


# ---- accounting, backpressure, state ----


def test_byte_accounting_per_state_and_bucket_and_cache(tmp_path, monkeypatch):
    sp = Spool(tmp_path)
    put_dummy(sp, 1, "p0", 0, [1, 2], pad=1000)
    put_dummy(sp, 1, "p0", 1, [3], pad=500)
    put_dummy(sp, 2, "p0", 2, [4], pad=300)
    t = sp.new_tmp_path(shard_name(2, "p0", 3))
    t.mkdir()
    (t / "part").write_bytes(b"\0" * 77)
    reader = Spool(tmp_path)
    c = reader.claim("c0", bucket=2)
    b1, b2, b3 = dummy_bytes([1, 2], 1000), dummy_bytes([3], 500), dummy_bytes([4], 300)
    assert sp.total_bytes() == b1 + b2 + b3 + 77
    st = reader.stats()
    assert st["states"]["ready"] == {
        "shards": 2,
        "bytes": b1 + b2,
        "buckets": {1: {"shards": 2, "bytes": b1 + b2}},
    }
    assert st["states"]["claimed"]["buckets"] == {2: {"shards": 1, "bytes": b3}}
    assert st["states"]["tmp"]["buckets"] == {2: {"shards": 1, "bytes": 77}}
    assert st["claimed_by"] == {"c0": {"shards": 1, "bytes": b3}}
    assert st["total_bytes"] == b1 + b2 + b3 + 77
    json.dumps(st)

    # published shards are measured once; later polls only list directories (tmp/ is always walked)
    calls = []
    real = spool_scan.entry_nbytes
    monkeypatch.setattr(spool_scan, "entry_nbytes", lambda p: calls.append(p) or real(p))
    (t / "part2").write_bytes(b"\0" * 23)
    assert sp.total_bytes() == b1 + b2 + b3 + 100
    assert calls == [str(t)]
    reader.ack(c)
    calls.clear()
    assert sp.total_bytes() == b1 + b2 + 100 and calls == [str(t)]
    assert len(sp.scan._size_cache) == 2  # forgotten once acked


def test_wait_for_budget(tmp_path, monkeypatch):
    sp = Spool(tmp_path)
    put_dummy(sp, 0, "p0", 0, pad=1000)
    sleeps: list[float] = []  # the waits, counted instead of timed (a verdict that cannot depend on load)
    monkeypatch.setattr(spool_mod.time, "sleep", sleeps.append)
    assert sp.wait_for_budget(1000) is True
    assert sleeps == []  # at the budget: returns without waiting
    stops = iter([False, False, True])  # a 4th should_stop() call would raise StopIteration
    assert sp.wait_for_budget(999, poll_s=0.01, should_stop=lambda: next(stops)) is False
    assert sleeps == [0.01, 0.01]  # two polls, then the stop request ended the wait
    with pytest.raises(ValueError, match="budget_bytes"):
        sp.wait_for_budget(0)


def test_default_budget_bytes(tmp_path):
    sp = Spool(tmp_path / "s")
    put_dummy(sp, 0, "p0", 0, pad=4096)
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    got = default_budget_bytes(sp.root, fraction=0.25)
    assert abs(got - (free + 4096) * 0.25) < 0.01 * free  # other processes write to the same disk
    assert default_budget_bytes(tmp_path / "not" / "yet", fraction=1.0) > 0
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            default_budget_bytes(tmp_path, fraction=bad)


def test_producers_done_and_drained(tmp_path):
    sp = Spool(tmp_path)
    assert not sp.producers_done() and not sp.is_drained()
    sp.register_producers(["p1", "p0"])
    assert sp.registered_producers() == ["p0", "p1"]
    put_dummy(sp, 0, "p0", 0)
    sp.mark_done("p0")
    assert not sp.producers_done()
    sp.mark_done("p1")
    assert sp.producers_done() and not sp.is_drained()
    c = sp.claim("c0")
    assert not sp.is_drained()
    sp.ack(c)
    assert sp.is_drained()
    sp.new_tmp_path(shard_name(0, "p1", 9)).mkdir()
    assert not sp.is_drained()
    sp.clean_tmp("p1")
    sp.clear_done("p1")
    assert not sp.producers_done() and sp.done_producers() == ["p0"]
    with pytest.raises(ValueError):
        sp.register_producers([])


def test_heartbeat_state_and_rates(tmp_path, monkeypatch):
    sp = Spool(tmp_path)
    clock = [1000.0]
    monkeypatch.setattr(spool_mod.time, "time", lambda: clock[0])
    sp.records._started = 1000.0
    clock[0] = 1002.0
    sp.heartbeat("producer", "p0", {"samples": 10, "tokens": 400, "note": "x"})
    hb = json.loads((sp.state_dir / "producer-p0.json").read_text())
    assert hb["pid"] == os.getpid() and hb["host"] == liveness.HOST and hb["time"] == 1002.0
    assert hb["counters"] == {"samples": 10, "tokens": 400, "note": "x"}
    assert hb["rates"] == {"samples": 5.0, "tokens": 200.0}
    clock[0] = 1010.0
    sp.heartbeat("producer", "p0", {"samples": 50, "tokens": 800})
    clock[0] = 1012.0
    sp.heartbeat("producer", "p0", {"samples": 70, "tokens": 900})  # inside the window: rates kept
    hb = json.loads((sp.state_dir / "producer-p0.json").read_text())
    assert hb["rates"] == {"samples": 5.0, "tokens": 80.0} and hb["counters"]["samples"] == 70
    clock[0] = 1020.0
    sp.heartbeat("producer", "p0", {"samples": 100, "tokens": 1000})
    assert json.loads((sp.state_dir / "producer-p0.json").read_text())["rates"] == {
        "samples": 5.0,
        "tokens": 20.0,
    }
    assert [n for n in os.listdir(sp.state_dir) if n.endswith(".tmp")] == []
    clock[0] = 1030.0
    (proc,) = sp.stats()["processes"]
    assert proc["role"] == "producer" and proc["id"] == "p0" and proc["alive"] and proc["age_s"] == 10.0
    clock[0] = 1100.0
    assert not sp.stats(heartbeat_timeout_s=60)["processes"][0]["alive"]
    with pytest.raises(ValueError):
        sp.heartbeat("Producer!", "p0", {})


def test_writer_killed_mid_write_in_process_simulation_leaves_ready_clean(tmp_path):
    """The cheap single-process version of the SIGKILL test in test_spool_multiproc.py."""
    sp = Spool(tmp_path)
    t = sp.new_tmp_path(shard_name(0, "p0", 0))
    t.mkdir()
    (t / "half").write_bytes(b"\0" * 10)
    assert os.listdir(sp.ready_dir) == [] and sp.claim("c0") is None
    assert Spool(tmp_path).clean_tmp("p0") == 1 and os.listdir(sp.tmp_dir) == []


@pytest.mark.pipeline
def test_zombie_detection_sees_a_killed_unreaped_child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    hb = {"pid": p.pid, "host": liveness.HOST, "boot_id": liveness.BOOT_ID, "time": time.time()}
    assert heartbeat_alive(hb, timeout_s=60)
    os.kill(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30  # bounds the wait (below the 60 s staleness: the pid check decides)
    while heartbeat_alive(hb, timeout_s=60) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not heartbeat_alive(hb, timeout_s=60)
    p.wait()


def test_undecodable_real_shard_is_quarantined_with_the_reader_error(tmp_path):
    import torch

    from dflash.common.contract.shard import Shard, ShardFormatError, ShardMeta
    from dflash.common.contract.shard_reader import read_shard
    from dflash.common.contract.shard_writer import write_shard

    sp = Spool(tmp_path)
    for seq in range(3):
        t = 20
        shard = Shard(
            input_ids=torch.arange(t, dtype=torch.int32),
            loss_mask=torch.ones(t, dtype=torch.bool),
            cu_seqlens=torch.tensor([0, 8, t]),
            sample_index=torch.tensor([2 * seq, 2 * seq + 1]),
            hidden=torch.randn(t, 2 * 16).to(torch.bfloat16),
            meta=ShardMeta(target_model="m", layer_ids=[0, 1], hidden_size=16, producer_id="p0", bucket=32),
        )
        tmp = sp.new_tmp_path(shard_name(32, "p0", seq))
        sp.publish(tmp, nbytes=write_shard(tmp, shard))
    bad = sp.ready_dir / shard_name(32, "p0", 1)
    for chunk in (bad / "hidden").rglob("*"):
        if chunk.is_file() and chunk.name != "zarr.json":
            chunk.unlink()  # a truncated shard
    seen, errors = [], []
    while (c := sp.claim("c0")) is not None:
        try:
            seen += read_shard(c).sample_index.tolist()
        except ShardFormatError as err:
            errors.append(str(err))
            sp.quarantine(c, str(err))
            continue
        sp.ack(c)
    assert seen == [0, 1, 4, 5] and len(errors) == 1
    why = (sp.quarantine_dir / (bad.name + ".why")).read_text()
    assert why.count("\n") == 1 and " ".join(errors[0].split()) in why and "hidden" in why
    assert (sp.quarantine_dir / bad.name).is_dir()
    st = sp.stats()
    assert (
        st["states"]["quarantine"]["shards"] == 1 and st["states"]["quarantine"]["buckets"][32]["shards"] == 1
    )
