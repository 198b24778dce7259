"""``dflash-demo``: the whole pipeline on the CPU from an embedded default, no downloads.

It materialises the tiny Qwen3 target (config + project-built tokenizer + shipped weights trained on the
standard library's text), starts a local S3 server (moto) for checkpoints, runs ``ops/run_all.sh`` with
CPU producers and consumers over the bundled chat prompts answered by the target itself, prints a
progress line every few seconds, then decodes held-out prompts with the untrained and the trained
drafter (``dflash-eval``'s loop) and prints what was trained, how much it helps and where everything is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

PROG = "dflash-demo"
REPO = Path(__file__).resolve().parents[2]
RUN = "demo"


@dataclass(frozen=True, kw_only=True)
class DemoSize:
    """How much the demo does. Sizes measured on a shared 2-core CPU box (README, docs/benchmarks.md)."""

    rows: int | None
    """Rows of the bundled conversations used (None = all 269): the held-out ones are drawn from them."""
    epochs: int
    """Passes over the training rows (dflash-produce --epochs). Measured (docs/benchmarks.md): the drafter's
    held-out τ keeps rising with steps (in-process on the demo's shards: 1.46 at 450, 1.55 at 600, 1.58 at
    900); 12 epochs of the 237 training rows are ~670 steps, 1.42-1.45 through the pipeline, in ~2 min."""
    eval_samples: int
    """Held-out rows (dflash-produce --eval-samples): spooled once, never trained, decoded before/after."""
    eval_every: int
    """Steps between the consumer's decode-order τ evaluations (also before the first and after the last)."""
    num_layers: int = 2
    """Draft layers: 2 learned as much per step as 5 in the demo's few hundred steps, and faster."""
    block_size: int = 8
    """Block 8 learned as much per step as 16 (held-out τ 1.178 vs 1.174 at 150 steps) in half the time:
    a demo's drafter accepts 1-2 tokens, so the last 8 positions of a 16-block only cost."""
    context_tokens: int = 512
    num_anchors: int = 64
    max_anchors_per_doc: int = 16
    save_every: int = 200
    lr: float = 3e-3


FULL = DemoSize(rows=None, epochs=12, eval_samples=32, eval_every=100)
QUICK = DemoSize(rows=None, epochs=2, eval_samples=16, eval_every=1000)


@dataclass(kw_only=True)
class DemoConfig:
    run_dir: Path
    quick: bool = False
    """The CI variant: fewer training rows and held-out prompts (QUICK instead of FULL)."""
    s3: bool = True
    """Checkpoints to a local moto S3 server (else a local folder)."""
    producers: int = 1
    consumers: int = 1
    real_responses: bool = False
    """Train on the bundled human-written answers instead of the target's own (learns far slower); the
    in-training decode-order τ then estimates the real one, and the summary reports the gap."""
    progress_every_s: float = 5.0

    @property
    def size(self) -> DemoSize:
        return QUICK if self.quick else FULL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalS3:
    """moto's S3 server on loopback, for the demo's checkpoints; always stopped by ``close``."""

    def __init__(self, log_path: Path) -> None:
        exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"moto_server exited early; see {log_path}") from None
                time.sleep(0.1)
        raise RuntimeError(f"moto_server did not listen on {self.url} within 30 s")

    def env(self) -> dict[str, str]:
        # Fake credentials for the local server only; real runs use the standard AWS chain.
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "demo",
            "AWS_SECRET_ACCESS_KEY": "demo-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def write_dataset(src: Path, out_dir: Path, *, rows: int | None) -> Path:
    """data.jsonl: the first `rows` conversations of `src` (all when None); the producers hold some out."""
    lines = src.read_text(encoding="utf-8").splitlines()[:rows]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "data.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out_dir / "data.jsonl"


def write_split(dataset: Path, held_out: list[int]) -> tuple[Path, Path]:
    """(train.jsonl, heldout.jsonl) next to `dataset`: its rows split by the held-out row numbers the
    producers spooled, so a user can decode the held-out prompts again with dflash-eval."""
    lines = dataset.read_text(encoding="utf-8").splitlines()
    held = set(held_out)
    train = [line for i, line in enumerate(lines) if i not in held]
    heldout = [line for i, line in enumerate(lines) if i in held]
    (dataset.parent / "train.jsonl").write_text("\n".join(train) + "\n", encoding="utf-8")
    (dataset.parent / "heldout.jsonl").write_text("\n".join(heldout) + "\n", encoding="utf-8")
    return dataset.parent / "train.jsonl", dataset.parent / "heldout.jsonl"


def _quarter_mean(recs: list[dict], key: str) -> float | None:
    """Mean of `key` over the last quarter of `recs` (one step says little: shards differ in difficulty)."""
    if not recs:
        return None
    rows = recs[-max(1, len(recs) // 4) :]
    return sum(r[key] for r in rows) / len(rows)


def summarize(run_dir: Path) -> dict:
    """What the run's metrics say: counts, training loss/τ, and rates averaged over the run."""
    from dflash.common.metrics import read_metrics
    from dflash.tools.demo.progress import (
        consumer_avg_tok_s,
        consumer_steps,
        producer_avg_tok_s,
        producer_records,
    )

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
    print(f"  checkpoint         {s['checkpoint']}")
    print(f"  drafters           {s['drafter_before']} (untrained), {s['drafter_after']} (trained)")
    print(f"  logs               {s['logs']}")
    print(f"  plots              {', '.join(s['plots']) or 'none'}")
    print(f"  wall time          {s['wall_s']:.0f} s")
    print(f"  status             dflash-status {s['run_dir']}")
    print(
        f"  try                dflash-eval --target {s['target']} --drafter {s['drafter_after']} "
        f"--dataset {s['heldout']} --baseline"
    )


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """`env` set in this process for the block (the checkpoint store reads the standard AWS variables)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _pipeline_cmd(cfg: DemoConfig, target: Path, dataset: Path, spool: Path, checkpoint: str) -> list[str]:
    z = cfg.size
    return [
        "bash",
        str(REPO / "ops" / "run_all.sh"),
        "--producers",
        f"cpu:{cfg.producers}",
        "--consumers",
        f"cpu:{cfg.consumers}",
        "--model",
        str(target),
        "--dataset",
        str(dataset),
        "--run",
        RUN,
        "--run-dir",
        str(cfg.run_dir),
        "--spool",
        str(spool),
        "--checkpoint",
        checkpoint,
        "--producer-args",
        f"--max-length {z.context_tokens} --batch-tokens 4096 --epochs {z.epochs} --eval-samples {z.eval_samples}",
        "--consumer-args",
        f"--context-tokens {z.context_tokens} --num-anchors {z.num_anchors} --max-anchors-per-doc {z.max_anchors_per_doc} "
        f"--num-layers {z.num_layers} --block-size {z.block_size} --eval-every {z.eval_every} --eval-budget 1 "
        f"--log-every 1 --save-every {z.save_every} --lr {z.lr}",
    ]


def _start_s3(run_dir: Path) -> tuple[LocalS3, str]:
    import boto3

    s3 = LocalS3(run_dir / "logs" / "moto_server.log")
    boto3.client(
        "s3",
        endpoint_url=s3.url,
        region_name="us-east-1",
        aws_access_key_id="demo",
        aws_secret_access_key="demo-secret",
    ).create_bucket(Bucket="dflash-demo")
    return s3, "s3://dflash-demo/checkpoints"


def _train(cfg: DemoConfig, target: Path, dataset: Path, spool: Path, checkpoint: str, env: dict) -> None:
    """The pipeline (run_all.sh), with a progress line from its metrics every few seconds."""
    from dflash.tools.demo.progress import ProgressPrinter

    cmd = _pipeline_cmd(cfg, target, dataset, spool, checkpoint)
    print("[demo] " + " ".join(cmd), flush=True)
    progress = ProgressPrinter(cfg.run_dir, every_s=cfg.progress_every_s).start()
    try:
        rc = subprocess.call(cmd, env=env)
    finally:
        progress.stop()
    if rc != 0:
        raise RuntimeError(f"the pipeline failed (exit {rc}); logs in {cfg.run_dir / 'logs'}")


def _evaluate(cfg: DemoConfig, target: Path, docs, checkpoint: str, env: dict) -> dict:
    """Export the untrained and the final drafter, decode the held-out documents with both."""
    import torch

    from dflash.common.drafter.hf_format import read_export_config
    from dflash.tools.demo.evaluation import evaluate_drafter, export_initial_drafter
    from dflash.tools.export.run import export_checkpoint

    drafters = cfg.run_dir / "drafters"
    z = cfg.size
    before = export_initial_drafter(
        target, drafters / "untrained", num_layers=z.num_layers, block_size=z.block_size
    )
    with _environ(env):
        after = export_checkpoint(checkpoint, RUN, drafters / "trained", dtype=torch.float32, overwrite=True)
    if asdict(read_export_config(before)) != asdict(read_export_config(after)):
        raise RuntimeError(
            "the untrained drafter's config differs from the trained one's: not a fair comparison"
        )
    say = lambda line: print(line, flush=True)  # noqa: E731
    b = evaluate_drafter(target, before, docs, say=say, label="untrained drafter")
    a = evaluate_drafter(target, after, docs, say=say, label="trained drafter")
    return {
        "tau_before": b.tau,
        "tau_after": a.tau,
        "heldout_prompts": a.prompts,
        "drafter_before": str(before),
        "drafter_after": str(after),
    }


def run_demo(cfg: DemoConfig) -> dict:
    from dflash.tools.demo.assets import demo_dataset_path, distilled_dataset_path, materialize_tiny_target

    t0 = time.monotonic()
    cfg = replace(cfg, run_dir=cfg.run_dir.resolve())
    run_dir = cfg.run_dir
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    print(f"[demo] run dir {run_dir}", flush=True)
    target = materialize_tiny_target(run_dir / "target")
    source = demo_dataset_path() if cfg.real_responses else distilled_dataset_path()
    dataset = write_dataset(source, run_dir / "data", rows=cfg.size.rows)
    print(
        f"[demo] training on {dataset} ({'human' if cfg.real_responses else 'the target'}'s answers), "
        f"{cfg.size.eval_samples} conversations held out, {cfg.size.epochs} epochs",
        flush=True,
    )
    spool = Path(tempfile.mkdtemp(prefix="dflash-spool-"))
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    s3 = None
    try:
        if cfg.s3:
            s3, checkpoint = _start_s3(run_dir)
            env.update(s3.env())
            print(f"[demo] local S3 server {s3.url} (moto), checkpoints -> {checkpoint}", flush=True)
        else:
            checkpoint = str(run_dir / "checkpoints")
        _train(cfg, target, dataset, spool, checkpoint, env)
        from dflash.tools.demo.evaluation import HeldOutDocs

        docs = HeldOutDocs.from_spool(spool)
        _, heldout = write_split(dataset, docs.sample_ids)
        summary = summarize(run_dir)
        summary["real_responses"] = cfg.real_responses
        summary["heldout"] = str(heldout)
        summary["s3_server_pid"] = s3.proc.pid if s3 is not None else None
        s3_env = s3.env() if s3 is not None else {}
        summary.update(_evaluate(cfg, target, docs, checkpoint, s3_env))
        if s3 is not None and summary["checkpoint"]:
            from dflash.common.checkpoints.store import open_store

            with _environ(s3_env):
                summary["checkpoint_latest"] = (
                    open_store(checkpoint).get_bytes(f"{RUN}/latest").decode().strip()
                )
        summary["target"] = str(target)
        summary["wall_s"] = time.monotonic() - t0
        return summary
    finally:
        if s3 is not None:
            s3.close()
        shutil.rmtree(spool, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    from dflash.common.cli.help import DefaultsHelpFormatter, plain_text

    p = argparse.ArgumentParser(prog=PROG, description=plain_text(__doc__), formatter_class=DefaultsHelpFormatter)
    p.add_argument("--run-dir", default=None, help="where logs, metrics and plots go (default: runs/demo-YYYYmmdd-HHMMSS)")
    p.add_argument("--quick", action="store_true", help="the CI variant: fewer rows, epochs and held-out prompts (~1 min)")
    p.add_argument(
        "--local-checkpoints", action="store_true", help="checkpoints to a local folder, no S3 server"
    )
    p.add_argument("--json", default=None, help="also write the summary as JSON here")
    p.add_argument(
        "--progress-every", type=float, default=5.0, metavar="S", help="seconds between progress lines"
    )
    p.add_argument(
        "--real-responses",
        action="store_true",
        help="train on the bundled human-written answers instead of the target's own greedy ones (learns slower)",
    )
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        summary = run_demo(
            DemoConfig(
                run_dir=run_dir,
                quick=args.quick,
                s3=not args.local_checkpoints,
                real_responses=args.real_responses,
                progress_every_s=args.progress_every,
            )
        )
    except (RuntimeError, OSError, ValueError) as err:  # the pipeline failed, or could not start
        print(f"{PROG}: error: {' '.join(str(err).split())}", file=sys.stderr)
        sys.exit(1)
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
