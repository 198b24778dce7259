import json
import os
import socket
import subprocess
import time

import pytest

from dflash.common.contract.spool import Spool
from dflash.tools.status import cli as status

pytestmark = pytest.mark.pipeline  # every test here starts processes


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _jsonl(path, recs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _shard(d, name, nbytes):
    (d / name / "hidden" / "c").mkdir(parents=True)
    (d / name / "zarr.json").write_text("")  # 0 bytes: only the chunk counts
    (d / name / "hidden" / "c" / "0").write_bytes(b"x" * nbytes)


def make_run(tmp_path):
    """A synthetic run: 2 producers of this launch (one running, one done) and their launcher's pid, one
    remote producer of an earlier launch, 3 consumers (two alive, one exited), the trainer's sample ledger,
    a spool with shards in every state."""
    now = time.time()
    run, spool = tmp_path / "run", tmp_path / "spool"
    run.mkdir()
    (run / "run.json").write_text(
        json.dumps({"spool": str(spool), "checkpoint": "s3://bkt/p", "run": "demo"})
    )
    (run / "logs").mkdir()
    (run / "logs" / "consumer-0.log").write_text("hello\n")
    step = lambda s, t, **kw: {"time": t, "step": s, "loss": 3.0, "acc": [0.5], "tau": 2.0, "lr": 6e-4, **kw}  # noqa: E731
    _jsonl(
        run / "metrics" / "consumer-0.jsonl",
        [
            step(1100, now - 60, tok_s=19_000),
            {"event": "checkpoint", "step": 1000, "url": "s3://bkt/demo/step-1000", "time": now - 50},
            step(1200, now - 5, loss=2.314, acc=[0.7, 0.52], tau=3.421, lr=5.8e-4, tok_s=20_000),
        ],
    )
    _jsonl(run / "metrics" / "consumer-1.jsonl", [step(1200, now - 5, loss=2.5, tok_s=18_900)])
    _jsonl(
        run / "metrics" / "ledger-r0.jsonl", [{"step": 1200, "pid": 1, "samples": [1, 2], "time": now - 5}]
    )
    (run / "pids").write_text(f"producer {_dead_pid()}\n")  # the dflash-produce launcher, not a worker
    # producer-0: samples grow 10/s over the last 290 s
    _jsonl(
        run / "metrics" / "producer-0.jsonl",
        [
            {"time": now - 300 + 10 * k, "samples": 100 * k, "tokens": 90_000 * k, "tok_s": 9_000}
            for k in range(1, 30)
        ],
    )
    sp = Spool(spool)
    (spool / "claimed" / "c0").mkdir()
    _shard(spool / "ready", "b000512-0-s00000001.zarr", 1000)
    _shard(spool / "ready", "b000512-0-s00000002.zarr", 1000)
    _shard(spool / "ready", "b001024-0-s00000003.zarr", 1000)
    _shard(spool / "tmp", "b000512-0-s00000004.zarr", 500)
    _shard(spool / "claimed" / "c0", "b001024-1-s00000009.zarr", 2000)
    # live processes: this test process, through the real heartbeat writer
    # tok_s is the heartbeat's instantaneous rate; status shows the average (avg_tok_s)
    sp.heartbeat(
        "producer",
        "0",
        {
            "samples": 3000,
            "tokens": 2_700_000,
            "tok_s": 9000,
            "avg_tok_s": 8000,
            "total": 10_000,
            "phase": "produce",
        },
    )
    sp.heartbeat("consumer", "0", {"samples": 40_000, "tok_s": 20_000})
    sp.heartbeat("consumer", "1", {"samples": 39_000, "tokens": 1})
    # consumer-1 reports no tok_s: status uses the spool's rate of its `tokens` counter
    hb = json.loads((spool / "state" / "consumer-1.json").read_text())
    hb["rates"]["tokens"] = 18_900.0
    (spool / "state" / "consumer-1.json").write_text(json.dumps(hb))
    dead = _dead_pid()
    for role, pid_, extra in (
        (
            "producer",
            "1",
            {"pid": dead, "counters": {"samples": 4990, "dropped": 10, "total": 5000, "phase": "done"}},
        ),
        (
            "producer",
            "2",
            {"pid": 12345, "host": "elsewhere", "time": now - 1000, "counters": {"tok_s": 7777}},
        ),
        ("consumer", "2", {"pid": dead, "counters": {"tok_s": 5000}}),
    ):
        hb = {"role": role, "id": pid_, "host": socket.gethostname(), "time": now - 2, "rates": {}, **extra}
        (spool / "state" / f"{role}-{pid_}.json").write_text(json.dumps(hb))
    sp.register_producers(["0", "1"])
    sp.mark_done("1")
    return run, spool


def test_json_snapshot(tmp_path, capsys):
    run, spool = make_run(tmp_path)
    status.main([str(run), "--json"])
    snap = json.loads(capsys.readouterr().out)
    procs = {(p["role"], p["id"]): p for p in snap["processes"]}
    assert {k: p["state"] for k, p in procs.items()} == {
        ("consumer", "0"): "alive",
        ("consumer", "1"): "alive",
        ("consumer", "2"): "failed",  # gone without an end event
        ("producer", "0"): "alive",
        ("producer", "1"): "finished",
    }  # no ledger row, no launcher row, producer 2 is of an earlier launch
    assert snap["older_producers"] == ["2"]
    assert procs[("producer", "0")]["samples"] == 3000  # the heartbeat is newer than the metrics line
    assert snap["rates"] == {
        "producer_tok_s": 8000,
        "consumer_tok_s": 38_900,
        "bottleneck": "producers",
        "producer_throttled": None,  # its metrics count no budget wait
        "producer_unthrottled_tok_s": None,
        "over_the_run": False,
    }
    st = snap["spool"]["states"]
    assert st == {
        "tmp": {"shards": 1, "bytes": 500},
        "ready": {"shards": 3, "bytes": 3000},
        "claimed": {"shards": 1, "bytes": 2000},
        "quarantine": {"shards": 0, "bytes": 0},
    }
    assert snap["spool"]["buckets"] == {"512": {"ready": 2, "tmp": 1}, "1024": {"ready": 1, "claimed": 1}}
    assert snap["spool"]["claimed_by"] == {"c0": 1}
    assert snap["spool"]["producers_done"] == ["1"]
    pr = snap["progress"]
    assert (pr["planned_samples"], pr["samples"]) == (15_000, 8000)
    assert pr["samples_per_s"] == pytest.approx(10.0)
    assert pr["eta_s"] == pytest.approx(700.0)
    t = snap["training"]
    assert (t["rank"], t["step"], t["loss"], t["tau"], t["lr"]) == ("0", 1200, 2.314, 3.421, 5.8e-4)
    assert t["acc"] == pytest.approx(0.61)
    assert snap["checkpoint"]["step"] == 1000 and snap["checkpoint"]["url"] == "s3://bkt/demo/step-1000"
    assert snap["logs"] == [str(run / "logs" / "consumer-0.log")]


def test_text_screen(tmp_path, capsys):
    run, spool = make_run(tmp_path)
    status.main([str(run)])
    out = capsys.readouterr().out
    for want in (
        "step=1200 loss=2.31 acc=0.61 τ=3.42 lr=5.8e-04",
        "prod=8.0K tok/s (average)  cons=38.9K tok/s  (bottleneck: producers)",
        "earlier launches: 1 producer(s) not shown (2)",
        "consumers: lost to quarantine: 0 samples in 0 shard(s)",
        "tmp=1/500 B  ready=3/3.0 KB  claimed=1/2.0 KB  quarantine=0/0 B",
        "ready by bucket: 512:2 1024:1",
        "claimed by: c0:1",
        "producers done: 1/2",
        "8000/15000 samples (53.3%)  ETA 11m",
        "checkpoint: step=1000 s3://bkt/demo/step-1000",
        f"log: {run / 'logs' / 'consumer-0.log'}",
        str(spool),
    ):
        assert want in out, want
    lines = out.splitlines()
    p0 = next(ln for ln in lines if ln.startswith("producer  0 "))
    assert str(os.getpid()) in p0 and "alive" in p0 and "3000" in p0 and "8.0K" in p0
    assert [ln.split()[:2] for ln in lines if ln.startswith("producer ")] == [
        ["producer", "0"],
        ["producer", "1"],
    ]
    assert "ledger" not in out


def test_spool_flag_overrides_and_missing_spool(tmp_path, capsys):
    run, spool = make_run(tmp_path)
    status.main([str(run), "--spool", str(tmp_path / "gone")])
    out = capsys.readouterr().out
    assert f"spool: {tmp_path / 'gone'} (unreadable: no spool directory at" in out
    assert "step=1200" in out  # metrics still shown
    assert "exited" not in out  # no heartbeats without the spool: rows come from metrics only
    assert not (tmp_path / "gone").exists()  # read-only: status never creates a spool


def test_status_does_not_touch_the_spool(tmp_path, capsys):
    run, spool = make_run(tmp_path)
    before = sorted((str(p), p.stat().st_mtime_ns) for p in spool.rglob("*"))
    status.main([str(run), "--json"])
    assert sorted((str(p), p.stat().st_mtime_ns) for p in spool.rglob("*")) == before


@pytest.mark.parametrize("case", ["missing", "file", "empty", "bad_json"])
def test_bad_run_dir_is_one_line_exit_2(tmp_path, capsys, case):
    target = tmp_path / "r"
    if case == "file":
        target.write_text("x")
    elif case == "empty":
        target.mkdir()
    elif case == "bad_json":
        target.mkdir()
        (target / "run.json").write_text("{nope")
    with pytest.raises(SystemExit) as e:
        status.main([str(target)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-status: error: ") and "\n" not in err


def test_watch_refreshes_until_ctrl_c(tmp_path, capsys, monkeypatch):
    run, _ = make_run(tmp_path)
    calls = []

    def fake_sleep(s):
        calls.append(s)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(status.time, "sleep", fake_sleep)
    status.main([str(run), "--watch", "0.5"])
    out = capsys.readouterr().out
    assert calls == [0.5, 0.5]
    assert out.count("\x1b[2J") == 2 and out.count("step=1200") == 2


def test_read_pids(tmp_path):
    (tmp_path / "pids").write_text("producer-0 123\n456 consumer-0\n\nconsumer-1=789\n")
    assert status.read_pids(tmp_path) == {"producer-0": 123, "consumer-0": 456, "consumer-1": 789}


def test_trainer_ids_and_group_rate(tmp_path, capsys):
    """The trainer heartbeats as consumer r<rank>-<pid> and logs the all-reduced group rate (world_size):
    rows merge by rank, a restarted rank's old heartbeat does not win, the rate is counted once."""
    now = time.time()
    run, spool = tmp_path / "run", tmp_path / "spool"
    _jsonl(
        run / "metrics" / "consumer-0.jsonl",
        [{"time": now - 1, "step": 50, "loss": 1.0, "tok_s": 40_000, "world_size": 2}],
    )
    (run / "run.json").write_text(json.dumps({"spool": str(spool)}))
    sp = Spool(spool)
    old = {
        "role": "consumer",
        "id": "r0-1",
        "pid": _dead_pid(),
        "host": socket.gethostname(),
        "time": now - 30,
    }
    (spool / "state" / "consumer-r0-1.json").write_text(json.dumps({**old, "counters": {"tok_s": 1}}))
    me = os.getpid()
    for rank in (0, 1):
        sp.heartbeat(
            "consumer", f"r{rank}-{me}", {"step": 50, "samples": 800, "tok_s": 40_000, "world_size": 2}
        )
    status.main([str(run), "--json"])
    snap = json.loads(capsys.readouterr().out)
    assert [(p["id"], p["pid"], p["state"], p["tok_s"]) for p in snap["processes"]] == [
        ("0", me, "alive", 40_000),
        ("1", me, "alive", 40_000),
    ]
    assert snap["rates"]["consumer_tok_s"] == 40_000


def test_eta_when_producers_finished(tmp_path, capsys):
    run, spool = make_run(tmp_path)
    sp = Spool(spool, create=False)
    sp.heartbeat(
        "producer",
        "0",
        {"samples": 10_000, "tokens": 9_000_000, "tok_s": 0, "total": 10_000, "phase": "done"},
    )
    sp.mark_done("0")
    status.main([str(run)])
    out = capsys.readouterr().out
    assert "15000/15000 samples (100.0%)  ETA 0s (producers finished; consumers draining 4 shard(s))" in out
    assert "producers done: 2/2" in out


def _launch_run(tmp_path, producer_counters: dict, *, alive: bool = False):
    """A run of launch 2 whose one producer n0p0.2 heartbeated ``producer_counters`` 500 s ago (by this
    process when ``alive``, else by a dead pid), launched by a dead dflash-produce; launch 1's producer
    files are still in state/ and metrics/."""
    now = time.time()
    run, spool = tmp_path / "run", tmp_path / "spool"
    _jsonl(run / "metrics" / "ledger-r0.jsonl", [{"step": 1, "pid": 1, "samples": [0], "time": now - 600}])
    _jsonl(run / "metrics" / "producer-n0p0.1.jsonl", [{"time": now - 9000, "samples": 5, "avg_tok_s": 1.0}])
    (run / "run.json").write_text(json.dumps({"spool": str(spool)}))
    (run / "pids").write_text(f"producer {_dead_pid()}\nconsumer-0 {_dead_pid()}\n")
    sp = Spool(spool)
    sp.register_producers(["n0p0.2"])
    for pid_, t in (("n0p0.1", now - 9000), ("n0p0.2", now - 500)):
        hb = {
            "role": "producer",
            "id": pid_,
            "pid": os.getpid() if alive else _dead_pid(),
            "host": socket.gethostname(),
            "time": t,
            "counters": producer_counters,
            "rates": {},
        }
        (spool / "state" / f"producer-{pid_}.json").write_text(json.dumps(hb))
    return run


def test_exited_producer_is_one_exited_row(tmp_path, capsys):
    run = _launch_run(
        tmp_path, {"samples": 40, "dropped": 2, "total": 100, "avg_tok_s": 700.0, "phase": "produce"}
    )
    status.main([str(run)])
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("producer ", "consumer ", "ledger "))]
    assert [r[:2] for r in rows] == [["consumer", "0"], ["producer", "n0p0.2"]]
    assert rows[1][3] == "failed" and rows[0][3] == "failed"  # gone without saying they ended
    assert "earlier launches: 1 producer(s) not shown (n0p0.1)" in out
    assert "run: failed" in out  # every process gone, none said it ended
    assert "progress: 42/100 samples produced; the run failed" in out


def test_eta_unknown_until_producers_report(tmp_path, capsys):
    run = _launch_run(tmp_path, {"samples": 0, "total": 0, "phase": "tokenize"}, alive=True)
    status.main([str(run)])
    out = capsys.readouterr().out
    assert "progress: ETA unknown: producers have not reported their dataset size yet" in out
    status.main([str(run), "--json"])
    assert json.loads(capsys.readouterr().out)["progress"] is None


def test_eta_from_the_producers_planned_total(tmp_path, capsys):
    run = _launch_run(
        tmp_path, {"samples": 300, "dropped": 100, "total": 1000, "phase": "produce"}, alive=True
    )
    now = time.time()  # samples grow 2/s in the metrics (older than the heartbeat): 600 left -> 300 s
    _jsonl(
        run / "metrics" / "producer-n0p0.2.jsonl",
        [{"time": now - 700 + k, "samples": 2 * k} for k in range(0, 100, 10)],
    )
    status.main([str(run), "--json", "--stale-s", "1000"])
    pr = json.loads(capsys.readouterr().out)["progress"]
    assert (pr["planned_samples"], pr["samples"]) == (1000, 400)
    assert pr["eta_s"] == pytest.approx(300.0)


@pytest.mark.parametrize(
    "counters, want",
    [
        ({"tok_s": 50_000.0, "avg_tok_s": 8000.0, "tokens": 1_000_000, "elapsed_s": 100.0}, 8000.0),
        ({"tok_s": 50_000.0, "tokens": 1_000_000, "elapsed_s": 200.0}, 5000.0),  # tokens / elapsed
        ({"tok_s": 50_000.0}, None),  # no average known: never the instantaneous figure
    ],
)
def test_producer_throughput_is_the_metrics_average(tmp_path, capsys, counters, want):
    run = _launch_run(tmp_path, {**counters, "total": 10, "phase": "produce"}, alive=True)
    status.main([str(run), "--json"])
    snap = json.loads(capsys.readouterr().out)
    (p,) = [p for p in snap["processes"] if p["role"] == "producer"]
    assert p["state"] == "stale" and p["tok_s"] == want  # alive pid, heartbeat older than --stale-s
    status.main([str(run), "--json", "--stale-s", "1000"])
    snap = json.loads(capsys.readouterr().out)
    assert snap["rates"]["producer_tok_s"] == (want or 0)


def test_throughput_plot_is_the_producers_average():
    from dflash.tools.plots import _summed_rate

    recs = [{"time": 10.0 * k, "tok_s": 50_000.0 * (k % 2), "avg_tok_s": 1000.0 + k} for k in range(5)]
    assert _summed_rate([recs, recs], average=True) == (
        [0.0, 10.0, 20.0, 30.0, 40.0],
        [2000.0, 2002.0, 2004.0, 2006.0, 2008.0],
    )


def test_campaign_epoch_and_held_out_tau_are_shown(tmp_path, capsys):
    """The latest step's step/total and epoch k/N, and the held-out decode-order τ next to the in-loop τ."""
    run, _ = make_run(tmp_path)
    path = run / "metrics" / "consumer-0.jsonl"
    now = time.time()
    extra = [
        {"event": "eval", "step": 1200, "decode_tau": 2.71, "time": now - 4, "eval_docs": 64},
        {
            "time": now - 3,
            "step": 1201,
            "loss": 2.3,
            "acc": [0.7],
            "tau": 3.4,
            "lr": 5e-4,
            "total_steps": 9000,
            "epoch": 2,
            "epochs": 6,
        },
    ]
    path.write_text(path.read_text() + "".join(json.dumps(r) + "\n" for r in extra))
    status.main([str(run)])
    out = capsys.readouterr().out
    assert "step=1201/9000 epoch=2/6 loss=2.3" in out
    assert "held-out τ (decode order, what serving sees) 2.71 at step 1200" in out


def test_tau_plot_shows_the_held_out_decode_tau(tmp_path):
    from dflash.tools.plots import write_plots

    run = tmp_path / "run"
    steps = [{"time": 1000.0 + i, "step": i, "loss": 3.0, "tok_s": 1.0} for i in range(1, 6)]  # no in-loop τ
    _jsonl(run / "metrics" / "consumer-0.jsonl", steps)
    assert "tau.png" not in {p.name for p in write_plots(run)}
    evals = [{"event": "eval", "step": s, "decode_tau": 1.5 + 0.1 * s, "time": 1000.0 + s} for s in (0, 5)]
    _jsonl(run / "metrics" / "consumer-0.jsonl", steps + evals)
    assert "tau.png" in {p.name for p in write_plots(run)}  # drawn from the held-out points alone


def _over_run(tmp_path, consumer_end: dict | None, producer_phase: str):
    """A run whose spool was removed (run_all.sh does at the end): one producer of launch 2 (launch 1's
    metrics still there), consumer rank 0 of launch 2 ending with ``consumer_end`` (None: it died without
    a word), and rank 1 of launch 1, which stopped before launch 2 began."""
    now = time.time()
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"spool": str(tmp_path / "gone-spool")}))
    (run / "pids").write_text(f"producer {_dead_pid()}\nconsumer-0 {_dead_pid()}\n")

    def step(s: int, t: float) -> dict:
        return {
            "time": t,
            "step": s,
            "loss": 2.0,
            "acc": [0.5],
            "tau": 2.0,
            "lr": 1e-4,
            "total_steps": 40,
            "eta_s": 5.0,
        }

    _jsonl(
        run / "metrics" / "producer-n0p0.1.jsonl", [{"time": now - 900, "samples": 10, "phase": "stopped"}]
    )
    _jsonl(
        run / "metrics" / "producer-n0p0.2.jsonl",
        [{"time": now - 60, "samples": 90, "total": 90, "phase": producer_phase}],
    )
    _jsonl(
        run / "metrics" / "consumer-1.jsonl",
        [step(10, now - 800), {"event": "end", "stopped": True, "time": now - 790}],
    )
    rank0 = [step(10, now - 800), {"event": "end", "stopped": True, "time": now - 790}, step(40, now - 30)]
    _jsonl(
        run / "metrics" / "consumer-0.jsonl",
        rank0 + ([{**consumer_end, "time": now - 20}] if consumer_end else []),
    )
    return run


@pytest.mark.parametrize(
    ("consumer_end", "producer_phase", "want"),
    [
        ({"event": "end", "stopped": False}, "done", "finished"),
        ({"event": "end", "stopped": True}, "stopped", "stopped"),
        ({"event": "failed", "error": "StoreOutageError: ..."}, "done", "failed"),
        (None, "done", "failed"),  # kill -9: gone without an end event
    ],
)
def test_a_run_that_is_over_says_how_it_ended(tmp_path, capsys, consumer_end, producer_phase, want):
    run = _over_run(tmp_path, consumer_end, producer_phase)
    status.main([str(run), "--json"])
    snap = json.loads(capsys.readouterr().out)
    assert snap["run_state"] == want
    rows = {(p["role"], p["id"]): p["state"] for p in snap["processes"]}
    # launch 1's producer and consumer rank 1 are over and of an earlier launch: not listed
    assert set(rows) == {("consumer", "0"), ("producer", "n0p0.2")}, rows
    assert snap["older_consumers"] == ["1"] and snap["older_producers"] == ["n0p0.1"]
    assert rows[("producer", "n0p0.2")] == ("finished" if producer_phase == "done" else "stopped")
    assert rows[("consumer", "0")] == ("finished" if want == "finished" else want)
    status.main([str(run)])
    out = capsys.readouterr().out
    assert f"run: {want}" in out and f"the run {want} at step 40" in out
    assert "removed (the run is over" in out and "unreadable" not in out and "ETA" not in out


def test_a_producer_waiting_on_the_budget_is_blocked_and_the_eta_is_the_trainings(tmp_path, capsys):
    from dflash.common.contract.spool_records import BUDGET_PHASE

    run = _launch_run(tmp_path, {"samples": 300, "total": 1000, "phase": BUDGET_PHASE}, alive=True)
    now = time.time()
    _jsonl(
        run / "metrics" / "producer-n0p0.2.jsonl",
        [{"time": now - 700 + k, "samples": 30 * k} for k in range(0, 10)],
    )
    _jsonl(
        run / "metrics" / "consumer-0.jsonl",
        [
            {
                "time": now - 10,
                "step": 100,
                "loss": 2.0,
                "acc": [0.5],
                "tau": 2.0,
                "lr": 1e-4,
                "total_steps": 400,
                "eta_s": 610.0,
            }
        ],
    )
    status.main([str(run), "--json", "--stale-s", "1000"])
    snap = json.loads(capsys.readouterr().out)
    assert {p["id"]: p["state"] for p in snap["processes"] if p["role"] == "producer"} == {
        "n0p0.2": "blocked"
    }
    assert snap["run_state"] == "running"
    status.main([str(run), "--stale-s", "1000"])
    out = capsys.readouterr().out
    # production would say ~25 s (700 samples at 30/s): the run ends when training does
    assert "step 100/400  ETA 10m (training)" in out, out


def test_a_finished_run_shows_each_side_at_its_run_average_and_blames_the_slower(tmp_path, capsys):
    """A finished run: the consumer row and the rates line give the consumer's tokens/s over its last
    launch (its intervals' tokens over their seconds: 913), not its last interval's (303), and the
    bottleneck is read from the averages: the producers (700), not the consumers."""
    run = _over_run(tmp_path, {"event": "end", "stopped": False}, "done")
    now = time.time()
    _jsonl(
        run / "metrics" / "producer-n0p0.2.jsonl",
        [
            {
                "time": now - 60,
                "samples": 90,
                "total": 90,
                "phase": "done",
                "tokens": 70_000,
                "elapsed_s": 100.0,
            }
        ],
    )

    def step(s: int, t: float, tokens: int, secs: float) -> dict:
        return {
            "time": t,
            "step": s,
            "loss": 2.0,
            "tok_s": tokens / secs,
            "interval_tokens": tokens,
            "interval_s": secs,
        }

    life1 = [step(10, now - 800, 1_000, 100.0), {"event": "end", "stopped": True, "time": now - 790}]
    intervals = [(20, 9_000, 10.0), (30, 9_000, 10.0), (40, 10_000, 10.0), (41, 303, 1.0)]  # 28,303 in 31 s
    life2 = [step(s, now - 40 + k, tok, secs) for k, (s, tok, secs) in enumerate(intervals)]
    _jsonl(
        run / "metrics" / "consumer-0.jsonl",
        life1 + life2 + [{"event": "end", "stopped": False, "time": now - 20}],
    )
    status.main([str(run), "--json"])
    snap = json.loads(capsys.readouterr().out)
    assert snap["run_state"] == "finished"
    cons = next(p for p in snap["processes"] if p["role"] == "consumer")
    assert cons["tok_s"] == pytest.approx(28_303 / 31) and cons["last_tok_s"] == pytest.approx(303)
    assert snap["rates"]["consumer_tok_s"] == pytest.approx(28_303 / 31)
    assert (
        snap["rates"]["producer_tok_s"] == pytest.approx(700) and snap["rates"]["bottleneck"] == "producers"
    )
    status.main([str(run)])
    out = capsys.readouterr().out
    assert "rates over the run: prod=700 tok/s (average)  cons=913 tok/s  (bottleneck: producers)" in out
    assert "consumers' average over their last launch" in out


def test_a_dead_worker_is_listed_failed_and_fails_the_run(tmp_path, capsys):
    """A worker killed at start-up: with the spool, its parent's record lists it (it never beat) and
    fails it; with the spool removed, its metrics' last record (``phase: dead``, the parent's) does. The
    other worker was stopped by run_all.sh: the run is failed, not stopped. Before: the dead worker was
    left out (with the spool) or `active` (without), and the run `stopped`."""
    how = "killed by SIGKILL after reporting its slice"
    run = _launch_run(tmp_path, {"samples": 30, "total": 60, "phase": "produce"}, alive=True)
    sp = Spool(tmp_path / "spool")
    sp.register_producers(["n0p0.2", "n0p1.2"])
    sp.mark_dead("n0p1.2", how)
    status.main([str(run), "--json", "--stale-s", "1000"])
    snap = json.loads(capsys.readouterr().out)
    rows = {p["id"]: p["state"] for p in snap["processes"] if p["role"] == "producer"}
    assert rows == {"n0p0.2": "alive", "n0p1.2": "failed"}, rows
    # the launch is over and its spool removed: the metrics say how each ended
    now = time.time()
    _jsonl(run / "metrics" / "producer-n0p0.2.jsonl", [{"time": now - 30, "samples": 30, "phase": "stopped"}])
    _jsonl(
        run / "metrics" / "producer-n0p1.2.jsonl",
        [
            {"time": now - 40, "samples": 0, "phase": "load model"},
            {"time": now - 35, "phase": "dead", "how": how},
        ],
    )
    (run / "run.json").write_text(json.dumps({"spool": str(tmp_path / "gone")}))
    status.main([str(run), "--json"])
    snap = json.loads(capsys.readouterr().out)
    rows = {p["id"]: p["state"] for p in snap["processes"] if p["role"] == "producer"}
    assert rows == {"n0p0.2": "stopped", "n0p1.2": "failed"}, rows
    assert snap["run_state"] == "failed"
