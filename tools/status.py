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
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

from dflash.common.cli.help import DefaultsHelpFormatter
from dflash.common.contract.liveness import HOST, heartbeat_alive
from dflash.common.contract.spool import Spool, SpoolError
from dflash.common.metrics import (
    average_tok_s,
    format_bytes,
    format_duration,
    format_rate,
    mean_acc,
    read_run_metrics,
)

log = logging.getLogger(__name__)

STATES = Spool.STATES  # ("tmp", "ready", "claimed", "quarantine")
_COUNTERS = (
    "samples", "tokens", "tok_s", "avg_tok_s", "elapsed_s", "total", "dropped", "phase", "step", "world_size",
    "shards_quarantined", "samples_quarantined",
)  # fmt: skip
ROLES = ("producer", "consumer")  # processes; other metrics files (ledger-r<rank>: trained samples) are not
# The trainer names its consumer id r<rank>-<pid> (unique per incarnation); its metrics file is per rank.
_CONSUMER_ID_RE = re.compile(r"^r(\d+)-\d+$")
ETA_UNKNOWN = "ETA unknown: producers have not reported their dataset size yet"
ETA_WINDOW_S = 300.0  # producer sample rate = slope of `samples` over this trailing window of metrics


class StatusError(ValueError):
    """A user error (bad run dir, unreadable run.json): printed as one line, exit status 2."""


# ---- spool -------------------------------------------------------------------------------------------


def spool_stats(root: str | Path, *, heartbeat_timeout_s: float = 120.0) -> dict[str, Any]:
    """``Spool.stats()`` reshaped for this screen, without creating anything (``create=False``).

    ``{"root", "exists", "error", "states": {state: {"shards", "bytes"}}, "buckets": {bucket: {state:
    shards}}, "claimed_by": {consumer_id: shards}, "producers_registered", "producers_done", "processes":
    [heartbeat rows of Spool.stats()]}``; ``exists`` False (and ``error`` set) for a missing or foreign dir.
    """
    out: dict[str, Any] = {
        "root": str(root),
        "exists": False,
        "error": None,
        "states": {s: {"shards": 0, "bytes": 0} for s in STATES},
        "buckets": {},
        "claimed_by": {},
        "producers_registered": [],
        "producers_done": [],
        "processes": [],
    }
    try:
        sp = Spool(root, create=False)
        st = sp.stats(heartbeat_timeout_s=heartbeat_timeout_s)
        pid_alive = {(str(hb["role"]), str(hb["id"])): _heartbeat_pid_alive(hb) for hb in sp.heartbeats()}
    except (SpoolError, OSError) as e:  # missing, not a spool, or removed mid-scan (run cleaned up)
        out["error"] = str(e)
        return out
    out["exists"] = True
    for state in STATES:
        row = st["states"].get(state, {"shards": 0, "bytes": 0, "buckets": {}})
        out["states"][state] = {"shards": row["shards"], "bytes": row["bytes"]}
        for bucket, b in row["buckets"].items():
            if bucket != "other" and b["shards"]:
                counts = out["buckets"].setdefault(str(bucket), {})
                counts[state] = b["shards"]
    out["buckets"] = dict(sorted(out["buckets"].items(), key=lambda kv: int(kv[0])))
    out["claimed_by"] = {c: v["shards"] for c, v in sorted(st["claimed_by"].items())}
    out["producers_registered"] = [str(p) for p in st["producers"]["registered"]]
    out["producers_done"] = sorted(str(p) for p in st["producers"]["done"])
    for hb in st["processes"]:
        key = (str(hb["role"]), str(hb["id"]))
        out["processes"].append({**hb, "time": st["time"] - hb["age_s"], "pid_alive": pid_alive.get(key)})
    # samples lost to quarantine in this launch, as the consumers counted them (corrupt shards)
    for k in ("samples_quarantined", "shards_quarantined"):
        out[k] = sum(
            int(hb.get("counters", {}).get(k) or 0) for hb in st["processes"] if hb.get("role") == "consumer"
        )
    return out


def _heartbeat_pid_alive(hb: dict[str, Any]) -> bool | None:
    """Whether the heartbeat's process still runs, whatever the heartbeat's age: True/False on this host
    (pid and start time, as the spool checks them), None for another host's process (cannot tell)."""
    if hb.get("host") != HOST or "pid" not in hb:
        return None
    return heartbeat_alive(hb, timeout_s=float("inf"))


# ---- run directory -----------------------------------------------------------------------------------


def read_run_json(run_dir: Path) -> dict[str, Any]:
    f = run_dir / "run.json"
    if not f.exists():
        return {}
    try:
        data = json.loads(f.read_text())
    except ValueError as e:
        raise StatusError(f"{f} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise StatusError(f"{f} must hold a JSON object")
    return data


def find_spool_dir(run_dir: Path, override: str | Path | None = None) -> Path | None:
    """``--spool`` wins; else ``run.json["spool"]`` (a relative path is taken relative to the run dir);
    else None (status then shows metrics only)."""
    if override is not None:
        return Path(override)
    spool = read_run_json(run_dir).get("spool")
    return run_dir / spool if spool else None


def read_pids(run_dir: Path) -> dict[str, int]:
    """``RUN_DIR/pids``: one ``<name> <pid>`` per line (order of the two tokens does not matter)."""
    out: dict[str, int] = {}
    try:
        lines = (run_dir / "pids").read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        toks = line.replace("=", " ").replace(":", " ").split()
        nums = [t for t in toks if t.isdigit()]
        names = [t for t in toks if not t.isdigit()]
        if nums:
            out[names[0] if names else f"pid-{nums[0]}"] = int(nums[0])
    return out


def pid_alive(pid: int | None, host: str | None) -> bool | None:
    """True/False for a pid on this host; None when unknown (no pid, or another host's process)."""
    if not pid or (host and host != socket.gethostname()):
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def _isnum(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _rank_key(row: dict[str, Any]) -> tuple:
    i = str(row["id"])
    return (row["role"], 0 if i.isdigit() else 1, int(i) if i.isdigit() else 0, i)


def _current_producers(spool: dict[str, Any] | None) -> set[str] | None:
    """The producer ids of the current launch (state/producers.json), None when no launch registered any:
    producer ids carry their launch (n0p0.<launch>), so earlier launches' files are told apart by id."""
    reg = spool["producers_registered"] if spool and spool["exists"] else []
    return set(map(str, reg)) or None


def _process_rows(
    metrics: dict[str, list[dict[str, Any]]],
    spool: dict[str, Any] | None,
    pids: dict[str, int],
    *,
    now: float,
    stale_s: float,
) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per process of the current launch, merged from its metrics file, spool heartbeat and
    launcher pid (the counters of the newest source win), sorted by role, then numeric id; and the ids of
    earlier launches' producers, which are left out (their files stay in state/ and metrics/)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    sources: dict[tuple[str, str], list[tuple[float, dict[str, Any]]]] = {}
    verdict: dict[tuple[str, str], tuple[bool, bool | None]] = {}  # (heartbeat alive, pid alive)
    current = _current_producers(spool)
    older: set[str] = set()

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
        r["state"] = _state(
            r, verdict.get(key), done=r["role"] == "producer" and r["id"] in done, stale_s=stale_s
        )
        r["active"] = r["state"] in ("alive", "active")
        if r["role"] == "producer":
            r["tok_s"] = average_tok_s(r)  # the sustained rate, never the last heartbeat's
    return sorted(rows.values(), key=_rank_key), sorted(older)


def _state(r: dict[str, Any], verdict: tuple[bool, bool | None] | None, *, done: bool, stale_s: float) -> str:
    """done | alive | exited | stale (no news, process may still run) | active (fresh, liveness unknown)."""
    fresh = r["age_s"] is not None and r["age_s"] <= stale_s
    if done:
        return "done"
    if verdict is not None:  # the spool's verdict (pid, start time, heartbeat age), then the pid alone
        hb_alive, proc_alive = verdict
        if hb_alive:
            return "alive"
        return "exited" if proc_alive is False else "stale"
    alive = pid_alive(r["pid"], r["host"])  # no heartbeat: the launcher's pid, if any
    if alive is not None:
        return ("alive" if fresh else "stale") if alive else "exited"
    return "active" if fresh else "stale"


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
    spool = spool_stats(spool_root, heartbeat_timeout_s=stale_s) if spool_root else None
    metrics = read_run_metrics(run_dir / "metrics")
    procs, older = _process_rows(metrics, spool, read_pids(run_dir), now=now, stale_s=stale_s)
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
        "spool": spool,
        "training": _training(procs, metrics, now),
        "rates": {"producer_tok_s": prod_tok_s, "consumer_tok_s": cons_tok_s, "bottleneck": bottleneck},
        "progress": _progress(procs, metrics),
        "checkpoint": _last_checkpoint(metrics, now),
        "logs": [str(p) for p in sorted(logs_dir.glob("*.log"))] if logs_dir.is_dir() else [],
        "metrics_files": [str(run_dir / "metrics" / f"{s}.jsonl") for s in metrics],
    }


# ---- rendering ---------------------------------------------------------------------------------------


def _fmt(x: Any, spec: str) -> str:
    return format(x, spec) if _isnum(x) else "-"


def _consumer_lines(snap: dict[str, Any]) -> list[str]:
    """What the consumers report beyond the process table: how full their packed streams are (the share
    of context slots holding real tokens, from the latest step) and the samples lost to quarantine."""
    t, spool = snap["training"], snap["spool"]
    parts = []
    if t and _isnum(t.get("fill")):
        parts.append(f"stream fill {100 * t['fill']:.0f}% (context slots holding tokens)")
    if spool and spool["exists"]:
        parts.append(
            f"lost to quarantine: {spool.get('samples_quarantined') or 0} samples "
            f"in {spool.get('shards_quarantined') or 0} shard(s)"
        )
    return ["consumers: " + "  ".join(parts)] if parts else []


def render(snap: dict[str, Any]) -> str:
    """The one-screen text view of a ``collect`` snapshot."""
    out = [f"dflash-status  {snap['run_dir']}  {time.strftime('%H:%M:%S', time.localtime(snap['time']))}"]
    out.append("")
    out.append(f"{'role':<9} {'id':<8} {'pid':>8} {'state':<7} {'hb age':>6} {'samples':>10} {'tok/s':>8}")
    for p in snap["processes"]:
        out.append(
            f"{p['role']:<9} {p['id'] or '-':<8} {p['pid'] or '-':>8} {p['state']:<7} "
            f"{format_duration(p['age_s']) if p['age_s'] is not None else '-':>6} "
            f"{_fmt(p.get('samples'), 'd'):>10} {format_rate(p['tok_s']) if p.get('tok_s') is not None else '-':>8}"
        )
    if not snap["processes"]:
        out.append("(no processes seen yet)")
    else:
        out.append("tok/s: producers' average since they started, consumers' last logging interval")
    if snap.get("older_producers"):
        old = snap["older_producers"]
        out.append(f"earlier launches: {len(old)} producer(s) not shown ({', '.join(old)})")
    out.append("")
    spool = snap["spool"]
    if spool is None:
        out.append("spool: unknown (no run.json 'spool' and no --spool)")
    elif not spool["exists"]:
        out.append(f"spool: {spool['root']} (unreadable: {spool['error']})")
    else:
        st = spool["states"]
        out.append(
            f"spool: {spool['root']}  "
            + "  ".join(f"{s}={st[s]['shards']}/{format_bytes(st[s]['bytes'])}" for s in STATES)
        )
        if spool["buckets"]:
            out.append(
                "  ready by bucket: "
                + " ".join(
                    f"{b}:{c.get('ready', 0)}"
                    for b, c in sorted(spool["buckets"].items(), key=lambda x: int(x[0]))
                )
            )
        if spool["claimed_by"]:
            out.append("  claimed by: " + " ".join(f"{c}:{n}" for c, n in spool["claimed_by"].items()))
        if st["quarantine"]["shards"]:
            lost = spool.get("samples_quarantined") or 0
            out.append(
                f"  quarantined: {st['quarantine']['shards']} shards"
                + (f" ({lost} samples lost to this launch)" if lost else "")
                + ": not trained; the next launch of this run re-produces them (reasons: quarantine/*.why)"
            )
        reg = spool["producers_registered"]
        if reg:
            out.append(
                f"  producers done: {len(set(spool['producers_done']) & set(map(str, reg)))}/{len(reg)}"
            )
    out.extend(_consumer_lines(snap))
    t = snap["training"]
    if t:
        step = f"{t['step']}/{t['total_steps']}" if t.get("total_steps") else f"{t['step']}"
        epoch = f" epoch={t['epoch']}/{t['epochs']}" if t.get("epoch") and t.get("epochs") else ""
        out.append(
            f"training (rank {t['rank']}): step={step}{epoch} loss={_fmt(t['loss'], '.3g')} "
            f"acc={_fmt(t['acc'], '.2f')} τ={_fmt(t['tau'], '.2f')} lr={_fmt(t['lr'], '.1e')}  "
            f"({format_duration(t['age_s'])} ago)"
        )
        if t.get("decode_tau") is not None:
            out.append(
                f"  held-out τ (decode order, what serving sees) {t['decode_tau']:.2f} at step "
                f"{t['decode_tau_step']}; in-loop τ above is over uniform anchors (higher)"
            )
    r = snap["rates"]
    line = (
        f"rates: prod={format_rate(r['producer_tok_s'])} tok/s (average)  "
        f"cons={format_rate(r['consumer_tok_s'])} tok/s"
    )
    if r["bottleneck"]:
        line += f"  (bottleneck: {r['bottleneck']})"
    out.append(line)
    pr = snap["progress"]
    if pr:
        pct = f" ({100 * pr['fraction']:.1f}%)" if pr["fraction"] is not None else ""
        eta = format_duration(pr["eta_s"]) if pr["eta_s"] is not None else "unknown (no producer running)"
        if pr["eta_s"] == 0 and spool and spool["exists"]:
            left = spool["states"]["ready"]["shards"] + spool["states"]["claimed"]["shards"]
            eta = f"0s (producers finished; consumers draining {left} shard(s))" if left else "0s (done)"
        out.append(f"progress: {pr['samples']}/{pr['planned_samples']} samples{pct}  ETA {eta}")
    else:
        out.append(f"progress: {ETA_UNKNOWN}")
    c = snap["checkpoint"]
    if c:
        age = f" ({format_duration(c['age_s'])} ago)" if c.get("age_s") is not None else ""
        out.append(f"checkpoint: step={c.get('step')} {c.get('url', '')}{age}")
    else:
        out.append("checkpoint: none yet")
    out.append("")
    out.append(f"run dir: {snap['run_dir']}")
    for f in snap["logs"]:
        out.append(f"  log: {f}")
    return "\n".join(out)


# ---- CLI ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-status",
        description="One screen on a live or finished dflash run: processes, spool, training, rates, ETA.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("run_dir", help="the run directory (logs/, metrics/, run.json)")
    p.add_argument("--spool", default=None, help="spool directory (default: run.json 'spool')")
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=5.0,
        default=None,
        metavar="SECS",
        help="refresh every SECS seconds (5 when SECS is left out) until Ctrl-C (default: print once)",
    )
    p.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    p.add_argument("--plots", action="store_true", help="write PNG plots into RUN_DIR/plots/ and list them")
    p.add_argument(
        "--stale-s",
        type=float,
        default=120.0,
        help="seconds: a process whose last heartbeat/metrics line is older than this is not counted as running",
    )
    return p


def _show(args: argparse.Namespace, *, clear: bool) -> None:
    snap = collect(args.run_dir, spool_dir=args.spool, stale_s=args.stale_s)
    text = json.dumps(snap, indent=2, default=str) if args.json else render(snap)
    if clear:
        sys.stdout.write("\x1b[2J\x1b[H")
    print(text, flush=True)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.watch is not None and args.watch <= 0:
        _die("--watch SECS must be > 0")
    try:
        if args.plots:
            from dflash.tools.plots import write_plots  # matplotlib only when asked

            collect(args.run_dir, spool_dir=args.spool)  # validates RUN_DIR with the same errors
            paths = write_plots(args.run_dir)
            print("\n".join(map(str, paths)) if paths else "dflash-status: no metrics to plot yet")
            return
        if args.watch is None:
            _show(args, clear=False)
            return
        while True:
            _show(args, clear=not args.json)
            time.sleep(args.watch)
    except StatusError as e:
        _die(str(e))
    except KeyboardInterrupt:
        return


def _die(msg: str) -> None:
    print(f"dflash-status: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
