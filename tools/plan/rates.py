"""dflash-plan's inputs: each side's per-GPU rate, measured in a run dir or read from benchmark files,
and the DDP group's efficiency model the plan scales consumers by.

Rates from a run dir: per process, the median ``tok_s`` of its metrics records after dropping the first
``warmup_frac`` of them (compile, cache warm-up); per GPU, the mean over processes. A consumer file whose
records carry ``world_size`` > 1 holds the all-reduced rate of the whole group (rank 0 logs for all):
it is divided by ``world_size``; without it, each ``consumer-<rank>.jsonl`` is one rank. A measured consumer
rank rate already includes ``eff(c0)`` of its c0-rank group, so it is divided by that to get C. In a
coupled run the faster side is throttled (producers by spool backpressure, consumers by an empty spool),
so its measured rate is only a lower bound — the tool says so when the two totals are close. Producers
say how long they waited on the spool's byte budget (``budget_blocked_s`` in their metrics, on every path:
a hand-off, an epoch's drain, the last shards of a slice): their rate is taken over the time they did not
wait (tokens forwarded / unblocked seconds), and the plan names the share of time they were throttled.

Rates from benchmarks (``--bench a.json,b.json``), only measured ones: the ``figures`` of
``ops/bench/pipeline_bench.py`` (per target shape: one producer GPU's and one consumer GPU's rate alone, the
producer's scaled to the shape's full depth when the bench ran a slice, its time blocked on the spool budget
left out), ``ops/bench/producer_bench.py`` results (its shipped producer's rate, at full depth),
``ops/bench/consumer_bench.py --json`` output (per preset, the real Trainer's tokens/s in the default
precision) and ``ops/bench/consumer_ab.py``'s ab.jsonl (the variant of dflash-consume's default flags); a
later file overrides an earlier one's figure for the same shape. Every shape with both rates gets its own
plan: the split of a node and the predicted node tok/s (``nodes`` = 1: the node); a shape that lacks one
says which and which bench measures it. The plan names what it used: each file with the shapes and sides it
gave, a file that gave none with why, a later file's figure over an earlier one's with both.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.common.cli.exits import one_line
from dflash.common.metrics import format_rate, read_run_metrics
from dflash.consumer.config import OptimConfig

DEFAULT_DDP_EFFICIENCY = 0.95
THROTTLED_SHARE = 0.05
"""Producers that waited on the spool budget this share of their time were throttled by the consumers: their
measured rate is not what they make (dflash-plan plans their unthrottled rate and says so, dflash-status
names the consumers the bottleneck)."""


def ddp_efficiency(num_consumers: int, per_doubling: float) -> float:
    """Fraction of per-GPU consumer throughput kept in a DDP group of ``num_consumers`` (1.0 for one)."""
    return per_doubling ** math.log2(num_consumers)


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


def producer_rate(
    records: list[dict[str, Any]], *, warmup_frac: float = 0.25
) -> tuple[float | None, float | None]:
    """(tok/s while not waiting on the spool budget, share of the time it waited) of one producer.

    The time it waited is its ``budget_blocked_s``: the wall time its main loop waited on writers that
    waited on the budget (a hand-off, an epoch's drain, the last shards of its slice); its rate is the
    tokens it forwarded (``fwd_tokens``) over the rest. Records from producers that did not count it:
    between two records where the writers waited on the budget (``budget_wait_s`` grew), the main loop's
    wait on the writers (``main_wait_s``). Records without either: ``steady_rate`` and an unknown share."""
    pts = [
        r
        for r in records
        if "event" not in r and _num(r, "tokens") is not None and _num(r, "elapsed_s") is not None
    ]
    if len(pts) < 2 or not any(_num(r, "budget_wait_s") is not None for r in pts):
        return steady_rate(records, warmup_frac=warmup_frac), None
    pts = pts[min(len(pts) - 2, math.ceil(warmup_frac * len(pts))) :]
    # a counter appears at its first count: absent before it, 0
    exact = any(_num(r, "budget_blocked_s") is not None for r in pts)
    made = "fwd_tokens" if any(_num(r, "fwd_tokens") is not None for r in pts) else "tokens"
    span = waited = tokens = 0.0
    for a, b in zip(pts, pts[1:], strict=False):
        dt = _num(b, "elapsed_s") - _num(a, "elapsed_s")
        if dt <= 0:
            continue
        span, tokens = span + dt, tokens + (_num(b, made) or 0.0) - (_num(a, made) or 0.0)
        if exact:
            waited += (_num(b, "budget_blocked_s") or 0.0) - (_num(a, "budget_blocked_s") or 0.0)
        elif (_num(b, "budget_wait_s") or 0.0) > (_num(a, "budget_wait_s") or 0.0):
            waited += min(dt, max(0.0, (_num(b, "main_wait_s") or 0.0) - (_num(a, "main_wait_s") or 0.0)))
    waited = min(max(waited, 0.0), span)
    if span - waited <= 0 or tokens <= 0:
        return steady_rate(records, warmup_frac=warmup_frac), None
    return tokens / (span - waited), waited / span


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


BENCH_OF = {
    "producer_tok_s": "ops/bench/producer_bench.py or pipeline_bench.py",
    "consumer_tok_s": "ops/bench/consumer_bench.py --mode trainer, consumer_ab.py or pipeline_bench.py",
}
"""Which benchmark measures each rate (a shape that lacks one says so)."""


def read_bench_figures(
    paths: list[str], notes: list[str] | None = None, used: list[str] | None = None
) -> dict[str, dict[str, float]]:
    """{shape: {"producer_tok_s", "consumer_tok_s"}} per GPU from the benchmarks' files (module docstring):
    pipeline_bench and producer_bench JSON, consumer_bench ``--json`` output, consumer_ab's ab.jsonl. A
    file that cannot be read raises ValueError naming it (``notes`` keeps what the earlier files said).
    ``used`` gets a line per file that gave rates (which shapes, which sides); ``notes`` a line per file
    that gave none (why) and per figure a later file replaced (both values, both files)."""
    shapes: dict[str, dict[str, float]] = {}
    origin: dict[tuple[str, str], str] = {}
    for path in paths:
        text = _read(path)
        try:
            res: Any = json.loads(text)
        except json.JSONDecodeError:
            try:  # consumer_ab's ab.jsonl: one record per line
                res = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"--bench {path}: cannot read a benchmark JSON (JSONDecodeError: {err})"
                ) from None
        if isinstance(res, dict) and ("variant" in res or "mode" in res):
            res = [res]  # an ab.jsonl / consumer_bench list of one record reads as one JSON object
        found = _figures(res) if isinstance(res, dict) else _consumer_rates(res)
        for shape, rates in sorted(found.items()):
            have = shapes.setdefault(shape, {})
            for k, v in rates.items():
                if k in have and have[k] != v and notes is not None:
                    notes.append(
                        f"--bench {path}: shape {shape} {_side(k)} rate {format_rate(v)} tok/s replaces "
                        f"{format_rate(have[k])} tok/s from {origin[shape, k]}"
                    )
                have[k], origin[shape, k] = v, path
        if found and used is not None:
            gave = ", ".join(
                f"{shape} {' + '.join(_side(k) for k in sorted(rates, reverse=True))}"
                for shape, rates in sorted(found.items())
            )
            used.append(f"{path}: {gave}")
        if not found and notes is not None:
            notes.append(f"--bench {path}: {_why_no_rate(res)}, ignored")
    return shapes


def _side(key: str) -> str:
    """ "producer_tok_s" -> "producer"."""
    return key.split("_")[0]


def _why_no_rate(res: Any) -> str:
    """Why a benchmark file gave no rate, in the words of the bench that wrote it: a consumer_ab result
    without a measured default variant, a consumer_bench result without a trainer-mode run, or a file of
    none of the benches."""
    recs = [r for r in res if isinstance(r, dict)] if isinstance(res, list) else []
    variants = [r for r in recs if "variant" in r and r["variant"] not in ("reference", "prefill")]
    if variants:
        default = [r for r in variants if r["variant"] == "default" or r.get("flags") == ""]
        if default:
            r = default[-1]
            why = r.get("error") or ("skipped" if r.get("skipped") else "no tokens/s in its record")
            return (
                f"a consumer_ab result whose default-flags variant {r['variant']!r} measured no rate "
                f"({one_line(why)})"
            )
        names = ", ".join(dict.fromkeys(str(r["variant"]) for r in variants))
        return (
            f"a consumer_ab result without the default flags' variant (it has {names}; the consumer rate "
            "is the variant named default or with empty flags, e.g. --variant default=)"
        )
    if any("mode" in r for r in recs):
        return "a consumer_bench result without a trainer-mode run (the rate is --mode trainer's)"
    return "no producer or consumer rate in it (not a pipeline_bench, producer_bench, consumer_bench or consumer_ab result)"


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as err:
        raise ValueError(
            f"--bench {path}: cannot read a benchmark JSON ({type(err).__name__}: {err})"
        ) from None


def _figures(res: dict) -> dict[str, dict[str, float]]:
    """pipeline_bench's ``figures`` (per shape, each side alone; the producer's scaled to full depth) and
    producer_bench's shipped producer (``results.producer_full``, scaled to full depth)."""
    shapes: dict[str, dict[str, float]] = {}
    for fig in res.get("figures", []):
        prod = fig.get("producer_tok_s_full_depth") or fig.get("producer_tok_s")
        rates = {
            k: float(v)
            for k, v in (("producer_tok_s", prod), ("consumer_tok_s", fig.get("consumer_tok_s")))
            if v
        }
        if rates:
            shapes.setdefault(str(fig.get("shape")), {}).update(rates)
    full = (res.get("results") or {}).get("producer_full")
    if full and full.get("tok_s"):
        rate = float(full["tok_s"]) * float(res.get("depth_scale", 1))
        shapes.setdefault(str(res.get("preset")), {})["producer_tok_s"] = rate
    return shapes


def _consumer_rates(records: list) -> dict[str, dict[str, float]]:
    """One consumer GPU's real tokens/s per preset from consumer_bench's ``--json`` list (its trainer-mode
    runs: the real Trainer over a real spool) or consumer_ab's records (the variant of dflash-consume's
    default flags). Runs in another precision than the default one of their device (a bf16 sweep) are
    left out when a default one is there; several runs of a preset (seeds) give their median (an A/B of
    other flags only gives no rate: ``_why_no_rate`` says so)."""
    runs: dict[str, list[dict]] = {}
    for r in records:
        if not isinstance(r, dict) or not r.get("preset") or r.get("error") or r.get("skipped"):
            continue
        is_trainer = str(r.get("mode", "")).startswith("trainer")
        is_default_variant = "variant" in r and (r["variant"] == "default" or r.get("flags") == "")
        if (is_trainer or is_default_variant) and _real_tok_s(r):
            runs.setdefault(str(r["preset"]), []).append(r)
    out = {}
    for preset, rs in runs.items():
        default = [r for r in rs if r.get("precision") in (None, _default_precision(r))]
        out[preset] = {"consumer_tok_s": statistics.median(_real_tok_s(r) for r in default or rs)}
    return out


def _real_tok_s(r: dict) -> float | None:
    """A run's real (supervised-or-not, packed) tokens/s: ``real_tok_s``, else context x fill per step."""
    if _num(r, "real_tok_s"):
        return _num(r, "real_tok_s")
    ms, context, fill = _num(r, "ms_per_step_median"), _num(r, "context_tokens"), _num(r, "fill")
    return context * fill / (ms / 1e3) if ms and context and fill else None


def _default_precision(r: dict) -> str:
    """The precision dflash-consume takes by default on the device the run measured."""
    return OptimConfig().resolved_precision("cpu" if r.get("device", "cpu") == "cpu" else "cuda")
