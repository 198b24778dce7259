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
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.common.cli.exits import fail
from dflash.common.cli.flags import add_flags, flag, from_args
from dflash.common.cli.help import DefaultsHelpFormatter
from dflash.common.metrics import (
    is_number,
    mean_acc,
    read_run_metrics,
)
from dflash.tools.plan.rates import THROTTLED_SHARE, producer_rate
from dflash.tools.status.processes import ENDS, OVER, RUNNING, process_rows
from dflash.tools.status.render import render
from dflash.tools.status.sources import (
    StatusError,
    find_spool_dir,
    read_pids,
    read_run_json,
    spool_snapshot,
)

log = logging.getLogger(__name__)
PROG = "dflash-status"

TRAINING_FIELDS = (
    "step",
    "loss",
    "tau",
    "lr",
    "grad_norm",
    "fill",
    "total_steps",
    "epoch",
    "epochs",
    "eta_s",
)
ETA_WINDOW_S = 300.0  # producer sample rate = slope of `samples` over this trailing window of metrics


def _sample_rate(recs: list[dict[str, Any]], row: dict[str, Any]) -> float | None:
    """Samples/s of one producer: slope of ``samples`` over the trailing window of its metrics, else
    ``tok_s * samples / tokens`` from its latest counters."""
    pts = [
        (r["time"], r["samples"]) for r in recs if is_number(r.get("time")) and is_number(r.get("samples"))
    ]
    if len(pts) >= 2:
        t_end = pts[-1][0]
        win = [p for p in pts if p[0] >= t_end - ETA_WINDOW_S]
        if len(win) < 2:
            win = pts[-2:]
        dt = win[-1][0] - win[0][0]
        if dt > 0:
            return max(0.0, (win[-1][1] - win[0][1]) / dt)
    tok_s, samples, tokens = row.get("tok_s"), row.get("samples"), row.get("tokens")
    if is_number(tok_s) and is_number(samples) and is_number(tokens) and tokens > 0:
        return tok_s * samples / tokens
    return None


def _run_state(procs: list[dict[str, Any]]) -> str | None:
    """The run's state from its processes': running while any runs; else failed if any failed, stopped if
    any stopped, finished when every process finished; stale when nothing is known to run or to be over."""
    states = {p["state"] for p in procs}
    if not states:
        return None
    if states & set(RUNNING):
        return "running"
    if "stale" in states:  # one may still run (its pid lives, its news is old): the run is not over
        return "stale"
    for verdict in ("failed", "stopped"):
        if verdict in states:
            return verdict
    return "finished"


def _life_rate(recs: list[dict[str, Any]]) -> float | None:
    """A consumer rank's tokens/s over its last life (the steps after its last end event that has steps
    after it): the intervals' summed tokens over their summed seconds (``interval_tokens``,
    ``interval_s``), else the mean of their ``tok_s``. Its last interval alone (a short tail, an eval, a
    checkpoint) is no measure of what it sustained: 303 tok/s against 861 over the run."""
    lives: list[list[dict[str, Any]]] = [[]]
    for r in recs:
        if r.get("event") in ENDS:
            lives.append([])
        elif "event" not in r:
            lives[-1].append(r)
    steps = next((life for life in reversed(lives) if life), [])
    timed = [r for r in steps if is_number(r.get("interval_tokens")) and is_number(r.get("interval_s"))]
    seconds = sum(r["interval_s"] for r in timed)
    if timed and seconds > 0:
        return sum(r["interval_tokens"] for r in timed) / seconds
    rates = [r["tok_s"] for r in steps if is_number(r.get("tok_s"))]
    return statistics.fmean(rates) if rates else None


def over_the_run(procs: list[dict[str, Any]], metrics: dict[str, list[dict[str, Any]]]) -> None:
    """A run that is over: each consumer row's rate becomes its rate over its last life (the producers'
    rows already carry theirs since they started), its last interval's kept as ``last_tok_s``; the totals
    and the bottleneck are then run averages on both sides."""
    for p in procs:
        if p["role"] == "consumer" and (rate := _life_rate(metrics.get(f"consumer-{p['id']}", []))):
            p["last_tok_s"], p["tok_s"] = p.get("tok_s"), rate


def _total_rate(procs: list[dict[str, Any]], role: str, *, over: bool) -> float:
    """The role's summed rate: its running processes' (the producers' average since they started, the
    consumers' last interval), or, once the run is ``over``, every process's as its row shows it (the
    run's averages, ``over_the_run``: not 0 because nothing runs any more, nor a last interval)."""
    rows = [p for p in procs if p["role"] == role and is_number(p.get("tok_s"))]
    counted = rows if over else [p for p in rows if p["active"]]
    # A consumer that reports world_size > 1 logs the all-reduced rate of its whole DDP group:
    # count it once (the lowest rank's), never once per rank.
    group = [p for p in counted if role == "consumer" and (p.get("world_size") or 1) > 1]
    return group[0]["tok_s"] if group else sum(p["tok_s"] for p in counted)


def _rates(
    procs: list[dict[str, Any]], metrics: dict[str, list[dict[str, Any]]], run_state: str | None
) -> dict:
    """Each side's rate and the bottleneck. A producer that waits on the spool budget is throttled by the
    consumers (blocked now, or blocked ``THROTTLED_SHARE`` of its time: ``budget_blocked_s`` in its
    metrics, read as dflash-plan reads them): its rate is then not what it makes, and the bottleneck is
    the consumers whatever the two figures say."""
    over = run_state in OVER
    prod, cons = _total_rate(procs, "producer", over=over), _total_rate(procs, "consumer", over=over)
    producers = [p for p in procs if p["role"] == "producer"]
    shares, unthrottled = [], 0.0
    for p in producers:
        rate, share = producer_rate(metrics.get(f"producer-{p['id']}", []))
        if share is not None:
            shares.append(share)
        unthrottled += rate or 0.0
    share = statistics.fmean(shares) if shares else None
    throttled = (share or 0.0) >= THROTTLED_SHARE
    blocked = throttled or any(p["state"] == "blocked" for p in producers)
    bottleneck = None
    if prod > 0 and cons > 0:
        bottleneck = "consumers" if blocked or prod >= cons else "producers"
    return {
        "producer_tok_s": prod,
        "consumer_tok_s": cons,
        "bottleneck": bottleneck,
        "producer_throttled": share,
        "producer_unthrottled_tok_s": unthrottled if throttled else None,
        "over_the_run": over,
    }


def _planned(p: dict[str, Any]) -> int | None:
    """A producer's planned sample count: its ``total`` counter (the samples of its slice still to
    produce this launch, drops included), once it has tokenized its slice; None before that."""
    if p.get("phase") == "tokenize" or not is_number(p.get("total")):
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
                **{k: last.get(k) for k in TRAINING_FIELDS},
            }
            evals = [r for r in metrics.get(f"consumer-{c['id']}", []) if r.get("event") == "eval"]
            t["decode_tau"] = evals[-1].get("decode_tau") if evals else None
            t["decode_tau_step"] = evals[-1].get("step") if evals else None
            t["acc"] = mean_acc(last.get("acc"))
            t["age_s"] = now - last["time"] if is_number(last.get("time")) else None
            # the training's ETA (steps left x step time, consumer/campaign.py eta_s), as of now
            t["eta_now_s"] = max(0.0, t["eta_s"] - (t["age_s"] or 0.0)) if is_number(t.get("eta_s")) else None
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
    c["age_s"] = now - c["time"] if is_number(c.get("time")) else None
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
    procs, older, older_consumers = process_rows(metrics, spool, read_pids(run_dir), now=now, stale_s=stale_s)
    run_state = _run_state(procs)
    if run_state in OVER:
        over_the_run(procs, metrics)
    logs_dir = run_dir / "logs"
    return {
        "run_dir": str(run_dir),
        "run": read_run_json(run_dir),
        "time": now,
        "processes": procs,
        "older_producers": older,
        "older_consumers": older_consumers,
        "run_state": run_state,
        "spool": spool,
        "training": _training(procs, metrics, now),
        "rates": _rates(procs, metrics, run_state),
        "progress": _progress(procs, metrics),
        "checkpoint": _last_checkpoint(metrics, now),
        "logs": [str(p) for p in sorted(logs_dir.glob("*.log"))] if logs_dir.is_dir() else [],
        "metrics_files": [str(run_dir / "metrics" / f"{s}.jsonl") for s in metrics],
    }


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
