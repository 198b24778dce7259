#!/usr/bin/env python
"""The demo's drafter trained from shards of each codec: held-out τ per run and the loss curves side by side.

Why: a shard codec that loses precision (FP8) must not cost the drafter anything; the demo trains the same
drafter on the same data with only the codec changed, so its held-out τ (decoded draft -> verify against the
real target, whose hidden states are never quantized) says whether it does. Reads `dflash-demo --json` files
named `<codec>-s<seed>.json` (with their run dirs' metrics) and writes a markdown table and a PNG.

    for seed in 0 1 2; do for codec in bf16 fp8; do
      .venv/bin/python -m dflash.tools.demo.cli --run-dir runs/codecs/$codec-s$seed \\
        --json runs/codecs/$codec-s$seed.json --local-checkpoints --codec $codec --seed $seed
    done; done
    .venv/bin/python ops/bench/demo_codecs.py --runs runs/codecs --png docs/img/demo-codecs.png

Paired runs (only the codec differs: one spool produced once with the demo's flags and `--codec bf16`, an
FP8 copy of it re-encoded shard by shard, eval shards left bf16 in both; `dflash-consume` with the demo's
drafter flags, `--bucket oldest` and each `--seed` on a fresh copy of each) are read from their run dirs
`<codec>-s<seed>/` when the folder holds no demo summaries.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

COLORS = {"bf16": "tab:blue", "fp8": "tab:orange"}


def load_runs(folder: Path) -> list[dict]:
    """`dflash-demo --json` summaries `<codec>-s<seed>.json`, or else `dflash-consume` run dirs
    `<codec>-s<seed>/` (the paired runs: τ = the consumer's last decode-order τ on the held-out shards)."""
    runs = []
    for path in sorted(folder.glob("*-s*.json")):
        summary = json.loads(path.read_text())
        summary["curve"] = _curve(Path(summary["run_dir"]))
        runs.append(summary)
    if runs:
        return runs
    for run_dir in sorted(p for p in folder.glob("*-s*") if (p / "metrics").is_dir()):
        codec, seed = run_dir.name.rsplit("-s", 1)
        records = [
            json.loads(line) for line in (run_dir / "metrics" / "consumer-0.jsonl").read_text().splitlines()
        ]
        evals = [r for r in records if r.get("event") == "eval"]
        curve = _curve(run_dir)
        quarter = [loss for _, loss in curve[3 * len(curve) // 4 :]]
        runs.append(
            {
                "codec": codec,
                "seed": int(seed),
                "steps": curve[-1][0],
                "curve": curve,
                "wall_s": records[-1]["time"] - records[0]["time"],
                "tau_before": evals[0]["decode_tau"],
                "tau_after": evals[-1]["decode_tau"],
                "train_tau_before": evals[0]["decode_tau"],
                "train_tau_after": evals[-1]["decode_tau"],
                "loss_first": curve[0][1],
                "loss_last": statistics.fmean(quarter),
            }
        )
    return runs


def _curve(run_dir: Path) -> list[tuple[int, float]]:
    metrics = run_dir / "metrics" / "consumer-0.jsonl"
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r and "event" not in r]
    return [(r["step"], r["loss"]) for r in steps]


def smooth(points: list[tuple[int, float]], window: int) -> tuple[list[int], list[float]]:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    out = [statistics.fmean(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]
    return xs, out


def table(runs: list[dict]) -> str:
    lines = [
        "| codec | seed | steps | held-out τ before → after | in training | loss first → last quarter | wall s |",
        "|---|---:|---:|---|---|---|---:|",
    ]
    for r in sorted(runs, key=lambda r: (r["codec"], r["seed"])):
        lines.append(
            f"| {r['codec']} | {r['seed']} | {r['steps']} | {r['tau_before']:.3f} → **{r['tau_after']:.3f}** "
            f"| {r['train_tau_before']:.3f} → {r['train_tau_after']:.3f} | {r['loss_first']:.2f} → {r['loss_last']:.3f} "
            f"| {r['wall_s']:.0f} |"
        )
    lines.append("")
    for codec in sorted({r["codec"] for r in runs}):
        taus = [r["tau_after"] for r in runs if r["codec"] == codec]
        lines.append(
            f"- {codec}: held-out τ {min(taus):.3f}-{max(taus):.3f} (mean {statistics.fmean(taus):.3f}, "
            f"{len(taus)} runs); last-quarter loss mean "
            f"{statistics.fmean(r['loss_last'] for r in runs if r['codec'] == codec):.3f}"
        )
    return "\n".join(lines)


def plot(runs: list[dict], png: Path, window: int, title: str) -> None:
    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    loss, tau = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for r in runs:
        xs, ys = smooth(r["curve"], window)
        loss.plot(
            xs, ys, color=COLORS.get(r["codec"]), lw=1, alpha=0.8, label=f"{r['codec']} seed {r['seed']}"
        )
    loss.set(xlabel="step", ylabel=f"training loss ({window}-step mean)", title=f"{title}: training loss")
    loss.legend(fontsize=7)
    codecs = sorted({r["codec"] for r in runs})
    for i, codec in enumerate(codecs):
        mine = [r for r in runs if r["codec"] == codec]
        tau.scatter([i] * len(mine), [r["tau_after"] for r in mine], color=COLORS.get(codec), zorder=3)
        for r in mine:
            tau.annotate(
                f"s{r['seed']}", (i, r["tau_after"]), xytext=(6, 0), textcoords="offset points", fontsize=7
            )
    tau.set(
        xticks=range(len(codecs)),
        xticklabels=codecs,
        xlim=(-0.6, len(codecs) - 0.4),
        ylabel="held-out τ (trained drafter)",
        title=f"{title}: held-out τ per seed",
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=Path, required=True, help="folder of <codec>-s<seed>.json demo summaries")
    p.add_argument("--png", type=Path, required=True)
    p.add_argument("--window", type=int, default=20, help="steps averaged in the loss curves")
    p.add_argument("--title", default="demo", help="what the runs are, in the plot titles")
    args = p.parse_args(argv)
    runs = load_runs(args.runs)
    if not runs:
        raise SystemExit(f"demo_codecs: error: no <codec>-s<seed>.json under {args.runs}")
    plot(runs, args.png, args.window, args.title)
    print(table(runs))


if __name__ == "__main__":
    main()
