"""``dflash-demo``: the whole pipeline on the CPU from an embedded default, no downloads.

It materialises the tiny Qwen3 target (config + project-built tokenizer, weights from a fixed seed),
starts a local S3 server (moto) for checkpoints, runs ``ops/run_all.sh`` with CPU producers and
consumers over the bundled chat dataset, then prints what was trained and where everything is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PROG = "dflash-demo"
REPO = Path(__file__).resolve().parents[1]


@dataclass(kw_only=True)
class DemoConfig:
    run_dir: Path
    quick: bool = False
    """Kept for CI's command line; the embedded default is already short (about a minute)."""
    s3: bool = True
    """Checkpoints to a local moto S3 server (else a local folder)."""
    producers: int = 1
    consumers: int = 1
    real_responses: bool = False
    """Train on the bundled human-written answers instead of the target's own (learns far slower)."""


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


def _quick_dataset(src: Path, dst: Path, n: int) -> Path:
    with open(src) as f, open(dst, "w") as out:
        for i, line in enumerate(f):
            if i >= n:
                break
            out.write(line)
    return dst


def self_distill(
    target: Path,
    src: Path,
    dst: Path,
    *,
    limit: int,
    max_new_tokens: int = 96,
    batch: int = 64,
    passes: int = 1,
) -> Path:
    """Real-text prompts from the bundled dataset, assistant turns regenerated greedily by the target.

    This is how drafters are trained in practice (DFlash, EAGLE): the drafter must predict *the target's*
    next tokens, so the responses come from the target. It matters doubly here: the demo target has random
    weights, so its hidden states say nothing about the bundled human-written answers, while its own
    greedy continuations are exactly what its hidden states encode.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    rows = []
    with open(src) as f:
        for line in f:
            row = json.loads(line)
            prompt = []
            for m in row["messages"]:
                if m["role"] == "assistant":
                    break
                prompt.append(m)
            rows.append((row.get("id"), prompt))
            if len(rows) >= limit:
                break
    kept: list[str] = []
    # One torch thread: decoding a tiny model gains little from a second one, and on a busy 2-core box the
    # two spin against each other (measured: 128 prompts in 5 s with 1 thread, 32 s with 2; same output).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with open(dst, "w") as out:
        for i in range(0, len(rows), batch):
            chunk = rows[i : i + batch]
            texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for _, p in chunk]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                gen = model.generate(
                    **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
                )
            special = set(tok.all_special_ids)
            for (rid, prompt), ids in zip(chunk, gen[:, enc["input_ids"].shape[1] :].tolist(), strict=True):
                answer = _round_trip_prefix(tok, [i for i in ids if i not in special])
                if answer is not None:
                    messages = [*prompt, {"role": "assistant", "content": answer}]
                    kept.append(json.dumps({"id": rid, "messages": messages}))
        # More passes = the same conversations again as new rows (new sample indices): a one-epoch
        # pipeline then trains on each twice, and the summary compares like with like.
        for _ in range(passes):
            for line in kept:
                out.write(line + "\n")
    torch.set_num_threads(threads)
    return dst


def _round_trip_prefix(tok, ids: list[int], min_tokens: int = 40) -> str | None:
    """The longest prefix of the generated ``ids`` whose text tokenizes back to exactly those ids.

    Byte-level tokens can decode to text that re-tokenizes differently (split UTF-8 sequences), which
    would train the drafter on tokens the target never produced; None when the clean prefix is too short.
    """
    text = tok.decode(ids)
    back = tok(text, add_special_tokens=False)["input_ids"]
    n = 0
    while n < min(len(ids), len(back)) and ids[n] == back[n]:
        n += 1
    while n >= min_tokens:
        text = tok.decode(ids[:n])
        if tok(text, add_special_tokens=False)["input_ids"] == ids[:n]:
            return text
        n -= 1
    return None


def _quarter_mean(recs: list[dict], key: str, *, first: bool) -> float | None:
    if not recs:
        return None
    n = max(1, len(recs) // 4)
    rows = recs[:n] if first else recs[-n:]
    return sum(r[key] for r in rows) / len(rows)


def summarize(run_dir: Path) -> dict:
    from dflash.common.metrics_log import read_metrics

    path = run_dir / "metrics" / "consumer-0.jsonl"
    recs = [r for r in read_metrics(path) if "loss" in r] if path.exists() else []
    ckpts = [r for r in read_metrics(path) if r.get("event") == "checkpoint"] if path.exists() else []
    prod = []
    for p in sorted((run_dir / "metrics").glob("producer-*.jsonl")):
        rows = read_metrics(p)
        if rows:
            prod.append(rows[-1])
    out = {
        "steps": recs[-1]["step"] if recs else 0,
        "samples_trained": recs[-1]["samples"] if recs else 0,
        "tokens_produced": sum(int(r.get("tokens", 0)) for r in prod),
        "samples_produced": sum(int(r.get("samples", 0)) for r in prod),
        # first = the first step (the untrained drafter: it logs every step), last = the mean over the
        # last quarter of the steps (shards differ far more in difficulty than one step trains). Quarter
        # means at both ends moved with the order shards arrived in and once crossed.
        "loss_first": recs[0]["loss"] if recs else None,
        "loss_last": _quarter_mean(recs, "loss", first=False),
        "tau_first": recs[0]["tau"] if recs else None,
        "tau_last": _quarter_mean(recs, "tau", first=False),
        "consumer_tok_s": (sum(r["tok_s"] for r in recs[1:]) / max(1, len(recs) - 1)) if recs else None,
        "producer_tok_s": sum(float(r.get("tok_s", 0.0)) for r in prod),
        "checkpoint": ckpts[-1]["url"] if ckpts else None,
        "run_dir": str(run_dir),
        "logs": str(run_dir / "logs"),
        "plots": sorted(str(p) for p in (run_dir / "plots").glob("*.png")),
    }
    return out


def print_summary(s: dict) -> None:
    def f(x, fmt="{:.3f}"):
        return "n/a" if x is None else fmt.format(x)

    print("\n=== dflash-spool demo: what was trained ===")
    print(f"  samples produced   {s['samples_produced']}  ({s['tokens_produced']} tokens)")
    print(f"  samples trained    {s['samples_trained']}  in {s['steps']} steps")
    print(
        f"  loss               {f(s['loss_first'])} -> {f(s['loss_last'])}   (first step -> last quarter of steps)"
    )
    print(f"  tau (accept len)   {f(s['tau_first'])} -> {f(s['tau_last'])}")
    print(
        f"  throughput         producer {f(s['producer_tok_s'], '{:.0f}')} tok/s, "
        f"consumer {f(s['consumer_tok_s'], '{:.0f}')} tok/s"
    )
    print(f"  checkpoint         {s['checkpoint']}")
    print(f"  logs               {s['logs']}")
    print(f"  plots              {', '.join(s['plots']) or 'none'}")
    print(f"  status             dflash-status {s['run_dir']}")


def run_demo(cfg: DemoConfig) -> dict:
    from dflash.common.demo_assets import demo_dataset_path, materialize_tiny_target

    run_dir = cfg.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    print(f"[demo] run dir {run_dir}")
    target = materialize_tiny_target(run_dir / "target")
    dataset = demo_dataset_path()
    if cfg.real_responses:
        if cfg.quick:
            dataset = _quick_dataset(dataset, run_dir / "demo_chat_quick.jsonl", 160)
    else:
        print("[demo] regenerating the assistant turns with the target (self-distillation)")
        # 96 new tokens: a random target's longer continuations wander into text its features barely
        # determine, and the demo's curves would then show the data's mix more than the training.
        dataset = self_distill(
            target,
            dataset,
            run_dir / "demo_chat_distilled.jsonl",
            limit=320,
            max_new_tokens=96,
        )
    spool = Path(tempfile.mkdtemp(prefix="dflash-spool-"))
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    s3 = None
    try:
        if cfg.s3:
            s3 = LocalS3(run_dir / "logs" / "moto_server.log")
            env.update(s3.env())
            import boto3

            boto3.client(
                "s3",
                endpoint_url=s3.url,
                region_name="us-east-1",
                aws_access_key_id="demo",
                aws_secret_access_key="demo-secret",
            ).create_bucket(Bucket="dflash-demo")
            checkpoint = "s3://dflash-demo/checkpoints"
            print(f"[demo] local S3 server {s3.url} (moto), checkpoints -> {checkpoint}")
        else:
            checkpoint = str(run_dir / "checkpoints")
        cmd = [
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
            "demo",
            "--run-dir",
            str(run_dir),
            "--spool",
            str(spool),
            "--checkpoint",
            checkpoint,
            "--producer-args",
            "--max-length 512 --batch-tokens 4096",
            "--consumer-args",
            "--context-tokens 512 --num-anchors 32 --max-anchors-per-doc 8 --log-every 1 --save-every 40 "
            "--lr 1e-3 --total-steps 70",
        ]
        print("[demo] " + " ".join(cmd))
        rc = subprocess.call(cmd, env=env)
        if rc != 0:
            raise RuntimeError(f"the pipeline failed (exit {rc}); logs in {run_dir / 'logs'}")
        summary = summarize(run_dir)
        summary["s3_server_pid"] = s3.proc.pid if s3 is not None else None
        if s3 is not None and summary["checkpoint"]:
            from dflash.common.checkpoint_store import open_store

            old = {k: os.environ.get(k) for k in s3.env()}
            os.environ.update(s3.env())
            try:
                store = open_store(checkpoint)
                summary["checkpoint_latest"] = store.get_bytes("demo/latest").decode().strip()
            finally:
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        return summary
    finally:
        if s3 is not None:
            s3.close()
        shutil.rmtree(spool, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default=None, help="default: runs/demo-YYYYmmdd-HHMMSS")
    p.add_argument("--quick", action="store_true", help="the CI variant (currently the same run)")
    p.add_argument(
        "--local-checkpoints", action="store_true", help="checkpoints to a local folder, no S3 server"
    )
    p.add_argument("--json", default=None, help="also write the summary as JSON here")
    p.add_argument(
        "--real-responses",
        action="store_true",
        help="train on the bundled answers, not the target's regenerated ones",
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
