#!/usr/bin/env python
"""The pipeline end to end through the real CLIs: ``dflash-produce`` + ``dflash-consume`` on given GPU sets
(one GPU shared by one producer and one consumer included), each side alone first, then together.

Why: the node's speed is what producers and consumers sustain together through the spool; the figures of
each side alone say what they could sustain. On one shared GPU, producing N tokens costs N/P of GPU time and
training them N/C, so together they can train at most 1 / (1/P + 1/C); on separate GPUs min(P, C). This
measures P and C alone, then trained tok/s together, and says how close it comes (goal: >= 0.9). On the
CPU (``--small``) the two run on separate cores at once, so the rule there is min(P, C): a smoke figure.

Phases (``--phases``, default all, in this order):
- ``producer``: dflash-produce alone into spool A (budget large enough to hold everything): P = its tokens
  over its production time (after load and compile warm-up), per producer GPU;
- ``consumer``: dflash-consume alone drains spool A: C = its trained tokens over its steps after the first
  log interval (compile), per consumer GPU; the ledger says every sample of A was trained once;
- ``together``: both at once on a fresh spool B, the consumer with checkpoints (the stall per save):
  trained tok/s = trained tokens / (last step - the producer's first batch).

Input: a random-weight target of a named shape saved to ``--workdir`` (ops/bench/targets.py: 8b, 32b,
hybrid27b (a slice), small) and a synthetic chat dataset of long-tailed (log-normal) lengths. Output
(``--out``): pipeline_bench_<preset>.json with every figure (rates, spool depth and bytes over time, memory
per process, fill, checkpoint stall, the ledger audit, the acceptance checks), a PNG of the spool over
time, and the logs (each run's under ``run-<stamp>/``: a second run never reads the first's ledger). Exit 1 when a process fails or the ledger audit fails (a sample lost or trained twice).

    python ops/bench/pipeline_bench.py --preset 8b --producer-gpus 0 --consumer-gpus 0 --out $OUT   # GPU
    .venv/bin/python ops/bench/pipeline_bench.py --small --out /tmp/pb                            # CPU, < 1 min
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes import Sampler, stop  # noqa: E402
from targets import PRESETS, depth_scale, save_target, write_chat_dataset  # noqa: E402

from dflash.common.metrics import read_run_metrics  # noqa: E402

BIN = Path(sys.executable).parent


def _exe(name: str) -> str:
    """A console script: on PATH (pip's scripts folder need not be the interpreter's), else beside python."""
    return shutil.which(name) or str(BIN / name)


ACCEPT_TOGETHER = 0.9  # trained together / what the solo capacities allow


class Audit(AssertionError):
    """The ledger says a sample was lost or trained twice."""


def ledger_audit(metrics_dir: Path, eligible: set[int]) -> dict:
    """Every eligible sample trained exactly once according to the consumers' ledgers (``ledger-r*.jsonl``:
    one line per committed step with the sample ids it trained). Raises Audit; returns the counts."""
    seen: Counter = Counter()
    for path in sorted(metrics_dir.glob("ledger-r*.jsonl")):
        for line in path.read_text().splitlines():
            seen.update(json.loads(line)["samples"])
    twice = sorted(s for s, n in seen.items() if n > 1)
    missing, extra = sorted(eligible - set(seen)), sorted(set(seen) - eligible)
    if twice or missing or extra:
        raise Audit(
            f"ledger {metrics_dir}: {len(twice)} trained twice {twice[:5]}, {len(missing)} never trained "
            f"{missing[:5]}, {len(extra)} not produced {extra[:5]}"
        )
    return {"trained_samples": sum(seen.values()), "eligible": len(eligible), "twice": 0, "missing": 0}


def eligible_samples(args, target: Path, dataset: Path) -> set[int]:
    """The samples the producers keep: their own tokenization (the datasets cache makes this a lookup)."""
    from transformers import AutoTokenizer

    from dflash.common.target.chat import tokenize_slice
    from dflash.common.target.data import DataConfig, load_raw_dataset

    cfg = DataConfig(
        dataset=str(dataset), max_length=args.max_length, min_loss_tokens=32, cache_dir=str(args.cache)
    )
    ds = load_raw_dataset(cfg, quiet=True)
    tok = tokenize_slice(ds, AutoTokenizer.from_pretrained(target), cfg, np.arange(len(ds)))
    return {int(i) for i, s in zip(tok["sample_index"], tok["status"], strict=True) if s == "ok"}


def _produce_cmd(args, spool: Path, run_dir: Path) -> list[str]:
    return [
        _exe("dflash-produce"),
        "--gpus",
        args.producer_gpus,
        "--model",
        str(args.target),
        "--dataset",
        str(args.dataset),
        "--spool",
        str(spool),
        "--run",
        "bench",
        "--run-dir",
        str(run_dir),
        "--max-length",
        str(args.max_length),
        "--batch-tokens",
        str(args.batch_tokens),
        "--budget-gb",
        str(args.budget_gb),
        "--cache-dir",
        str(args.cache),
        "--progress-s",
        "5",
        *shlex.split(args.producer_args),
    ]


def _consume_cmds(args, spool: Path, run_dir: Path, checkpoint: Path | None) -> list[tuple[list[str], dict]]:
    devices = [d.strip() for d in args.consumer_gpus.split(",")]
    port = str(29500 + os.getpid() % 1000)
    out = []
    for rank, dev in enumerate(devices):
        cmd = [
            _exe("dflash-consume"),
            "--gpu",
            dev,
            "--spool",
            str(spool),
            "--target",
            str(args.target),
            "--run",
            "bench",
            "--run-dir",
            str(run_dir),
            "--log-every",
            str(args.log_every),
            *(
                ["--checkpoint", str(checkpoint), "--save-every", str(args.save_every), "--keep-last", "1"]
                if checkpoint
                else []
            ),
            *shlex.split(args.consumer_args),
        ]
        env = (
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(len(devices)),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }
            if len(devices) > 1
            else {}
        )
        out.append((cmd, env))
    return out


def _run(phase: str, args, jobs: dict[str, tuple[list[str], dict]], spool: Path) -> tuple[list[dict], float]:
    """Start the phase's processes together, sample until all end; (series, wall seconds). Raises on a
    non-zero exit, naming the process and its log."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    if "producer" in jobs:  # as ops/run_all.sh: a fresh spool bound to the run before anyone starts
        subprocess.run(
            [_exe("dflash-spool"), "prepare", str(spool), "--run", "bench"], check=True, capture_output=True
        )
    procs, logs = {}, {}
    t0 = time.time()
    for name, (cmd, extra) in jobs.items():
        logs[name] = args.out / f"{phase}-{name}.log"
        with logs[name].open("w") as f:
            procs[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**env, **extra})
    sampler = Sampler(spool, procs, gpu=not args.small)
    sampler.start()
    try:  # until all end; the first failure (or the timeout) stops the others
        while any(p.poll() is None for p in procs.values()):
            bad = {n: p.returncode for n, p in procs.items() if p.returncode not in (None, 0)}
            if bad or time.time() - t0 > args.timeout:
                break
            time.sleep(0.5)
    finally:
        stop(procs)
        series = sampler.stop()
    bad = {n: p.returncode for n, p in procs.items() if p.returncode != 0}
    if bad:
        name = next(iter(bad))
        tail = logs[name].read_text().splitlines()[-15:]
        raise RuntimeError(
            f"{phase}: {name} exited {bad[name]} after {time.time() - t0:.0f} s ({logs[name]}):\n"
            + "\n".join(tail)
        )
    return series, time.time() - t0


def _producer_rates(run_dir: Path) -> dict:
    """Per producer: tokens, production seconds (after warm-up), compile and recompiles (final heartbeat);
    its rate over the time it did not wait on the spool budget (a throttled rate is not a producer's)."""
    runs = [
        recs for stem, recs in read_run_metrics(run_dir / "metrics").items() if stem.startswith("producer")
    ]
    finals = [recs[-1] for recs in runs]
    # the time a producer's main loop waited on writers blocked by the spool budget is not its rate's
    blocked = [f.get("main_wait_s", 0.0) if f.get("budget_wait_s") else 0.0 for f in finals]
    rates = [f["tokens"] / max(f["produce_s"] - b, 1e-9) for f, b in zip(finals, blocked, strict=True)]
    # the process's own view of its GPU memory (torch's allocated bytes, every heartbeat), beside nvidia-smi's
    own = _flat(
        [{"gb": r["gpu_mem_gb"]} for r in runs[0] if r.get("phase") == "produce" and "gpu_mem_gb" in r], "gb"
    )
    return {
        "producers": len(finals),
        "tokens": int(sum(f["tokens"] for f in finals)),
        "samples": int(sum(f["samples"] for f in finals)),
        "tok_s_per_gpu": float(np.mean(rates)),
        "budget_blocked_s": float(sum(blocked)),
        "tok_s": float(sum(rates)),
        "start_time": min(f["time"] - f["produce_s"] for f in finals),
        "compile_s": max(f.get("compile_s", 0) for f in finals),
        "recompiles": sum(f.get("recompiles", 0) for f in finals),
        "compile": finals[0].get("compile"),
        "padding_waste": float(np.mean([f["padding_waste"] for f in finals])),
        "gpu_max_mem_gb": max((f.get("gpu_max_mem_gb") or 0) for f in finals),
        "gpu_mem_allocated": own,
    }


def _consumer_rates(run_dir: Path) -> dict:
    """Rank 0's log intervals (the group's sums): rate after the first interval (compile), fill, the end."""
    recs = read_run_metrics(run_dir / "metrics")["consumer-0"]
    steps = [r for r in recs if "event" not in r and "interval_tokens" in r]
    end = next((r for r in recs if r.get("event") == "end"), {})
    steady = steps[1:] or steps
    world = steps[-1]["world_size"] if steps else 1
    ledger = [json.loads(x) for x in (run_dir / "metrics" / "ledger-r0.jsonl").read_text().splitlines()]
    tok_s = sum(r["interval_tokens"] for r in steady) / max(sum(r["interval_s"] for r in steady), 1e-9)
    return {
        "consumers": world,
        "steps": end.get("steps"),
        "tokens": int(sum(r["interval_tokens"] for r in steps)),
        "tok_s": tok_s,
        "tok_s_per_gpu": tok_s / world,
        "fill": end.get("fill"),
        "first_step_s": end.get("first_step_s"),
        "checkpoint_stall_s": end.get("last_save_stall_s"),
        "recompiles": end.get("recompiles_after_warmup"),
        "last_step_time": ledger[-1]["time"] if ledger else None,
        "first_interval_time": steps[0]["time"] if steps else None,  # compiled, in steady work
        "gpu_max_mem_gb": max((r.get("mem_gb") or 0) * 2**30 / 1e9 for r in steps) if steps else None,
        "gpu_peak_mem": _flat([{"gb": r["mem_gb"] * 2**30 / 1e9} for r in steps if "mem_gb" in r], "gb"),
    }


def _flat(series: list[dict], key: str, since: float | None = None) -> dict | None:
    """Memory flat over the process's steady work: the mean of the last fifth of the samples from ``since``
    (epoch seconds: a producer's first production, a consumer's first logged interval) within 5 % + 0.5 GB
    of the first fifth's. Samples before ``since`` are the process loading its target and compiling, its
    memory rising from the CUDA context's to the steady figure (a consumer waiting for its first shard sits
    at the context's): judged with them, every process read as growing (``before_gb``: their mean)."""
    pts = [r[key] for r in series if r.get(key) and (since is None or r.get("time", since) >= since)]
    if len(pts) < 5:
        return None
    k = max(1, len(pts) // 5)
    first, last = float(np.mean(pts[:k])), float(np.mean(pts[-k:]))
    out = {
        "max_gb": max(pts),
        "first_fifth_gb": round(first, 3),
        "last_fifth_gb": round(last, 3),
        "flat": last <= 1.05 * first + 0.5,
    }
    if since is not None:
        before = [r[key] for r in series if r.get(key) and r.get("time", since) < since]
        out["steady_from_s"] = round(since - series[0].get("time", since), 1) if series else None
        out["before_gb"] = round(float(np.mean(before)), 3) if before else None
    return out


def steady_memory(series: list[dict], starts: dict[str, float | None]) -> dict[str, dict | None]:
    """{"<process>_gb": _flat} for each process in the series, each from its own steady start (``starts``:
    "producer" and "consumer", epoch seconds; every consumerN from the consumer's)."""
    keys = [k for k in (series[0] if series else {}) if k.endswith("_gb") and k != "spool_gb"]
    return {
        k: _flat(series, k, starts.get("producer" if k.startswith("producer") else "consumer")) for k in keys
    }


def run_phases(args) -> dict:
    res: dict = {"phases": {}}
    spool_a, spool_b = args.spool_root / "solo", args.spool_root / "together"
    if "producer" in args.phases:
        series, wall = _run(
            "producer",
            args,
            {"producer": (_produce_cmd(args, spool_a, args.run_root / "run-producer"), {})},
            spool_a,
        )
        res["phases"]["producer"] = {
            "wall_s": wall,
            "series": series,
            **_producer_rates(args.run_root / "run-producer"),
        }
        res["phases"]["producer"]["memory"] = _flat(
            series, "producer_gb", res["phases"]["producer"]["start_time"]
        )
    # the producers' own tokenization (a datasets cache lookup, but seconds of imports): beside the next phase
    pending = ThreadPoolExecutor(1).submit(eligible_samples, args, args.target, args.dataset)
    if "consumer" in args.phases:
        jobs = {
            f"consumer{r}": j
            for r, j in enumerate(_consume_cmds(args, spool_a, args.run_root / "run-consumer", None))
        }
        series, wall = _run("consumer", args, jobs, spool_a)
        ph = res["phases"]["consumer"] = {
            "wall_s": wall,
            "series": series,
            **_consumer_rates(args.run_root / "run-consumer"),
        }
        ph["ledger"] = ledger_audit(args.run_root / "run-consumer" / "metrics", pending.result())
        ph["memory"] = _flat(series, "consumer0_gb", ph["first_interval_time"])
    if "together" in args.phases:
        jobs = {"producer": (_produce_cmd(args, spool_b, args.run_root / "run-together"), {})}
        for r, j in enumerate(_consume_cmds(args, spool_b, args.run_root / "run-together", args.checkpoint)):
            jobs[f"consumer{r}"] = j
        series, wall = _run("together", args, jobs, spool_b)
        prod, cons = (
            _producer_rates(args.run_root / "run-together"),
            _consumer_rates(args.run_root / "run-together"),
        )
        ph = res["phases"]["together"] = {
            "wall_s": wall,
            "series": series,
            "producer": prod,
            "consumer": cons,
        }
        ph["trained_tok_s"] = cons["tokens"] / max(cons["last_step_time"] - prod["start_time"], 1e-9)
        ph["ledger"] = ledger_audit(args.run_root / "run-together" / "metrics", pending.result())
        ph["memory"] = steady_memory(
            series, {"producer": prod["start_time"], "consumer": cons["first_interval_time"]}
        )
    return res


def _memory_verdicts(tree, path: str = "") -> dict[str, bool]:
    """{where: flat} for every memory summary (a dict with "flat") anywhere in the phases' results."""
    if isinstance(tree, dict):
        if "flat" in tree:
            return {path: bool(tree["flat"])}
        return {
            k: v
            for key, sub in tree.items()
            if key != "series"
            for k, v in _memory_verdicts(sub, f"{path}/{key}".strip("/")).items()
        }
    return {}


def summarize(res: dict, args) -> dict:
    ph = res["phases"]
    shared = set(args.producer_gpus.split(",")) == set(args.consumer_gpus.split(",")) and not args.small
    p = ph.get("producer", {}).get("tok_s")
    c = ph.get("consumer", {}).get("tok_s")
    fig = {
        "shape": args.preset,
        "layers": args.layers,
        "depth_scale": depth_scale(args.preset, args.layers),
        "producer_tok_s": ph.get("producer", {}).get("tok_s_per_gpu"),
        "consumer_tok_s": ph.get("consumer", {}).get("tok_s_per_gpu"),
    }
    if fig["producer_tok_s"]:
        fig["producer_tok_s_full_depth"] = fig["producer_tok_s"] * fig["depth_scale"]
    res["figures"] = [fig]
    checks = []
    if p and c and "together" in ph:
        # one shared GPU runs the two in turn: at most 1/(1/P + 1/C); separate devices (the CPU smoke run's
        # producer and consumer each on their own cores) run side by side: at most min(P, C)
        ideal = 1 / (1 / p + 1 / c) if shared else min(p, c)
        ratio = ph["together"]["trained_tok_s"] / ideal
        ph["together"].update(
            ideal_tok_s=ideal, trained_vs_ideal=ratio, rule="1/(1/P+1/C)" if shared else "min(P, C)"
        )
        checks.append(
            {
                "check": f"trained together >= {ACCEPT_TOGETHER} x {ph['together']['rule']}",
                "value": round(ratio, 4),
                "threshold": ACCEPT_TOGETHER,
                "ok": None if args.small else ratio >= ACCEPT_TOGETHER,
            }
        )
    for name in ("consumer", "together"):
        if name in ph:
            checks.append(
                {
                    "check": f"{name}: every produced sample trained exactly once (ledger)",
                    "value": ph[name]["ledger"],
                    "ok": True,
                }
            )
    rec = {
        k: v.get("recompiles")
        if k != "together"
        else (v["producer"]["recompiles"], v["consumer"]["recompiles"])
        for k, v in ph.items()
    }
    checks.append(
        {
            "check": "0 recompiles after warm-up (producer, consumer)",
            "value": rec,
            "ok": all((r or 0) == 0 for v in rec.values() for r in (v if isinstance(v, tuple) else (v,))),
        }
    )
    mems = _memory_verdicts(ph)
    checks.append(
        {
            "check": "GPU memory flat per process (nvidia-smi, and each process's own allocated bytes)",
            "value": mems,
            "ok": all(mems.values()) if mems and not args.small else None,
        }
    )
    res["acceptance"] = checks
    return res


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [(n, v["series"]) for n, v in res["phases"].items() if v.get("series")]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=False)
    for name, series in phases:
        t = [r["t"] for r in series]
        axes[0].plot(t, [r.get("ready", 0) for r in series], label=name)
        axes[1].plot(t, [r.get("spool_gb", 0) for r in series], label=name)
        for key in series[0]:
            if key.endswith("_gb") and key != "spool_gb":
                axes[2].plot(t, [r.get(key, 0) for r in series], label=f"{name}: {key[:-3]}")
    for ax, label in zip(axes, ("ready shards", "spool GB", "memory GB per process"), strict=True):
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    axes[2].set_xlabel("seconds since the phase started")
    fig.suptitle(f"pipeline_bench {res['args']['preset']}: spool and memory over time")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="CPU: the small shape, a tiny dataset (CI, < 1 min)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="target shape (default 8b; --small: small)")
    p.add_argument("--layers", type=int, help="decoder layers of the saved target (default: the preset's)")
    p.add_argument("--producer-gpus", default="0", help="dflash-produce --gpus (0 | 0-3 | cpu:1)")
    p.add_argument("--consumer-gpus", default="0", help="comma list, one dflash-consume each (0 | 4,5 | cpu)")
    p.add_argument("--phases", default="producer,consumer,together")
    p.add_argument(
        "--chats", type=int, help="conversations in the synthetic dataset (default 600; --small 24)"
    )
    p.add_argument("--median-len", type=int, help="median conversation tokens (default 800; --small 120)")
    p.add_argument("--max-length", type=int, help="producer --max-length (default 4096; --small 256)")
    p.add_argument("--batch-tokens", type=int, help="producer --batch-tokens (default 32768; --small 1024)")
    p.add_argument(
        "--budget-gb", type=float, default=40.0, help="spool budget (holds the producer phase's output)"
    )
    p.add_argument("--save-every", type=int, help="consumer checkpoints every N steps in the together phase")
    p.add_argument("--log-every", type=int, help="consumer log interval (default 10; --small 2)")
    p.add_argument("--producer-args", default="", help="extra dflash-produce flags")
    p.add_argument("--consumer-args", default="", help="extra dflash-consume flags")
    p.add_argument("--workdir", default="/tmp/dflash-pipeline-bench", help="target, dataset, caches (kept)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per phase")
    p.add_argument("--out", default="runs/pipeline_bench")
    args = p.parse_args(argv)
    small = args.small
    args.preset = args.preset or ("small" if small else "8b")
    for k, v in dict(
        chats=24 if small else 600,
        median_len=120 if small else 800,
        max_length=256 if small else 4096,
        batch_tokens=1024 if small else 32768,
        log_every=2 if small else 10,
    ).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if small:
        args.producer_gpus, args.consumer_gpus = "cpu:1", "cpu"
        args.consumer_args = (
            "--context-tokens 256 --num-anchors 16 --max-anchors-per-doc 8 --num-layers 1 --eval-every 0 "
            "--fill-wait-s 0.2 " + args.consumer_args
        )
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    args.layers = (
        args.layers or PRESETS[args.preset].get("default_layers") or PRESETS[args.preset]["num_hidden_layers"]
    )
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir)
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    args.target = save_target(
        args.preset,
        work / f"target-{args.preset}-{args.layers}",
        layers=args.layers,
        device="cpu" if args.small else "cuda",
    ).resolve()
    args.dataset = write_chat_dataset(
        work / f"chat-{args.chats}-{args.median_len}.jsonl",
        rows=args.chats,
        median=args.median_len,
        sigma=0.9,
        cap=args.max_length + 200,
    ).resolve()
    args.cache = work / "hf-cache"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    stamp = f"{stamp}-{os.getpid()}"
    # every run its own folders: an audit never reads another run's ledger (a re-run in the same checkout)
    args.run_root = args.out / f"run-{stamp}"
    args.spool_root, args.checkpoint = shm / f"dflash-pipeline-{stamp}", shm / f"dflash-pipeline-ckpt-{stamp}"
    args.save_every = args.save_every or (3 if args.small else 60)
    if args.small:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    res: dict = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    code = 0
    try:
        res.update(run_phases(args))
        summarize(res, args)
        plot(res, args.out / f"pipeline_bench_{args.preset}.png")
    except (Audit, RuntimeError, subprocess.TimeoutExpired) as err:
        res["error"] = str(err)
        print(f"pipeline_bench: error: {err}", file=sys.stderr)
        code = 1
    finally:
        shutil.rmtree(args.spool_root, ignore_errors=True)
        shutil.rmtree(args.checkpoint, ignore_errors=True)
    (args.out / f"pipeline_bench_{args.preset}.json").write_text(json.dumps(res, indent=1, default=str))
    for c in res.get("acceptance", []):
        print(
            f"{'PASS' if c['ok'] else 'FAIL' if c['ok'] is False else 'n/a '}: {c['check']}: {c.get('value', '')}"
        )
    for name, ph in res.get("phases", {}).items():
        keys = (
            "tok_s",
            "tok_s_per_gpu",
            "trained_tok_s",
            "ideal_tok_s",
            "trained_vs_ideal",
            "fill",
            "checkpoint_stall_s",
            "wall_s",
        )
        print(f"{name}: " + ", ".join(f"{k} {ph[k]:.4g}" for k in keys if isinstance(ph.get(k), int | float)))
    return code


if __name__ == "__main__":
    sys.exit(main())
