"""A/B of the real training loop: one spool built once, several variants of ``dflash-consume``'s flags, each
in a fresh process, and the reference step at the preset's own shape (its REF_SHAPE: 32b, hybrid27b; a
preset the reference has no shape for gets no ratio), in one device call.

Why: a ``consumer_bench.py --mode trainer`` run prefills its own spool (37-45 s at 32B-class width) and
compiles cold (57-76 s to the first step) before ~20 s of steps; four variants did not fit a 10-minute call.
Here the producers (``bench_data.SpoolFiller``) fill one master spool once; each variant trains from a copy
made of hard links (instant, no second copy of the shards: the consumer only renames and unlinks them), in
a fresh Python process whose compiled graphs come from the inductor / FX-graph cache shared through
``TORCHINDUCTOR_CACHE_DIR`` (a shape compiled by an earlier variant loads in seconds).

A variant is ``NAME=FLAGS``: FLAGS are ``dflash-consume``'s own (TrainConfig's generated flags: the bench
has no copies of them), e.g. ``liger=--loss-impl liger`` or ``gc-off=--gc-mode python``. Each is bounded
by ``--variant-timeout-s`` and what remains of ``--budget-s``; a variant is not started unless
``--min-variant-s`` remain. Each result is appended to ``OUT/ab.jsonl`` as it finishes (a call cut short
keeps what finished), with: median ms/step over the measured steps and the ratio to the reference step,
per-10-step intervals (ms/step, GPU busy fraction, GPU ms per step, host wait, GC ms, allocator retries),
fill, first step, recompiles after warm-up, peak memory over the first and the last fifth of the
intervals, the loss per interval (the same spool and seed: a variant that computes another loss shows it),
the kernel table when the variant asks for one (``--profile-steps``, copied to OUT), and the preset, context
and real tokens/s (context x fill per median step: one consumer GPU's rate, as ``dflash-plan --bench`` reads
it from the variant of the default flags).

    python ops/bench/consumer_ab.py --preset 32b --reference .bench/ref --out $OUT \\
        --variant default= --variant "liger=--loss-impl liger" --variant "gc-python=--gc-mode python"
    python ops/bench/consumer_ab.py --preset tiny --device cpu --steps 6 --warmup 2 --variant a= --variant "b=--gc-mode python"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import FillPlan, SpoolFiller, write_target_head  # noqa: E402
from consumer_bench import LINEAR_ATTENTION, PRESETS, REF_SHAPES, run_reference, vs_reference  # noqa: E402

from dflash.common.drafter.layers import default_target_layer_ids
from dflash.consumer.config import LogConfig, add_train_flags, train_config_from_args

FIXED = ("spool", "target", "run", "run_dir", "store", "save_every", "max_steps", "total_steps")
"""TrainConfig fields the bench sets itself (a variant's flags cannot)."""
PER_INTERVAL = (
    "loss",
    "gpu_busy",
    "gpu_ms",
    "gpu_gap_max_ms",
    "host_wait_ms",
    "host_launch_ms",
    "gc_ms",
    "gc_max_ms",
    "gc_full",
    "alloc_retries",
    "mem_reserved_gb",
    "sm_clock_mhz",
    "gpu_temp_c",
    "power_w",
)


def variant_parser(context: int, anchors: int) -> argparse.ArgumentParser:
    """dflash-consume's TrainConfig flags (bar ``FIXED``), with the bench's shapes as defaults."""
    p = argparse.ArgumentParser(prog="variant flags", add_help=False)
    defaults = {"log_every": 10, "eval_every": 0, "context_tokens": context, "num_anchors": anchors}
    add_train_flags(p, exclude=FIXED, defaults={**defaults, "max_anchors_per_doc": anchors})
    return p


def parse_variant(spec: str) -> tuple[str, list[str]]:
    name, sep, flags = spec.partition("=")
    if not sep or not name or "/" in name:
        raise SystemExit(f"--variant must be NAME=FLAGS (FLAGS may be empty), got {spec!r}")
    return name, shlex.split(flags)


def summarize(history: list[dict], *, warmup: int, last_step: int) -> dict:
    """The variant's figures from the trainer's per-interval records (module docstring)."""
    recs = [r for r in history if "interval_s" in r]
    measured = [r for r in recs if warmup < r["step"] <= last_step]
    per_step = []
    for a, b in zip(recs, recs[1:], strict=False):
        if warmup <= a["step"] and b["step"] <= last_step:
            per_step.append((b["step"], 1e3 * (b["time"] - a["time"]) / (b["step"] - a["step"])))
    out: dict = {
        "ms_per_step_median": round(statistics.median(ms for _, ms in per_step), 1) if per_step else None,
        "intervals_ms": [(s, round(ms, 1)) for s, ms in per_step],
    }
    for key in PER_INTERVAL:
        out[f"intervals_{key}"] = [r.get(key) for r in measured]
    busy = [r["gpu_busy"] for r in measured if r.get("gpu_busy") is not None]
    if busy:
        out["gpu_busy_median"] = round(statistics.median(busy), 4)
    mem = [r["mem_gb"] for r in measured if "mem_gb" in r]
    if mem:
        fifth = max(1, len(mem) // 5)
        out["peak_mem_gb_first_fifth"] = round(statistics.mean(mem[:fifth]), 2)
        out["peak_mem_gb_last_fifth"] = round(statistics.mean(mem[-fifth:]), 2)
    out["gc_ms_total"] = round(sum(r.get("gc_ms", 0.0) for r in measured), 1)
    out["alloc_retries_total"] = sum(r.get("alloc_retries", 0) for r in measured)
    return out


def child(args: argparse.Namespace, flags: list[str]) -> None:
    """One variant: the real Trainer over the given spool copy; the summary as JSON to ``args.json``."""
    import logging

    from dflash.consumer.trainer import Trainer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # the console lines

    parsed = variant_parser(args.context, args.anchors).parse_args(flags)
    max_steps = args.warmup + args.steps
    steps_run = max_steps
    if parsed.profile_steps:  # profiled steps come after the measured ones: they never time an interval
        count = LogConfig(profile_steps=parsed.profile_steps).profile_window[1]
        parsed.profile_steps = f"{max_steps + 1}:{count}"
        steps_run += count
    run_dir = Path(args.workdir) / f"run-{args.name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    fixed = dict(
        spool=args.spool,
        target=args.target,
        run="bench",
        run_dir=str(run_dir),
        store=None,
        save_every=10**9,
        max_steps=steps_run,
        total_steps=steps_run,
    )
    cfg = train_config_from_args(parsed, **fixed)
    t0 = time.monotonic()
    trainer = Trainer(cfg, device=args.device)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    out = {
        "variant": args.name,
        "flags": shlex.join(flags),
        **summarize(summary["history"], warmup=args.warmup, last_step=max_steps),
        "fill": round(summary["fill"], 4),
        "first_step_s": round(summary["first_step_s"], 1) if summary["first_step_s"] else None,
        "recompiles_after_warmup": summary["recompiles_after_warmup"],
        "precision": cfg.optim.resolved_precision(trainer.device.type),
        "loss_impl": cfg.step.resolved_loss_impl(trainer.device.type),
        "train_s": round(time.monotonic() - t0, 1),
    }
    profile = run_dir / "profile-r0.txt"
    if profile.exists():
        out["kernel_table"] = str(profile)
    Path(args.json).write_text(json.dumps(out))


def reference_record(ref_dir: str, preset: str, context: int, anchors: int, timeout: float) -> dict:
    """The reference step at the preset's own shape (REF_SHAPE), as ab.jsonl's "reference" record; a preset
    the reference has no shape for, or a failed run, is a record saying so (then no variant gets a ratio)."""
    if preset not in REF_SHAPES:
        return {
            "variant": "reference",
            "skipped": f"the reference step has no {preset} shape ({', '.join(REF_SHAPES)}): no ratio",
        }
    try:
        return {
            "variant": "reference",
            **run_reference(ref_dir, context, anchors, shape=preset, timeout=timeout),
        }
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        return {"variant": "reference", "shape": preset, "error": str(err)[-500:]}


def fill_master(preset: str, *, root: Path, context: int, steps: int, producers: int) -> dict:
    """The master spool, written once by producer processes (every shard before any variant trains)."""
    from dflash.common.contract.spool import Spool

    shape = PRESETS[preset]
    plan = FillPlan(
        spool=str(root),
        hidden_size=shape["hidden_size"],
        layer_ids=default_target_layer_ids(shape["num_target_layers"], 5),
        vocab_size=shape["vocab_size"],
        context_tokens=context,
        total_tokens=int((steps + 8) * context * 1.05),
        budget_bytes=int(1e15),
        producers=producers,
        seed=0,
    )
    Spool(root)
    t = time.monotonic()
    filler = SpoolFiller(plan)
    try:
        written = filler.wait()
    except BaseException:
        filler.close()
        raise
    return {"prefill_s": round(time.monotonic() - t, 1), "prefill_tokens": written}


def link_copy(master: Path, dest: Path) -> None:
    """A copy of the spool made of hard links: the trainer renames and unlinks, never writes a shard file."""
    shutil.rmtree(dest, ignore_errors=True)
    subprocess.run(["cp", "-al", str(master), str(dest)], check=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        p = argparse.ArgumentParser(prog="consumer_ab.py child")
        for name in ("--name", "--spool", "--target", "--workdir", "--json", "--device"):
            p.add_argument(name, required=True)
        p.add_argument("--steps", type=int, required=True)
        p.add_argument("--warmup", type=int, required=True)
        p.add_argument("--anchors", type=int, required=True)
        p.add_argument("--context", type=int, required=True)
        args, flags = p.parse_known_args(sys.argv[2:])
        child(args, flags[1:] if flags[:1] == ["--"] else flags)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--variant", action="append", required=True, help="NAME=FLAGS (dflash-consume's flags), repeatable"
    )
    p.add_argument("--preset", default="32b", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=80, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=10, help="steps before the measured ones")
    p.add_argument(
        "--context",
        type=int,
        default=4096,
        help="the spool's context (a variant's --context-tokens must match)",
    )
    p.add_argument("--anchors", type=int, default=256)
    p.add_argument("--device", default="cuda")
    p.add_argument("--producers", type=int, default=12)
    p.add_argument(
        "--reference",
        default=None,
        help="folder holding ref_consumer_step.py: run it first, at the preset's shape (REF_SHAPE)",
    )
    p.add_argument("--reference-timeout-s", type=int, default=120)
    p.add_argument("--variant-timeout-s", type=int, default=170)
    p.add_argument(
        "--min-variant-s", type=int, default=45, help="start no variant with less of the budget left"
    )
    p.add_argument("--budget-s", type=int, default=480, help="the whole call, from this script's start")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    t_start = time.monotonic()
    variants = [parse_variant(v) for v in args.variant]
    for name, flags in variants:  # a bad flag fails here, before minutes of prefill
        try:
            variant_parser(args.context, args.anchors).parse_args(flags)
        except SystemExit:
            raise SystemExit(
                f"variant {name}: flags {shlex.join(flags)!r} are not dflash-consume's"
            ) from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "ab.jsonl"

    def record(rec: dict) -> None:
        shown = (
            "intervals_ms",
            "intervals_gpu_busy",
            "intervals_host_wait_ms",
            "intervals_gc_ms",
            "intervals_loss",
        )
        print(
            json.dumps({k: v for k, v in rec.items() if not k.startswith("intervals_") or k in shown}),
            flush=True,
        )
        with results.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/dflash-inductor-cache")
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    ref = None
    if args.reference:
        ref = reference_record(
            args.reference, args.preset, args.context, args.anchors, args.reference_timeout_s
        )
        record(ref)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dflash-ab-"))
    target = workdir / f"target-{args.preset}"
    if not (target / "model.safetensors").exists():
        write_target_head(target, PRESETS[args.preset], linear=LINEAR_ATTENTION.get(args.preset))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    master = shm / f"dflash-ab-{os.getpid()}-master"
    copy = shm / f"dflash-ab-{os.getpid()}-run"
    try:
        max_steps = args.warmup + args.steps
        record(
            {
                "variant": "prefill",
                **fill_master(
                    args.preset,
                    root=master,
                    context=args.context,
                    steps=max_steps + 4,
                    producers=args.producers,
                ),
            }
        )
        for name, flags in variants:
            left = args.budget_s - (time.monotonic() - t_start)
            if left < args.min_variant_s:
                record(
                    {
                        "variant": name,
                        "flags": shlex.join(flags),
                        "skipped": f"{left:.0f} s of the budget left",
                    }
                )
                continue
            link_copy(master, copy)
            limit = int(min(args.variant_timeout_s, left))
            js = workdir / f"{name}.json"
            js.unlink(missing_ok=True)
            cmd = [
                "timeout",
                "-k",
                "10",
                str(limit),
                sys.executable,
                str(Path(__file__).resolve()),
                "child",
                "--name",
                name,
                "--spool",
                str(copy),
                "--target",
                str(target),
                "--workdir",
                str(workdir),
                "--json",
                str(js),
                "--device",
                args.device,
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--anchors",
                str(args.anchors),
                "--context",
                str(args.context),
                "--",
                *flags,
            ]
            t = time.monotonic()
            with open(out / f"{name}.log", "w") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
            rec = json.loads(js.read_text()) if js.exists() else {"variant": name, "flags": shlex.join(flags)}
            rec.update(
                rc=rc, wall_s=round(time.monotonic() - t, 1), preset=args.preset, context_tokens=args.context
            )
            if rec.get("ms_per_step_median") and rec.get("fill"):  # what dflash-plan --bench reads
                rec["real_tok_s"] = round(args.context * rec["fill"] / (rec["ms_per_step_median"] / 1e3))
            if rc in (124, 137):
                rec["timed_out"] = f"{limit} s"
            elif rc != 0:  # the variant's last words: its log holds the rest
                tail = [line for line in (out / f"{name}.log").read_text().splitlines() if line.strip()]
                rec["error"] = tail[-1][-300:] if tail else ""
            if (ratio := vs_reference(ref, rec)) is not None:
                rec["vs_reference"] = ratio
            if rec.get("kernel_table"):
                shutil.copy(rec["kernel_table"], out / f"{name}-kernels.txt")
            record(rec)
    finally:
        shutil.rmtree(master, ignore_errors=True)
        shutil.rmtree(copy, ignore_errors=True)
    cols = (
        "variant",
        "ms_per_step_median",
        "vs_reference",
        "gpu_busy_median",
        "fill",
        "first_step_s",
        "recompiles_after_warmup",
        "gc_ms_total",
        "alloc_retries_total",
        "peak_mem_gb_first_fifth",
        "peak_mem_gb_last_fifth",
        "wall_s",
    )
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for line in results.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("variant") not in ("prefill",):
            print("| " + " | ".join(str(rec.get(c, "")) for c in cols) + " |")


if __name__ == "__main__":
    main()
