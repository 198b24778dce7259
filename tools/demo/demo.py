"""``dflash-demo``: the whole pipeline on the CPU from an embedded default, no downloads.

It materialises the tiny Qwen3 target (config + project-built tokenizer + shipped weights trained on the
standard library's text), starts a local S3 server (moto) for checkpoints, runs ``ops/run_all.sh`` with
CPU producers and consumers over the bundled chat prompts answered by the target itself, prints a
progress line every few seconds, then decodes held-out prompts with the untrained and the trained
drafter (``dflash-eval``'s loop) and prints what was trained, how much it helps and where everything is.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import boto3
import torch

from dflash.common.checkpoints.store import open_store
from dflash.common.drafter.hf_format import read_export_config
from dflash.tools.demo.assets import demo_dataset_path, distilled_dataset_path, materialize_tiny_target
from dflash.tools.demo.config import DemoConfig
from dflash.tools.demo.evaluation import HeldOutDocs, evaluate_drafter, export_initial_drafter
from dflash.tools.demo.progress import ProgressPrinter
from dflash.tools.demo.summary import summarize_run
from dflash.tools.export.run import export_checkpoint

REPO = Path(__file__).resolve().parents[2]
RUN = "demo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_this_process() -> None:
    """In the child, before exec: SIGTERM when the demo dies, however it dies (Linux)."""
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


class LocalS3:
    """moto's S3 server on loopback, for the demo's checkpoints; always stopped by ``close``.

    In a session of its own: a terminal's Ctrl-C goes to the demo's process group, and the server must
    outlive it until the pipeline's stop checkpoint is saved into it (close() stops it after that)."""

    def __init__(self, log_path: Path) -> None:
        exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_this_process if sys.platform == "linux" else None,
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
        "--keep-spool",  # the demo reads the held-out documents from it after training, then removes it
        "--producer-args",
        f"--max-length {z.context_tokens} --batch-tokens 4096 --epochs {z.epochs} --eval-samples {z.eval_samples}"
        + (f" --codec {cfg.codec}" if cfg.codec else ""),
        "--consumer-args",
        f"--context-tokens {z.context_tokens} --num-anchors {z.num_anchors} --max-anchors-per-doc {z.max_anchors_per_doc} "
        f"--num-layers {z.num_layers} --block-size {z.block_size} --eval-every {z.eval_every} --eval-budget 1 "
        f"--log-every 1 --save-every {z.save_every} --lr {z.lr} --seed {cfg.seed}",
    ]


def _start_s3(run_dir: Path) -> tuple[LocalS3, str]:

    s3 = LocalS3(run_dir / "logs" / "moto_server.log")
    boto3.client(
        "s3",
        endpoint_url=s3.url,
        region_name="us-east-1",
        aws_access_key_id="demo",
        aws_secret_access_key="demo-secret",
    ).create_bucket(Bucket="dflash-demo")
    return s3, "s3://dflash-demo/checkpoints"


class DemoStopped(Exception):
    """Ctrl-C (or SIGTERM) during the demo; the pipeline has stopped and saved its checkpoint."""


def _train(cfg: DemoConfig, target: Path, dataset: Path, spool: Path, checkpoint: str, env: dict) -> None:
    """The pipeline (run_all.sh), with a progress line from its metrics every few seconds.

    Ctrl-C reaches the pipeline too (one process group): its consumers finish the step and checkpoint. The
    demo waits for that before it stops the S3 server the checkpoint goes to (a second Ctrl-C is passed
    on as SIGTERM, which run_all.sh handles the same way), then raises DemoStopped."""
    cmd = _pipeline_cmd(cfg, target, dataset, spool, checkpoint)
    print("[demo] " + " ".join(cmd), flush=True)
    progress = ProgressPrinter(cfg.run_dir, every_s=cfg.progress_every_s).start()
    stopping = False
    proc = subprocess.Popen(cmd, env=env)
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:
                if stopping:
                    proc.send_signal(signal.SIGTERM)
                stopping = True
                print(
                    "[demo] stopping: the pipeline saves its checkpoint first (Ctrl-C again to hurry it)",
                    flush=True,
                )
    finally:
        progress.stop()
    if stopping or rc == 130:
        raise DemoStopped(
            f"stopped; the pipeline saved its checkpoint ({checkpoint}); logs in {cfg.run_dir / 'logs'}"
        )
    if rc != 0:
        raise RuntimeError(f"the pipeline failed (exit {rc}); logs in {cfg.run_dir / 'logs'}")


def _say(line: str) -> None:
    print(line, flush=True)


def _evaluate(cfg: DemoConfig, target: Path, docs, checkpoint: str, env: dict) -> dict:
    """Export the untrained and the final drafter, decode the held-out documents with both."""

    drafters = cfg.run_dir / "drafters"
    z = cfg.size
    before = export_initial_drafter(
        target, drafters / "untrained", seed=cfg.seed, num_layers=z.num_layers, block_size=z.block_size
    )
    with _environ(env):
        after = export_checkpoint(checkpoint, RUN, drafters / "trained", dtype=torch.float32, overwrite=True)
    if asdict(read_export_config(before)) != asdict(read_export_config(after)):
        raise RuntimeError(
            "the untrained drafter's config differs from the trained one's: not a fair comparison"
        )
    # Side by side: the untrained drafter decodes in a second process (one thread each, the box's two
    # cores) while this one decodes with the trained drafter; one after the other took ~50 s of the demo.
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        untrained = pool.submit(evaluate_drafter, target, before, docs, say=_say, label="untrained drafter")
        a = evaluate_drafter(target, after, docs, say=_say, label="trained drafter")
        b = untrained.result()
    return {
        "tau_before": b.tau,
        "tau_after": a.tau,
        "heldout_prompts": a.prompts,
        "drafter_before": str(before),
        "drafter_after": str(after),
    }


def _copy_latest(store_url: str, dest: Path) -> str:
    """Copy the run's latest checkpoint from the demo's S3 server into a local folder (the server stops
    with the demo: the summary's checkpoint and its commands must work after it); returns its path."""
    src, local = open_store(store_url), open_store(dest)
    name = src.get_bytes(f"{RUN}/latest").decode().strip()
    with tempfile.TemporaryDirectory(prefix="dflash-demo-ckpt-") as tmp:
        for key in src.list(f"{RUN}/{name}/"):
            path = Path(tmp) / key.rsplit("/", 1)[-1]
            src.get_file(key, path)
            local.put_file(key, path)
    local.put_bytes(f"{RUN}/latest", (name + "\n").encode())
    return local.url_for(f"{RUN}/{name}")


def run_demo(cfg: DemoConfig) -> dict:

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
    if not cfg.real_responses:
        print(
            "[demo] the target's answers are its greedy answers to the bundled prompts, written by "
            "dflash-regenerate's local engine (ops/make_demo_assets.py); for a dataset of your own: "
            "dflash-regenerate --model TARGET --dataset CHATS --out OUT.jsonl (docs/data.md)",
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

        docs = HeldOutDocs.from_spool(spool)
        _, heldout = write_split(dataset, docs.sample_ids)
        summary = summarize_run(run_dir)
        summary["real_responses"] = cfg.real_responses
        summary["codec"], summary["seed"] = cfg.codec, cfg.seed
        summary["heldout"] = str(heldout)
        summary["s3_server_pid"] = s3.proc.pid if s3 is not None else None
        s3_env = s3.env() if s3 is not None else {}
        summary.update(_evaluate(cfg, target, docs, checkpoint, s3_env))
        if s3 is not None and summary["checkpoint"]:
            with _environ(s3_env):
                summary["checkpoint_latest"] = (
                    open_store(checkpoint).get_bytes(f"{RUN}/latest").decode().strip()
                )
                summary["checkpoint_s3"] = summary["checkpoint"]
                summary["checkpoint"] = _copy_latest(checkpoint, run_dir / "checkpoints")
        summary["target"] = str(target)
        summary["wall_s"] = time.monotonic() - t0
        return summary
    finally:
        if s3 is not None:
            s3.close()
        shutil.rmtree(spool, ignore_errors=True)
