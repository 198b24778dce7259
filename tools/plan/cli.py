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

Rates, from a run dir or from benchmark files: rates.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NoReturn

from dflash.common.cli.exits import EXIT_USAGE, fail, print_error
from dflash.common.cli.flags import add_flags, flag, from_args
from dflash.common.cli.help import DefaultsHelpFormatter
from dflash.common.metrics import format_rate
from dflash.tools.plan.rates import (
    BENCH_OF,
    DEFAULT_DDP_EFFICIENCY,
    THROTTLED_SHARE,
    MeasuredRates,
    ddp_efficiency,
    measure_rates,
    read_bench_figures,
)

log = logging.getLogger(__name__)

PROG = "dflash-plan"
THROTTLE_NOTE_RATIO = 0.85  # measured totals closer than this: one side was probably throttled
RATE_FLAGS = {"producer_tok_s": "--producer-tok-s", "consumer_tok_s": "--consumer-tok-s"}


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


def plan_shapes(shapes: dict[str, dict[str, float]], base: PlanConfig) -> tuple[list[dict], list[str]]:
    """One plan per shape with both rates (``base`` gives the GPUs, nodes and DDP efficiency), and a line
    for each shape that lacks one: which rate, and which benchmark measures it."""
    plans, missing = [], []
    for shape, rates in sorted(shapes.items()):
        lacks = sorted({"producer_tok_s", "consumer_tok_s"} - set(rates))
        if lacks:
            what = " and ".join(f"no {k.split('_')[0]} rate (measured by {BENCH_OF[k]})" for k in lacks)
            missing.append(f"shape {shape}: {what}, not planned")
            continue
        cfg = PlanConfig(
            num_gpus=base.num_gpus, nodes=base.nodes, ddp_efficiency=base.ddp_efficiency, **rates
        )
        best = best_split(plan_splits(cfg))
        plans.append(
            {"shape": shape, **rates, "best": asdict(best), "node_tok_s": best.end_to_end_tok_s / cfg.nodes}
        )
    return plans, missing


def render_shapes(plans: list[dict], base: PlanConfig) -> str:
    lines = [
        f"{base.num_gpus} GPUs per node, DDP efficiency {base.ddp_efficiency:g} per doubling",
        "",
        f"  {'shape':<12} {'producer':>9} {'consumer':>9}  {'split (P+C)':<12} {'node tok/s':>10}  bottleneck",
    ]
    for p in plans:
        b = p["best"]
        lines.append(
            f"  {p['shape']:<12} {format_rate(p['producer_tok_s']):>9} {format_rate(p['consumer_tok_s']):>9}  "
            f"{b['producers']} + {b['consumers']:<8} {format_rate(p['node_tok_s']):>10}  {b['bottleneck']}"
        )
    return "\n".join(lines)


# ---- CLI ---------------------------------------------------------------------------------------------


def render(
    cfg: PlanConfig,
    splits: list[Split],
    best: Split,
    measured: MeasuredRates | None,
    given: dict[str, float | None] | None = None,
) -> str:
    """The plan as text: what was measured, the inputs used (a flag that overrode a measured rate named
    with both values), the best split and every alternative."""
    given = given or {}
    lines = []
    if measured is not None:
        lines.append(
            f"measured: {measured.num_producers} producer(s) {format_rate(measured.producer_total_tok_s)} tok/s, "
            f"{measured.num_consumers} consumer(s) {format_rate(measured.consumer_total_tok_s)} tok/s"
        )
        a, b = measured.producer_total_tok_s, measured.consumer_total_tok_s
        share = measured.producer_throttled
        if share is not None and share >= THROTTLED_SHARE:
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
    for key, flag_name in RATE_FLAGS.items():  # a flag over a measured rate: both said
        was = getattr(measured, key) if measured is not None else None
        if was is not None and given.get(key) is not None:
            lines.append(
                f"  {key.split('_')[0]} rate {format_rate(given[key])} tok/s from {flag_name}, "
                f"not the {format_rate(was)} tok/s measured"
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
    """benchmark results, comma-separated (pipeline_bench, producer_bench and consumer_bench JSON, consumer_ab's
    ab.jsonl): a plan per target shape with both rates measured, a line for a shape that lacks one"""


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
        given = {k: getattr(args, k) for k in RATE_FLAGS}
        print(render(cfg, splits, best, measured, given))


def apply_given_rates(shapes: dict[str, dict[str, float]], given: dict[str, float]) -> list[str]:
    """Set each given rate (a flag) on every shape, and say so per flag: which shapes' measured rate it
    replaces (with the measured value) and which shapes had none. A flag that silently replaced a
    measured figure would make a plan nobody measured."""
    lines = []
    for key, value in given.items():
        replaced = [f"{s} ({format_rate(r[key])})" for s, r in sorted(shapes.items()) if key in r]
        added = [s for s, r in sorted(shapes.items()) if key not in r]
        parts = (
            [f"replaces the measured {key.split('_')[0]} rate of {', '.join(replaced)}"] if replaced else []
        )
        parts += [f"gives {', '.join(added)} one (none measured)"] if added else []
        lines.append(
            f"{RATE_FLAGS[key]} {format_rate(value)} tok/s used for every shape"
            + (f": {'; '.join(parts)}" if parts else "")
        )
        for rates in shapes.values():
            rates[key] = value
    return lines


def _fail_with(lines: list[str], message: object) -> NoReturn:
    """Exit 2: the one error line, then the lines said so far (the files ignored, the shapes not
    planned), each on its own line, so what led to the error survives it."""
    print_error(PROG, message)
    for line in lines:
        print(f"  {line}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def _main_bench(args) -> None:
    """``--bench``: a plan per shape from measured benchmark figures (flags --producer-tok-s /
    --consumer-tok-s, when given, apply to every shape, said per shape). What it used is said: the files
    and what each gave, the flags and which shapes they overrode. A shape that lacks a rate, or a file that
    holds none, is one line; exit 2 only when no shape could be planned (the error line, then those
    lines)."""
    notes: list[str] = []
    used: list[str] = []
    paths = [p for p in args.bench.split(",") if p.strip()]
    try:
        shapes = read_bench_figures(paths, notes, used)
        given = {k: v for k in RATE_FLAGS if (v := getattr(args, k)) is not None}
        overrides = apply_given_rates(shapes, given)
        base = from_args(PlanConfig, args, producer_tok_s=1.0, consumer_tok_s=1.0)
        plans, missing = plan_shapes(shapes, base)
    except ValueError as e:
        _fail_with(notes, e)
    if not plans:
        many = len(paths) != 1
        what = f"{len(paths)} --bench file{'s' if many else ''}"
        why = "" if missing else f": no rate in {'them' if many else 'it'}"
        _fail_with(missing + notes, f"no shape could be planned from {what}{why or ':'}")
    if args.json:
        print(
            json.dumps(
                {
                    "config": asdict(base),
                    "plans": plans,
                    "not_planned": missing,
                    "rates_from": used,
                    "given": overrides,
                    "notes": notes,
                },
                indent=2,
            )
        )
        return
    said = ["rates from:", *(f"  {line}" for line in used + overrides)]
    print("\n".join([*said, render_shapes(plans, base), *(f"  {line}" for line in missing + notes)]))


if __name__ == "__main__":
    main()
