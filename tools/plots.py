"""PNG plots of a run from its metrics JSONL: loss and τ over steps, throughput over time.

Uses matplotlib's object API (``Figure`` + Agg canvas) rather than pyplot: no global figure state, no
backend switching, no display needed, safe to call from a training process that also imported pyplot.
"""

from __future__ import annotations

import bisect
import logging
import os
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dflash.common.metrics import average_tok_s, is_number, mean_acc, read_run_metrics

log = logging.getLogger(__name__)

MAX_LABELLED_RANKS = 8  # more consumer ranks than this: draw them all, label none (the legend would be noise)


def _steps(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in recs if "event" not in r]


def _series(recs: list[dict[str, Any]], xkey: str, ykey: str) -> tuple[list[float], list[float]]:
    pts = [(r[xkey], r[ykey]) for r in _steps(recs) if is_number(r.get(xkey)) and is_number(r.get(ykey))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _rate_points(recs: list[dict[str, Any]], *, average: bool) -> list[tuple[float, float]]:
    """(time, tokens/s) of one process: its logged ``tok_s``, or with ``average`` its rate averaged since
    it started (metrics_log.average_tok_s: the producers' heartbeat ``tok_s`` is instantaneous)."""
    if not average:
        return list(zip(*_series(recs, "time", "tok_s"), strict=True))
    return [
        (r["time"], a)
        for r in _steps(recs)
        if is_number(r.get("time")) and (a := average_tok_s(r)) is not None
    ]


def _summed_rate(
    procs: list[list[dict[str, Any]]], *, average: bool = False
) -> tuple[list[float], list[float]]:
    """Sum of several processes' rates over time: each process holds its last logged value between its
    first and last record (a process that finished or has not started contributes 0)."""
    series = []
    for recs in procs:
        # time order, not log order: a resumed process may append records after a clock step
        pts = sorted(_rate_points(recs, average=average))
        if pts:
            series.append(([t for t, _ in pts], [y for _, y in pts]))
    grid = sorted({t for ts, _ in series for t in ts})
    total = []
    for t in grid:
        v = 0.0
        for ts, ys in series:
            if ts[0] <= t <= ts[-1]:
                v += ys[bisect.bisect_right(ts, t) - 1]  # last sample at or before t
        total.append(v)
    return grid, total


def _save(fig: Any, path: Path) -> Path:
    """Write via a temp name + rename so a reader (a browser, `--watch`) never sees a half-written PNG."""
    FigureCanvasAgg(fig)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)
    return path


def _per_rank_plot(
    consumers: dict[str, list[dict[str, Any]]],
    ykey: str,
    ylabel: str,
    title: str,
    path: Path,
    *,
    events: tuple[str, str, str] | None = None,
):
    """One line per rank of ``ykey`` over steps; ``events`` = (event name, key, label) adds those events'
    points (e.g. the held-out decode-order τ next to the in-loop τ)."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    drawn = False
    label = len(consumers) <= MAX_LABELLED_RANKS or events is not None
    for rank, recs in consumers.items():
        xs, ys = _series(recs, "step", ykey)
        if xs:
            ax.plot(
                xs,
                ys,
                lw=1.2,
                label=f"rank {rank} (in-loop)" if events else f"rank {rank}" if label else None,
            )
            drawn = True
    if events is not None:
        name, key, what = events
        pts = [
            (r["step"], r[key])
            for recs in consumers.values()
            for r in recs
            if r.get("event") == name and is_number(r.get(key)) and is_number(r.get("step"))
        ]
        if pts:
            ax.plot(*zip(*sorted(pts), strict=True), "o-", lw=1.6, label=what)
            drawn = True
    if not drawn:
        return None
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if label:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def _throughput_plot(metrics: dict, producers: list, consumers: dict, path: Path) -> Path | None:
    """Producers' and consumers' summed token rates over the run (None when there is nothing to draw)."""
    all_times = [r["time"] for recs in metrics.values() for r in _steps(recs) if is_number(r.get("time"))]
    if not all_times:
        return None
    t0 = min(all_times)
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    drawn = False
    for label, procs, average in (
        ("producers (sum of averages since start)", producers, True),
        ("consumers (sum)", list(consumers.values()), False),
    ):
        ts, ys = _summed_rate(procs, average=average)
        if ts:
            ax.step([(t - t0) / 60 for t in ts], [y / 1e3 for y in ys], where="post", label=label)
            drawn = True
    if not drawn:
        return None
    ax.set_xlabel("minutes since start")
    ax.set_ylabel("K tokens/s")
    ax.set_title("throughput")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def _accuracy_plot(records: list, path: Path) -> Path | None:
    """Per-position accuracy of the latest step that logged it: the trainer's ``acc_per_pos``, or ``acc``
    when it is logged as a list (None when no step did)."""
    last_acc = next(
        (
            a
            for r in reversed(_steps(records))
            for a in (r.get("acc_per_pos"), r.get("acc"))
            if isinstance(a, list)
        ),
        None,
    )
    if not last_acc or mean_acc(last_acc) is None:
        return None
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    pos = list(range(len(last_acc)))  # 0 = the anchor token (no loss), 1.. = draft positions
    ax.bar(pos, [a if is_number(a) else 0.0 for a in last_acc])
    ax.set_xlabel("position in block")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("per-position accuracy (latest step, lowest rank)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return _save(fig, path)


def write_plots(run_dir: str | Path) -> list[Path]:
    """Write ``loss.png``, ``tau.png``, ``throughput.png`` and ``acc_by_position.png`` (each only when its
    data exists) into ``run_dir/plots/``; returns the paths written."""
    run_dir = Path(run_dir)
    metrics = read_run_metrics(run_dir / "metrics")
    consumers = {s.partition("-")[2]: r for s, r in metrics.items() if s.startswith("consumer-")}
    producers = [r for s, r in metrics.items() if s.startswith("producer-")]
    consumers = dict(
        sorted(
            consumers.items(),
            key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0, kv[0]),
        )
    )
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    for ykey, ylabel, title, name, events in (
        ("loss", "loss", "training loss", "loss.png", None),
        (
            "tau",
            "τ (acceptance length)",
            "acceptance length τ",
            "tau.png",
            ("eval", "decode_tau", "held-out, decode order (what serving sees)"),
        ),
    ):
        p = _per_rank_plot(consumers, ykey, ylabel, title, out_dir / name, events=events)
        if p:
            written.append(p)

    throughput = _throughput_plot(metrics, producers, consumers, out_dir / "throughput.png")
    accuracy = _accuracy_plot(next(iter(consumers.values()), []), out_dir / "acc_by_position.png")
    written += [p for p in (throughput, accuracy) if p is not None]
    return written
