"""dflash-status: one screen on a live or finished run — processes, spool depth, training, rates, ETA.

Read-only: it never creates, moves or deletes anything in the run or spool directories, so it is safe to
run (or ``--watch``) alongside a live run. Inputs, all optional so a partial run still shows something:
``RUN_DIR/run.json`` ({"spool", "checkpoint", "run"} from ops/run_all.sh), ``RUN_DIR/metrics/*.jsonl``,
``RUN_DIR/pids`` (lines ``<name> <pid>``), ``RUN_DIR/logs/*.log`` and the spool's ``state/*.json``
heartbeats.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.common.cli.exits import fail
from dflash.common.cli.flags import add_flags, flag, from_args
from dflash.common.cli.help import DefaultsHelpFormatter
from dflash.common.contract.spool import Spool
from dflash.common.contract.spool_records import BUDGET_PHASE
from dflash.common.metrics import (
    average_tok_s,
    mean_acc,
    read_run_metrics,
)
from dflash.tools.status_render import render
from dflash.tools.status_sources import (
    StatusError,
    _isnum,
    find_spool_dir,
    pid_alive,
    read_pids,
    read_run_json,
    spool_snapshot,
)

log = logging.getLogger(__name__)
PROG = "dflash-status"

STATES = Spool.STATES  # ("tmp", "ready", "claimed", "quarantine")
_COUNTERS = (
    "samples", "tokens", "tok_s", "avg_tok_s", "elapsed_s", "total", "dropped", "phase", "step", "world_size",
    "shards_quarantined", "samples_quarantined",
)  # fmt: skip
ROLES = ("producer", "consumer")  # processes; other metrics files (ledger-r<rank>: trained samples) are not
# The trainer names its consumer id r<rank>-<pid> (unique per incarnation); its metrics file is per rank.
_CONSUMER_ID_RE = re.compile(r"^r(\d+)-\d+$")
ETA_WINDOW_S = 300.0  # producer sample rate = slope of `samples` over this trailing window of metrics
OVER = ("finished", "stopped", "failed")  # a process that said how it ended (or died without saying)
_ENDS = ("end", "failed")  # the consumer's last metrics events (consumer/cli.py)



# ---- spool -------------------------------------------------------------------------------------------


# ---- run directory -----------------------------------------------------------------------------------


def _sample_rate(recs: list[dict[str, Any]], row: dict[str, Any]) -> float | None:
    """Samples/s of one producer: slope of ``samples`` over the trailing window of its metrics, else
    ``tok_s * samples / tokens`` from its latest counters."""
    pts = [(r["time"], r["samples"]) for r in recs if _isnum(r.get("time")) and _isnum(r.get("samples"))]
    if len(pts) >= 2:
        t_end = pts[-1][0]
        win = [p for p in pts if p[0] >= t_end - ETA_WINDOW_S]
        if len(win) < 2:
            win = pts[-2:]
        dt = win[-1][0] - win[0][0]
        if dt > 0:
            return max(0.0, (win[-1][1] - win[0][1]) / dt)
    tok_s, samples, tokens = row.get("tok_s"), row.get("samples"), row.get("tokens")
    if _isnum(tok_s) and _isnum(samples) and _isnum(tokens) and tokens > 0:
        return tok_s * samples / tokens
    return None


def _rank_key(row: dict[str, Any]) -> tuple:
    i = str(row["id"])
    return (row["role"], 0 if i.isdigit() else 1, int(i) if i.isdigit() else 0, i)


def _current_producers(spool: dict[str, Any] | None, metrics: dict[str, list[dict[str, Any]]]) -> set[str] | None:
    """The producer ids of the current launch (state/producers.json), None when no launch registered any:
    producer ids carry their launch (n0p0.<launch>), so earlier launches' files are told apart by id. With
    the spool gone (a finished run's is removed), the ids of the newest launch in the metrics."""
    reg = spool["producers_registered"] if spool and spool["exists"] else []
    if reg:
        return set(map(str, reg))
    ids = [stem.partition("-")[2] for stem in metrics if stem.startswith("producer-")]
    launches = {i: int(i.rpartition(".")[2]) for i in ids if i.rpartition(".")[2].isdigit() and "." in i}
    if not launches:
        return None
    newest = max(launches.values())
    return {i for i, n in launches.items() if n == newest}


def _consumer_ends(recs: list[dict[str, Any]]) -> tuple[str | None, float | None, float | None]:
    """(how its last life ended: finished / stopped / failed, None while it runs; when that life started;
    its last record's time) from one consumer rank's metrics (lives are split by its end events)."""
    if not recs:
        return None, None, None
    ended = None
    last = recs[-1]
    if last.get("event") in _ENDS:
        ended = "failed" if last["event"] == "failed" else ("stopped" if last.get("stopped") else "finished")
    ends = [i for i, r in enumerate(recs[:-1]) if r.get("event") in _ENDS]
    start = recs[ends[-1] + 1 if ends else 0].get("time")
    return ended, start, last.get("time")


def _process_rows(
    metrics: dict[str, list[dict[str, Any]]],
    spool: dict[str, Any] | None,
    pids: dict[str, int],
    *,
    now: float,
    stale_s: float,
) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """One row per process of the current launch, merged from its metrics file, spool heartbeat and
    launcher pid (the counters of the newest source win), sorted by role, then numeric id; and the ids of
    earlier launches' producers and consumer ranks, which are left out (their files stay in state/ and
    metrics/)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    sources: dict[tuple[str, str], list[tuple[float, dict[str, Any]]]] = {}
    verdict: dict[tuple[str, str], tuple[bool, bool | None]] = {}  # (heartbeat alive, pid alive)
    current = _current_producers(spool, metrics)
    older: set[str] = set()
    older_consumers: set[str] = set()
    ends = {stem.partition("-")[2]: _consumer_ends(recs) for stem, recs in metrics.items() if stem.startswith("consumer-")}

    def row(key: tuple[str, str]) -> dict[str, Any] | None:
        if key[0] not in ROLES:
            return None
        if key[0] == "producer" and current is not None and key[1] not in current:
            older.add(key[1])
            return None
        return rows.setdefault(key, {"role": key[0], "id": key[1], "pid": None, "host": None})

    for stem, recs in metrics.items():
        role, _, id_ = stem.partition("-")
        steps = [r for r in recs if "event" not in r]
        if row((role, id_)) is not None and steps:
            sources.setdefault((role, id_), []).append((steps[-1].get("time") or 0.0, steps[-1]))
    # oldest first, so a rank's newest incarnation (after a restart) sets pid/host/alive last
    for hb in sorted(spool["processes"] if spool else [], key=lambda h: h["time"]):
        key = (str(hb["role"]), str(hb["id"]))
        if key[0] == "consumer" and (m := _CONSUMER_ID_RE.match(key[1])):
            key = ("consumer", m.group(1))
        if (r := row(key)) is None:
            continue
        r["pid"], r["host"] = hb.get("pid"), hb.get("host")
        verdict[key] = (bool(hb["alive"]), hb.get("pid_alive"))
        counters = {**hb.get("counters", {})}
        if key[0] == "consumer" and "tok_s" not in counters and _isnum(hb.get("rates", {}).get("tokens")):
            counters["tok_s"] = hb["rates"]["tokens"]  # the spool's rate of the `tokens` counter
        sources.setdefault(key, []).append((hb["time"], counters))
    for name, pid in pids.items():
        role, _, id_ = name.partition("-")
        if not id_ and any(k[0] == role for k in rows):
            continue  # `producer <pid>`: the launcher of the workers already listed, not one more process
        if (r := row((role, id_))) is not None:
            r["pid"] = r["pid"] or pid

    done = set(spool["producers_done"]) if spool else set()
    for key, r in rows.items():
        for _, src in sorted(sources.get(key, []), key=lambda s: s[0]):
            r.update({k: src[k] for k in _COUNTERS if src.get(k) is not None})
        last = max((t for t, _ in sources.get(key, [])), default=None)
        r["age_s"] = now - last if last else None
        ended = ends.get(r["id"], (None,))[0] if r["role"] == "consumer" else None
        r["state"] = _state(
            r, verdict.get(key), done=r["role"] == "producer" and r["id"] in done, stale_s=stale_s, ended=ended
        )
        r["active"] = r["state"] in ("alive", "active", "blocked")
        if r["role"] == "producer":
            r["tok_s"] = average_tok_s(r)  # the sustained rate, never the last heartbeat's
    # consumers of a launch that is over: a rank whose last record is older than the newest life's start
    # (it ended, died, or has said nothing since: a rank of an earlier, larger group)
    newest = max((e[1] for e in ends.values() if e[1] is not None), default=None)
    for key, r in list(rows.items()):
        last = ends.get(r["id"], (None, None, None))[2] if key[0] == "consumer" else None
        if newest is not None and last is not None and last < newest and r["state"] in (*OVER, "stale"):
            del rows[key]
            older_consumers.add(r["id"])
    return sorted(rows.values(), key=_rank_key), sorted(older), sorted(older_consumers)


def _state(
    r: dict[str, Any],
    verdict: tuple[bool, bool | None] | None,
    *,
    done: bool,
    stale_s: float,
    ended: str | None = None,
) -> str:
    """finished | stopped | failed (it said so: a DONE marker, its last phase or end event; or it is gone
    without saying how it ended) | blocked (alive, waiting on the spool's byte budget) | alive | stale (no
    news, the process may still run) | active (fresh, liveness unknown)."""
    phase = r.get("phase")
    if done or (r["role"] == "producer" and phase == "done"):
        return "finished"
    if ended is not None:
        return ended
    if r["role"] == "producer" and phase in ("stopped", "aborted"):
        return "stopped" if phase == "stopped" else "failed"
    state = _liveness(r, verdict, stale_s=stale_s)
    if state == "exited":
        return "failed"
    return "blocked" if state == "alive" and phase == BUDGET_PHASE else state


def _liveness(r: dict[str, Any], verdict: tuple[bool, bool | None] | None, *, stale_s: float) -> str:
    """alive | exited | stale | active, from the spool's verdict, else the launcher's pid, else the age."""
    fresh = r["age_s"] is not None and r["age_s"] <= stale_s
    if verdict is not None:  # the spool's verdict (pid, start time, heartbeat age), then the pid alone
        hb_alive, proc_alive = verdict
        if hb_alive:
            return "alive"
        return "exited" if proc_alive is False else "stale"
    alive = pid_alive(r["pid"], r["host"])  # no heartbeat: the launcher's pid, if any
    if alive is not None:
        return ("alive" if fresh else "stale") if alive else "exited"
    return "active" if fresh else "stale"


def _run_state(procs: list[dict[str, Any]]) -> str | None:
    """The run's state from its processes': running while any runs; else failed if any failed, stopped if
    any stopped, finished when every process finished; stale when nothing is known to run or to be over."""
    states = {p["state"] for p in procs}
    if not states:
        return None
    if states & {"alive", "active", "blocked"}:
        return "running"
    if "stale" in states:  # one may still run (its pid lives, its news is old): the run is not over
        return "stale"
    for verdict in ("failed", "stopped"):
        if verdict in states:
            return verdict
    return "finished"


def _total_rate(procs: list[dict[str, Any]], role: str) -> float:
    active = [p for p in procs if p["role"] == role and p["active"] and _isnum(p.get("tok_s"))]
    # A consumer that reports world_size > 1 logs the all-reduced rate of its whole DDP group:
    # count it once (the lowest rank's), never once per rank.
    group = [p for p in active if role == "consumer" and (p.get("world_size") or 1) > 1]
    return group[0]["tok_s"] if group else sum(p["tok_s"] for p in active)


def _planned(p: dict[str, Any]) -> int | None:
    """A producer's planned sample count: its ``total`` counter (the samples of its slice still to
    produce this launch, drops included), once it has tokenized its slice; None before that."""
    if p.get("phase") == "tokenize" or not _isnum(p.get("total")):
        return None
    return int(p["total"]) if p.get("phase") is not None or p["total"] > 0 else None


def _progress(procs: list[dict[str, Any]], metrics: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """The current launch's producers' planned vs done samples and the ETA at their current sample rate.
    In steady state spool backpressure ties the producers' pace to the consumers', so this tracks
    end-to-end progress; after it the consumers still drain what is left in the spool. None until a
    producer has reported its planned count."""
    planned = [(p, n) for p in procs if p["role"] == "producer" and (n := _planned(p)) is not None]
    if not planned:
        return None
    n_planned = sum(n for _, n in planned)
    # dropped samples (too short, unparseable) are settled too: total - samples - dropped is what is left
    n_done = sum(min(int((p.get("samples") or 0) + (p.get("dropped") or 0)), n) for p, n in planned)
    rate = sum(
        _sample_rate(metrics.get(f"producer-{p['id']}", []), p) or 0.0 for p, _ in planned if p["active"]
    )
    remaining = max(0, n_planned - n_done)
    return {
        "planned_samples": n_planned,
        "samples": n_done,
        "producers_reporting": len(planned),
        "fraction": n_done / n_planned if n_planned else 1.0,
        "samples_per_s": rate,
        "eta_s": 0.0 if remaining == 0 else (remaining / rate if rate > 0 else None),
    }


def _training(procs: list[dict[str, Any]], metrics: dict[str, list[dict[str, Any]]], now: float):
    """The latest step record of the lowest consumer rank that has one."""
    for c in (p for p in procs if p["role"] == "consumer"):
        steps = [r for r in metrics.get(f"consumer-{c['id']}", []) if "event" not in r]
        if steps:
            last = steps[-1]
            t = {
                "rank": c["id"],
                **{k: last.get(k) for k in ("step", "loss", "tau", "lr", "grad_norm", "fill", "total_steps", "epoch", "epochs", "eta_s")},  # fmt: skip
            }
            evals = [r for r in metrics.get(f"consumer-{c['id']}", []) if r.get("event") == "eval"]
            t["decode_tau"] = evals[-1].get("decode_tau") if evals else None
            t["decode_tau_step"] = evals[-1].get("step") if evals else None
            t["acc"] = mean_acc(last.get("acc"))
            t["age_s"] = now - last["time"] if _isnum(last.get("time")) else None
            # the training's ETA (steps left x step time, consumer/campaign.py eta_s), as of now
            t["eta_now_s"] = max(0.0, t["eta_s"] - (t["age_s"] or 0.0)) if _isnum(t.get("eta_s")) else None
            return t
    return None


def _last_checkpoint(metrics: dict[str, list[dict[str, Any]]], now: float) -> dict[str, Any] | None:
    ckpts = [
        {**r, "rank": stem.partition("-")[2]}
        for stem, recs in metrics.items()
        if stem.startswith("consumer-")
        for r in recs
        if r.get("event") == "checkpoint"
    ]
    if not ckpts:
        return None
    c = max(ckpts, key=lambda r: (r.get("step") or 0, r.get("time") or 0))
    c["age_s"] = now - c["time"] if _isnum(c.get("time")) else None
    return c


def collect(
    run_dir: str | Path,
    *,
    spool_dir: str | Path | None = None,
    stale_s: float = 120.0,
    now: float | None = None,
) -> dict[str, Any]:
    """Everything ``dflash-status`` shows, as one JSON-able dict (the ``--json`` output)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise StatusError(f"run dir {run_dir} does not exist or is not a directory")
    if not any((run_dir / n).exists() for n in ("run.json", "metrics", "logs", "pids")):
        raise StatusError(f"{run_dir} is not a run dir (no run.json, metrics/, logs/ or pids)")
    now = time.time() if now is None else now
    spool_root = find_spool_dir(run_dir, spool_dir)
    spool = spool_snapshot(spool_root, heartbeat_timeout_s=stale_s) if spool_root else None
    metrics = read_run_metrics(run_dir / "metrics")
    procs, older, older_consumers = _process_rows(metrics, spool, read_pids(run_dir), now=now, stale_s=stale_s)
    prod_tok_s, cons_tok_s = _total_rate(procs, "producer"), _total_rate(procs, "consumer")
    bottleneck = None
    if prod_tok_s > 0 and cons_tok_s > 0:
        bottleneck = "producers" if prod_tok_s < cons_tok_s else "consumers"
    logs_dir = run_dir / "logs"
    return {
        "run_dir": str(run_dir),
        "run": read_run_json(run_dir),
        "time": now,
        "processes": procs,
        "older_producers": older,
        "older_consumers": older_consumers,
        "run_state": _run_state(procs),
        "spool": spool,
        "training": _training(procs, metrics, now),
        "rates": {"producer_tok_s": prod_tok_s, "consumer_tok_s": cons_tok_s, "bottleneck": bottleneck},
        "progress": _progress(procs, metrics),
        "checkpoint": _last_checkpoint(metrics, now),
        "logs": [str(p) for p in sorted(logs_dir.glob("*.log"))] if logs_dir.is_dir() else [],
        "metrics_files": [str(run_dir / "metrics" / f"{s}.jsonl") for s in metrics],
    }


# ---- rendering ---------------------------------------------------------------------------------------


# ---- CLI ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class StatusConfig:
    """What ``dflash-status`` shows, and how often (the single source of its flags)."""

    run_dir: str = field(metadata=flag(positional=True))
    """the run directory (logs/, metrics/, run.json)"""
    spool: str | None = None
    """spool directory (default: run.json 'spool')"""
    watch: float | None = field(default=None, metadata=flag(nargs="?", const=5.0, metavar="SECS"))
    """refresh every SECS seconds (5 when SECS is left out) until Ctrl-C (default: print once)"""
    json: bool = False
    """print the snapshot as JSON"""
    plots: bool = False
    """write PNG plots into RUN_DIR/plots/ and list them"""
    stale_s: float = 120.0
    """seconds: a process whose last heartbeat/metrics line is older than this is not counted as running"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="One screen on a live or finished dflash run: processes, spool, training, rates, ETA.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_flags(p, StatusConfig)
    return p


def _show(args: StatusConfig, *, clear: bool) -> None:
    snap = collect(args.run_dir, spool_dir=args.spool, stale_s=args.stale_s)
    text = json.dumps(snap, indent=2, default=str) if args.json else render(snap)
    if clear:
        sys.stdout.write("\x1b[2J\x1b[H")
    print(text, flush=True)


def main(argv: list[str] | None = None) -> None:
    args = from_args(StatusConfig, _parser().parse_intermixed_args(argv))
    if args.watch is not None and args.watch <= 0:
        fail(PROG, "--watch SECS must be > 0")
    try:
        if args.plots:
            from dflash.tools.plots import write_plots  # matplotlib only when asked

            collect(args.run_dir, spool_dir=args.spool)  # validates RUN_DIR with the same errors
            paths = write_plots(args.run_dir)
            print("\n".join(map(str, paths)) if paths else f"{PROG}: no metrics to plot yet")
            return
        if args.watch is None:
            _show(args, clear=False)
            return
        while True:
            _show(args, clear=not args.json)
            time.sleep(args.watch)
    except StatusError as e:
        fail(PROG, e)
    except KeyboardInterrupt:
        return


if __name__ == "__main__":
    main()
