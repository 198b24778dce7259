"""``dflash-status``'s one screen: a ``collect`` snapshot (cli.py) as text, section by section."""

from __future__ import annotations

import time
from typing import Any

from dflash.common.contract.spool_scan import SpoolScan
from dflash.common.metrics import format_bytes, format_duration, format_rate, is_number

STATES = SpoolScan.STATES  # ("tmp", "ready", "claimed", "quarantine")
ETA_UNKNOWN = "ETA unknown: producers have not reported their dataset size yet"


def _fmt(x: Any, spec: str) -> str:
    return format(x, spec) if is_number(x) else "-"


def _processes(snap: dict[str, Any]) -> list[str]:
    out = [f"{'role':<9} {'id':<8} {'pid':>8} {'state':<7} {'hb age':>6} {'samples':>10} {'tok/s':>8}"]
    for p in snap["processes"]:
        out.append(
            f"{p['role']:<9} {p['id'] or '-':<8} {p['pid'] or '-':>8} {p['state']:<7} "
            f"{format_duration(p['age_s']) if p['age_s'] is not None else '-':>6} "
            f"{_fmt(p.get('samples'), 'd'):>10} {format_rate(p['tok_s']) if p.get('tok_s') is not None else '-':>8}"
        )
    if not snap["processes"]:
        out.append("(no processes seen yet)")
    else:
        over = snap.get("run_state") in ("finished", "stopped", "failed")
        out.append(
            "tok/s: producers' average since they started, consumers' "
            + ("average over their last launch" if over else "last logging interval")
        )
    if snap.get("older_producers"):
        old = snap["older_producers"]
        out.append(f"earlier launches: {len(old)} producer(s) not shown ({', '.join(old)})")
    if snap.get("older_consumers"):
        old = snap["older_consumers"]
        out.append(f"earlier launches: {len(old)} consumer rank(s) not shown ({', '.join(old)})")
    return out


RUN_STATES = {
    "running": "running",
    "finished": "finished (every process finished)",
    "stopped": "stopped (a process was stopped; the same command continues the run)",
    "failed": "failed (a process failed or died: its log says why; the same command continues the run)",
    "stale": "no news (no process is known to run; none said it ended)",
}


def _spool(spool: dict[str, Any] | None, run_state: str | None = None) -> list[str]:
    if spool is None:
        return ["spool: unknown (no run.json 'spool' and no --spool)"]
    if not spool["exists"] and run_state in ("finished", "stopped", "failed"):
        return [f"spool: {spool['root']} removed (the run is over; run_all.sh removes or frees it)"]
    if not spool["exists"]:
        return [f"spool: {spool['root']} (unreadable: {spool['error']})"]
    st = spool["states"]
    out = [
        f"spool: {spool['root']}  "
        + "  ".join(f"{s}={st[s]['shards']}/{format_bytes(st[s]['bytes'])}" for s in STATES)
    ]
    if spool["buckets"]:
        ready = " ".join(
            f"{b}:{c.get('ready', 0)}" for b, c in sorted(spool["buckets"].items(), key=lambda x: int(x[0]))
        )
        out.append("  ready by bucket: " + ready)
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
        out.append(f"  producers done: {len(set(spool['producers_done']) & set(map(str, reg)))}/{len(reg)}")
    return out


def _consumers(snap: dict[str, Any]) -> list[str]:
    """What the consumers report beyond the process table: how full their packed streams are (the share
    of context slots holding real tokens, from the latest step) and the samples lost to quarantine."""
    t, spool = snap["training"], snap["spool"]
    parts = []
    if t and is_number(t.get("fill")):
        parts.append(f"stream fill {100 * t['fill']:.0f}% (context slots holding tokens)")
    if spool and spool["exists"]:
        parts.append(
            f"lost to quarantine: {spool.get('samples_quarantined') or 0} samples "
            f"in {spool.get('shards_quarantined') or 0} shard(s)"
        )
    return ["consumers: " + "  ".join(parts)] if parts else []


def _training(t: dict[str, Any] | None) -> list[str]:
    if not t:
        return []
    step = f"{t['step']}/{t['total_steps']}" if t.get("total_steps") else f"{t['step']}"
    epoch = f" epoch={t['epoch']}/{t['epochs']}" if t.get("epoch") and t.get("epochs") else ""
    out = [
        f"training (rank {t['rank']}): step={step}{epoch} loss={_fmt(t['loss'], '.3g')} "
        f"acc={_fmt(t['acc'], '.2f')} τ={_fmt(t['tau'], '.2f')} lr={_fmt(t['lr'], '.1e')}  "
        f"({format_duration(t['age_s'])} ago)"
    ]
    if t.get("decode_tau") is not None:
        out.append(
            f"  held-out τ (decode order, what serving sees) {t['decode_tau']:.2f} at step "
            f"{t['decode_tau_step']}; in-loop τ above is over uniform anchors (higher)"
        )
    return out


def _progress(snap: dict[str, Any]) -> list[str]:
    r, pr, spool = snap["rates"], snap["progress"], snap["spool"]
    what = "rates over the run" if r.get("over_the_run") else "rates"
    line = f"{what}: prod={format_rate(r['producer_tok_s'])} tok/s (average)  cons={format_rate(r['consumer_tok_s'])} tok/s"
    if r["bottleneck"]:
        line += f"  (bottleneck: {r['bottleneck']})"
    out = [line]
    if r.get("producer_unthrottled_tok_s") is not None:  # throttled: the spool was full
        out.append(
            f"  producers waited on the spool budget {100 * r['producer_throttled']:.0f}% of the time "
            f"(throttled by the consumers); unthrottled ~{format_rate(r['producer_unthrottled_tok_s'])} tok/s"
        )
    state, t = snap.get("run_state"), snap.get("training") or {}
    if state in ("finished", "stopped", "failed"):
        done = f"{pr['samples']}/{pr['planned_samples']} samples produced; " if pr else ""
        return [*out, f"progress: {done}the run {state}" + (f" at step {t['step']}" if t.get("step") else "")]
    if (
        t.get("eta_now_s") is not None
    ):  # the run ends when training does: the training's ETA, not production's
        produced = f"{pr['samples']}/{pr['planned_samples']} samples produced; " if pr else ""
        return [
            *out,
            f"progress: {produced}step {t['step']}/{t['total_steps']}  ETA {format_duration(t['eta_now_s'])} (training)",
        ]
    if not pr:
        return [*out, f"progress: {ETA_UNKNOWN}"]
    pct = f" ({100 * pr['fraction']:.1f}%)" if pr["fraction"] is not None else ""
    eta = format_duration(pr["eta_s"]) if pr["eta_s"] is not None else "unknown (no producer running)"
    if pr["eta_s"] == 0 and spool and spool["exists"]:
        left = spool["states"]["ready"]["shards"] + spool["states"]["claimed"]["shards"]
        eta = f"0s (producers finished; consumers draining {left} shard(s))" if left else "0s (done)"
    return [*out, f"progress: {pr['samples']}/{pr['planned_samples']} samples{pct}  ETA {eta}"]


def _checkpoint(c: dict[str, Any] | None) -> list[str]:
    if not c:
        return ["checkpoint: none yet"]
    age = f" ({format_duration(c['age_s'])} ago)" if c.get("age_s") is not None else ""
    return [f"checkpoint: step={c.get('step')} {c.get('url', '')}{age}"]


def render(snap: dict[str, Any]) -> str:
    """The one-screen text view of a ``collect`` snapshot."""
    out = [f"dflash-status  {snap['run_dir']}  {time.strftime('%H:%M:%S', time.localtime(snap['time']))}"]
    if snap.get("run_state"):
        out.append(f"run: {RUN_STATES[snap['run_state']]}")
    out.append("")
    out += _processes(snap)
    out.append("")
    out += _spool(snap["spool"], snap.get("run_state")) + _consumers(snap) + _training(snap["training"])
    out += _progress(snap) + _checkpoint(snap["checkpoint"])
    out += ["", f"run dir: {snap['run_dir']}", *(f"  log: {f}" for f in snap["logs"])]
    return "\n".join(out)
