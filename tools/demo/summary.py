"""What the demo trained, from the run's metrics: the summary it prints at the end (and writes as JSON)."""

from __future__ import annotations

from pathlib import Path

from dflash.common.metrics import read_metrics
from dflash.tools.demo.progress import (
    consumer_avg_tok_s,
    consumer_steps,
    producer_avg_tok_s,
    producer_records,
)


def _quarter_mean(recs: list[dict], key: str) -> float | None:
    """Mean of `key` over the last quarter of `recs` (one step says little: shards differ in difficulty)."""
    if not recs:
        return None
    rows = recs[-max(1, len(recs) // 4) :]
    return sum(r[key] for r in rows) / len(rows)


def summarize_run(run_dir: Path) -> dict:
    """What the run's metrics say: counts, training loss/τ, and rates averaged over the run."""
    path = run_dir / "metrics" / "consumer-0.jsonl"
    recs = consumer_steps(run_dir)
    events = read_metrics(path) if path.exists() else []
    ckpts = [r for r in events if r.get("event") == "checkpoint"]
    evals = [r for r in events if r.get("event") == "eval"]
    prod = producer_records(run_dir)
    return {
        "steps": recs[-1]["step"] if recs else 0,
        "samples_trained": recs[-1]["samples"] if recs else 0,
        "tokens_produced": sum(int(r.get("tokens", 0)) for r in prod),
        "samples_produced": sum(int(r.get("samples", 0)) for r in prod),
        "loss_first": recs[0]["loss"] if recs else None,
        "loss_last": _quarter_mean(recs, "loss"),
        "producer_tok_s": producer_avg_tok_s(prod),
        "consumer_tok_s": consumer_avg_tok_s(recs),
        "checkpoint": ckpts[-1]["url"] if ckpts else None,
        "train_tau_before": evals[0]["decode_tau"] if evals and evals[0]["step"] == 0 else None,
        "train_tau_after": evals[-1]["decode_tau"] if evals and evals[-1]["step"] > 0 else None,
        "train_tau_step": evals[-1]["step"] if evals else None,
        "run_dir": str(run_dir),
        "logs": str(run_dir / "logs"),
        "plots": sorted(str(p) for p in (run_dir / "plots").glob("*.png")),
    }


def print_summary(s: dict) -> None:
    def f(x, fmt="{:.3f}"):
        return "n/a" if x is None else fmt.format(x)

    print("\n=== dflash-spool demo: what was trained ===")
    print(f"  samples produced   {s['samples_produced']}  ({s['tokens_produced']} tokens)")
    print(f"  samples trained    {s['samples_trained']}  in {s['steps']} steps")
    print(f"  loss (training)    {f(s['loss_first'])} -> {f(s['loss_last'])}   (first step -> last quarter)")
    print(
        f"  held-out tau       {f(s['tau_before'], '{:.2f}')} -> {f(s['tau_after'], '{:.2f}')}   "
        f"(untrained -> trained drafter; {s['heldout_prompts']} conversations never trained on, decoded "
        "draft -> verify against the target, as dflash-eval does)"
    )
    if s["real_responses"]:
        gap = None if s["train_tau_after"] is None else s["train_tau_after"] - s["tau_after"]
        how = f"an estimate from the human answers: {f(gap, '{:+.2f}')} off the real decoding above"
    else:
        how = "the answers are the target's own, so it equals the real decoding above"
    print(
        f"  same, in training  {f(s['train_tau_before'], '{:.2f}')} -> {f(s['train_tau_after'], '{:.2f}')}   "
        f"(decode-order τ the consumer logged on the same documents; {how})"
    )
    print(
        f"  throughput         producer {f(s['producer_tok_s'], '{:.0f}')} tok/s, "
        f"consumer {f(s['consumer_tok_s'], '{:.0f}')} tok/s   (run averages)"
    )
    where = (
        f"   (a copy of {s['checkpoint_s3']}: the demo's S3 server stopped with it)"
        if s.get("checkpoint_s3")
        else ""
    )
    print(f"  checkpoint         {s['checkpoint']}{where}")
    print(f"  drafters           {s['drafter_before']} (untrained), {s['drafter_after']} (trained)")
    print(f"  logs               {s['logs']}")
    print(f"  plots              {', '.join(s['plots']) or 'none'}")
    print(f"  wall time          {s['wall_s']:.0f} s")
    print(f"  status             dflash-status {s['run_dir']}")
    print(
        f"  try                dflash-eval --target {s['target']} --drafter {s['drafter_after']} "
        f"--dataset {s['heldout']} --num-prompts {s['heldout_prompts']} --baseline"
    )
