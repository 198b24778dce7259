"""dflash-plan: how many of a node's GPUs should produce hidden states and how many should train.

Model. A node has N GPUs sharing one spool: p producers and c = N - p consumers (p, c >= 1).
- Producers are independent: together they make ``p * P`` tok/s (P = one producer GPU's rate).
- Consumers are one DDP group across all nodes: ``c * C * eff(c * nodes)`` tok/s per node, where C is one
  consumer GPU's rate when training alone and ``eff(n) = e ** log2(n)``: every doubling of the group keeps
  a fraction e of per-GPU throughput (gradient all-reduce, stragglers). e defaults to 0.95; measure it by
  running the same config with 1 and 2+ consumers.
- The spool decouples the two sides, so the pipeline runs at the slower one:
  ``end_to_end = nodes * min(p * P, c * C * eff(c * nodes))``. The plan picks the p that maximizes it
  (ties: the one with more headroom on the other side, then fewer consumers).

Rates from a run dir: per process, the median ``tok_s`` of its metrics records after dropping the first
``warmup_frac`` of them (compile, cache warm-up); per GPU, the mean over processes. A consumer file whose
records carry ``world_size`` > 1 holds the all-reduced rate of the whole group (rank 0 logs for all):
it is divided by ``world_size``; without it, each ``consumer-<rank>.jsonl`` is one rank. A measured consumer
rank rate already includes ``eff(c0)`` of its c0-rank group, so it is divided by that to get C. In a
coupled run the faster side is throttled (producers by spool backpressure, consumers by an empty spool),
so its measured rate is only a lower bound — the tool says so when the two totals are close. Producers
say how long they waited on the spool's byte budget (``budget_wait_s``, ``main_wait_s`` in their metrics):
their rate is taken over the time they did not wait (tokens / unblocked seconds), and the plan names the
share of time they were throttled.

Rates from benchmarks (``--bench a.json,b.json``): the ``figures`` of ``ops/bench/pipeline_bench.py`` (per
target shape: one producer GPU's and one consumer GPU's rate alone, the producer's scaled to the shape's
full depth when the bench ran a slice) and ``ops/bench/producer_bench.py`` results (its shipped producer's
rate, at full depth); a later file overrides an earlier one's figure for the same shape. Every shape with
both rates gets its own plan: the split of a node and the predicted node tok/s (``nodes`` = 1: the node).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash.common.cli.exits import fail
from dflash.common.cli.flags import add_flags, flag, from_args
from dflash.common.cli.help import DefaultsHelpFormatter
from dflash.common.metrics import format_rate, read_run_metrics

log = logging.getLogger(__name__)

PROG = "dflash-plan"
DEFAULT_DDP_EFFICIENCY = 0.95
THROTTLE_NOTE_RATIO = 0.85  # measured totals closer than this: one side was probably throttled
THROTTLED_SHARE_NOTE = 0.05  # producers that waited on the spool budget this share of the time: said


def ddp_efficiency(num_consumers: int, per_doubling: float) -> float:
    """Fraction of per-GPU consumer throughput kept in a DDP group of ``num_consumers`` (1.0 for one)."""
    return per_doubling ** math.log2(num_consumers)


@dataclass(kw_only=True)
class PlanConfig:
    num_gpus: int = field(metadata=flag(name="--gpus"))
    """GPUs per node to split between producers and consumers (both sides need at least one)"""
    nodes: int = 1
    """identical nodes, each with its own spool (consumers form one DDP group)"""
    producer_tok_s: float = field(metadata=flag(required=False))
    """tokens/s of one producer GPU (on the command line, default: measured from RUN_DIR)"""
    consumer_tok_s: float = field(metadata=flag(required=False))
    """tokens/s of one consumer GPU training alone, no DDP loss (default: measured from RUN_DIR)"""
    ddp_efficiency: float = DEFAULT_DDP_EFFICIENCY
    """per-GPU consumer throughput kept per doubling of the DDP group, in (0, 1]"""

    def __post_init__(self) -> None:
        if self.num_gpus < 2:
            raise ValueError(f"num_gpus={self.num_gpus}: need at least 2 (one producer, one consumer)")
        for name in ("producer_tok_s", "consumer_tok_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name}={v}: must be a positive rate")
        if not 0 < self.ddp_efficiency <= 1:
            raise ValueError(f"ddp_efficiency={self.ddp_efficiency}: must be in (0, 1]")
        if self.nodes < 1:
            raise ValueError(f"nodes={self.nodes}: must be >= 1")


@dataclass(kw_only=True)
class Split:
    producers: int
    consumers: int
    producer_tok_s: float  # all nodes
    consumer_tok_s: float  # all nodes
    end_to_end_tok_s: float
    bottleneck: str  # "producers" | "consumers" | "balanced"


def plan_splits(cfg: PlanConfig) -> list[Split]:
    """Every split p + c = num_gpus (p = 1 .. N-1), in order of p."""
    out = []
    for p in range(1, cfg.num_gpus):
        c = cfg.num_gpus - p
        prod = cfg.nodes * p * cfg.producer_tok_s
        cons = cfg.nodes * c * cfg.consumer_tok_s * ddp_efficiency(c * cfg.nodes, cfg.ddp_efficiency)
        neck = (
            "balanced"
            if math.isclose(prod, cons, rel_tol=1e-9)
            else ("producers" if prod < cons else "consumers")
        )
        out.append(
            Split(
                producers=p,
                consumers=c,
                producer_tok_s=prod,
                consumer_tok_s=cons,
                end_to_end_tok_s=min(prod, cons),
                bottleneck=neck,
            )
        )
    return out


def best_split(splits: list[Split]) -> Split:
    """Max end-to-end; ties -> more headroom on the non-bottleneck side, then fewer consumers."""
    return max(
        splits, key=lambda s: (s.end_to_end_tok_s, max(s.producer_tok_s, s.consumer_tok_s), -s.consumers)
    )


# ---- measured rates ----------------------------------------------------------------------------------


def steady_rate(records: list[dict[str, Any]], *, warmup_frac: float = 0.25) -> float | None:
    """Median ``tok_s`` of one process after dropping the first ``warmup_frac`` of its records."""
    vals = [
        r["tok_s"]
        for r in records
        if "event" not in r
        and isinstance(r.get("tok_s"), int | float)
        and math.isfinite(r["tok_s"])
        and r["tok_s"] > 0
    ]
    if not vals:
        return None
    skip = min(len(vals) - 1, math.ceil(warmup_frac * len(vals)))
    return statistics.median(vals[skip:])


def _num(r: dict[str, Any], k: str) -> float | None:
    v = r.get(k)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def producer_rate(records: list[dict[str, Any]], *, warmup_frac: float = 0.25) -> tuple[float | None, float | None]:
    """(tok/s while not waiting on the spool budget, share of the time it waited) of one producer.

    Between two metrics records, the time its main loop waited on the writers (``main_wait_s``) counts as
    throttled when the writers waited on the budget meanwhile (``budget_wait_s`` grew); the rate is the
    tokens over the rest. Records without these counters: ``steady_rate`` and an unknown share (None)."""
    pts = [r for r in records if "event" not in r and _num(r, "tokens") is not None and _num(r, "elapsed_s") is not None]
    if len(pts) < 2 or not any(_num(r, "budget_wait_s") is not None for r in pts):
        return steady_rate(records, warmup_frac=warmup_frac), None
    pts = pts[min(len(pts) - 2, math.ceil(warmup_frac * len(pts))) :]
    busy = waited = tokens = 0.0
    for a, b in zip(pts, pts[1:], strict=False):
        dt = _num(b, "elapsed_s") - _num(a, "elapsed_s")
        if dt <= 0:
            continue
        blocked = 0.0
        if (_num(b, "budget_wait_s") or 0.0) > (_num(a, "budget_wait_s") or 0.0):
            blocked = min(dt, max(0.0, (_num(b, "main_wait_s") or 0.0) - (_num(a, "main_wait_s") or 0.0)))
        busy, waited, tokens = busy + dt - blocked, waited + blocked, tokens + _num(b, "tokens") - _num(a, "tokens")
    if busy <= 0 or tokens <= 0:
        return steady_rate(records, warmup_frac=warmup_frac), None
    return tokens / busy, waited / (busy + waited)


@dataclass(kw_only=True)
class MeasuredRates:
    producer_tok_s: float | None  # per producer GPU, while not waiting on the spool budget
    consumer_tok_s: float | None  # per consumer GPU, normalized to a 1-GPU group
    num_producers: int
    num_consumers: int
    producer_total_tok_s: float | None  # as measured, all processes (throttled time included)
    consumer_total_tok_s: float | None
    producer_throttled: float | None = None  # share of the producers' time spent waiting on the spool budget


def measure_rates(
    run_dir: str | Path,
    *,
    warmup_frac: float = 0.25,
    ddp_efficiency_per_doubling: float = DEFAULT_DDP_EFFICIENCY,
) -> MeasuredRates:
    """Per-GPU producer and consumer rates from ``run_dir/metrics/*.jsonl`` (see the module docstring)."""
    metrics = read_run_metrics(Path(run_dir) / "metrics")
    prod: list[float] = []  # per producer, unthrottled
    prod_measured: list[float] = []
    throttled: list[float] = []
    cons: list[float] = []  # per consumer GPU, as measured in a group of c0
    c0, cons_total = 0, 0.0
    for stem, recs in sorted(metrics.items()):
        role = stem.partition("-")[0]
        if role == "producer":
            rate, share = producer_rate(recs, warmup_frac=warmup_frac)
            if rate is not None:
                prod.append(rate)
                prod_measured.append(steady_rate(recs, warmup_frac=warmup_frac) or rate)
                if share is not None:
                    throttled.append(share)
            continue
        rate = steady_rate(recs, warmup_frac=warmup_frac) if role == "consumer" else None
        if rate is None:
            continue
        ws = next((r["world_size"] for r in reversed(recs) if isinstance(r.get("world_size"), int)), 1)
        if ws > 1:  # the all-reduced rate of the whole group: this one file stands for all ranks
            cons, c0, cons_total = [rate / ws], ws, rate
            break
        cons.append(rate)
        c0, cons_total = c0 + 1, cons_total + rate
    eff = ddp_efficiency(c0, ddp_efficiency_per_doubling) if c0 else 1.0
    return MeasuredRates(
        producer_tok_s=statistics.fmean(prod) if prod else None,
        consumer_tok_s=statistics.fmean(cons) / eff if cons else None,
        num_producers=len(prod),
        num_consumers=c0,
        producer_total_tok_s=sum(prod_measured) if prod else None,
        consumer_total_tok_s=cons_total if cons else None,
        producer_throttled=statistics.fmean(throttled) if throttled else None,
    )


# ---- rates from benchmark files ------------------------------------------------------------------------


def read_bench_figures(paths: list[str]) -> dict[str, dict[str, float]]:
    """{shape: {"producer_tok_s", "consumer_tok_s"}} per GPU from pipeline_bench / producer_bench JSON files
    (module docstring). Raises ValueError naming the file for anything else."""
    shapes: dict[str, dict[str, float]] = {}
    for path in paths:
        try:
            res = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--bench {path}: cannot read a benchmark JSON ({type(err).__name__}: {err})") from None
        found = False
        for fig in res.get("figures", []) if isinstance(res, dict) else []:  # pipeline_bench
            prod = fig.get("producer_tok_s_full_depth") or fig.get("producer_tok_s")
            rates = {k: float(v) for k, v in (("producer_tok_s", prod), ("consumer_tok_s", fig.get("consumer_tok_s"))) if v}
            shapes.setdefault(str(fig.get("shape")), {}).update(rates)
            found = found or bool(rates)
        full = (res.get("results") or {}).get("producer_full") if isinstance(res, dict) else None
        if full and full.get("tok_s"):  # producer_bench: its shipped producer, scaled to full depth
            shapes.setdefault(str(res.get("preset")), {})["producer_tok_s"] = float(full["tok_s"]) * float(res.get("depth_scale", 1))
            found = True
        if not found:
            raise ValueError(f"--bench {path}: no producer or consumer rate in it (not a pipeline_bench/producer_bench JSON)")
    return shapes


def plan_shapes(shapes: dict[str, dict[str, float]], base: PlanConfig) -> list[dict]:
    """One plan per shape (``base`` gives the GPUs, nodes and DDP efficiency); raises ValueError naming a
    shape that lacks a rate."""
    out = []
    for shape, rates in sorted(shapes.items()):
        missing = sorted({"producer_tok_s", "consumer_tok_s"} - set(rates))
        if missing:
            raise ValueError(f"shape {shape}: no {' or '.join(missing)} in the --bench files (run pipeline_bench's "
                             f"phases for it, or give --{missing[0].replace('_', '-')})")  # fmt: skip
        cfg = PlanConfig(num_gpus=base.num_gpus, nodes=base.nodes, ddp_efficiency=base.ddp_efficiency, **rates)
        best = best_split(plan_splits(cfg))
        out.append({"shape": shape, **rates, "best": asdict(best), "node_tok_s": best.end_to_end_tok_s / cfg.nodes})
    return out


def render_shapes(plans: list[dict], base: PlanConfig) -> str:
    lines = [f"{base.num_gpus} GPUs per node, DDP efficiency {base.ddp_efficiency:g} per doubling", "",
             f"  {'shape':<12} {'producer':>9} {'consumer':>9}  {'split (P+C)':<12} {'node tok/s':>10}  bottleneck"]  # fmt: skip
    for p in plans:
        b = p["best"]
        lines.append(f"  {p['shape']:<12} {format_rate(p['producer_tok_s']):>9} {format_rate(p['consumer_tok_s']):>9}  "
                     f"{b['producers']} + {b['consumers']:<8} {format_rate(p['node_tok_s']):>10}  {b['bottleneck']}")  # fmt: skip
    return "\n".join(lines)


# ---- CLI ---------------------------------------------------------------------------------------------


def render(cfg: PlanConfig, splits: list[Split], best: Split, measured: MeasuredRates | None) -> str:
    lines = []
    if measured is not None:
        lines.append(
            f"measured: {measured.num_producers} producer(s) {format_rate(measured.producer_total_tok_s)} tok/s, "
            f"{measured.num_consumers} consumer(s) {format_rate(measured.consumer_total_tok_s)} tok/s"
        )
        a, b = measured.producer_total_tok_s, measured.consumer_total_tok_s
        share = measured.producer_throttled
        if share is not None and share >= THROTTLED_SHARE_NOTE:
            lines.append(
                f"note: the producers waited on the spool budget {100 * share:.0f}% of the time (throttled: "
                f"{format_rate(a)} tok/s measured); their rate below is over the time they did not wait, "
                f"{format_rate(measured.producer_tok_s)} tok/s per GPU"
            )
        elif a and b and min(a, b) / max(a, b) >= THROTTLE_NOTE_RATIO:
            faster = "producer" if a > b else "consumer"
            lines.append(
                f"note: the measured totals are close: the {faster} side was probably throttled by the other "
                f"(spool backpressure / empty spool), so its rate is a lower bound; measure it alone to be sure"
            )
    lines.append(
        f"inputs: {cfg.num_gpus} GPUs/node x {cfg.nodes} node(s); per GPU: producer {format_rate(cfg.producer_tok_s)} "
        f"tok/s, consumer {format_rate(cfg.consumer_tok_s)} tok/s; DDP efficiency {cfg.ddp_efficiency:g} per doubling"
    )
    lines.append(
        f"best: {best.producers} producers + {best.consumers} consumers per node -> "
        f"{format_rate(best.end_to_end_tok_s)} tok/s end-to-end (bottleneck: {best.bottleneck})"
    )
    lines.append("")
    lines.append(
        f"  {'prod':>4} {'cons':>4} {'prod tok/s':>11} {'cons tok/s':>11} {'end-to-end':>11}  bottleneck"
    )
    for s in splits:
        mark = "*" if s is best else " "
        lines.append(
            f"{mark} {s.producers:>4} {s.consumers:>4} {format_rate(s.producer_tok_s):>11} "
            f"{format_rate(s.consumer_tok_s):>11} {format_rate(s.end_to_end_tok_s):>11}  {s.bottleneck}"
        )
    return "\n".join(lines)


@dataclass(kw_only=True)
class PlanInputs:
    """Where ``dflash-plan`` takes its rates from and how it prints the plan."""

    run_dir: str | None = field(default=None, metadata=flag(positional=True, nargs="?"))
    """a run dir whose metrics give the rates (flags override)"""
    warmup_frac: float = 0.25
    """fraction of each process's first metrics records skipped as warm-up"""
    json: bool = False
    """print the plan as JSON"""
    bench: str | None = None
    """pipeline_bench / producer_bench JSON files, comma-separated: a plan per target shape they measured"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Choose the producer/consumer GPU split from measured or given per-GPU rates.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_flags(p, PlanInputs)
    add_flags(p, PlanConfig, defaults={"producer_tok_s": None, "consumer_tok_s": None})
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_intermixed_args(argv)
    if args.bench:
        return _main_bench(args)
    try:
        measured = None
        prod, cons = args.producer_tok_s, args.consumer_tok_s
        if args.run_dir is not None:
            if not Path(args.run_dir).is_dir():
                raise ValueError(f"run dir {args.run_dir} does not exist")
            if not 0 <= args.warmup_frac < 1:
                raise ValueError(f"--warmup-frac={args.warmup_frac}: must be in [0, 1)")
            measured = measure_rates(
                args.run_dir, warmup_frac=args.warmup_frac, ddp_efficiency_per_doubling=args.ddp_efficiency
            )
            prod = prod if prod is not None else measured.producer_tok_s
            cons = cons if cons is not None else measured.consumer_tok_s
        missing = [f for f, v in (("--producer-tok-s", prod), ("--consumer-tok-s", cons)) if v is None]
        if missing:
            where = f"no such rates in {args.run_dir}/metrics; " if args.run_dir else ""
            raise ValueError(f"{where}give {' and '.join(missing)} (or a RUN_DIR with metrics)")
        cfg = from_args(PlanConfig, args, producer_tok_s=prod, consumer_tok_s=cons)
    except ValueError as e:
        fail(PROG, e)
    splits = plan_splits(cfg)
    best = best_split(splits)
    if args.json:
        print(
            json.dumps(
                {
                    "config": asdict(cfg),
                    "best": asdict(best),
                    "splits": [asdict(s) for s in splits],
                    "measured": asdict(measured) if measured else None,
                },
                indent=2,
            )
        )
    else:
        print(render(cfg, splits, best, measured))


def _main_bench(args) -> None:
    """``--bench``: a plan per shape from benchmark figures (flags --producer-tok-s/--consumer-tok-s, when
    given, apply to every shape)."""
    try:
        shapes = read_bench_figures([p for p in args.bench.split(",") if p.strip()])
        given = {k: v for k in ("producer_tok_s", "consumer_tok_s") if (v := getattr(args, k)) is not None}
        for rates in shapes.values():
            rates.update(given)
        base = from_args(PlanConfig, args, producer_tok_s=1.0, consumer_tok_s=1.0)
        plans = plan_shapes(shapes, base)
    except ValueError as e:
        fail(PROG, e)
    print(json.dumps({"config": asdict(base), "plans": plans}, indent=2) if args.json else render_shapes(plans, base))


if __name__ == "__main__":
    main()
