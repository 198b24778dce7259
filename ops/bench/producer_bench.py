#!/usr/bin/env python
"""Producer throughput benchmark: the real producer loop vs a bare HF forward of the same model.

Why: a producer's job is to run the target as fast as the GPU runs the target alone. This measures, in
one process on one GPU, over the same synthetic samples (lognormal lengths, random token ids):

- `hf_forward`: the bare full-model HF forward (all layers + lm_head logits), right-padded length-bucketed
  batches, nothing kept: the reference rate;
- `hf_hidden_states`: the naive extraction (`output_hidden_states=True`, gather K layers, copy to host
  synchronously), for contrast;
- `producer`: `dflash.producer.worker.produce` (hooks + early stop, pinned D2H, writer thread encoding
  zarr+zstd shards into a spool on /dev/shm, published and then deleted by a drain thread that plays
  the consumers).

Rates are real (unpadded) tokens per second; the padding waste of the buckets is reported, and the GPU
memory allocated is sampled over time (it must stay flat: fixed token budget per batch). The default
model is Qwen3-8B-shaped (hidden 4096, 36 layers, 32/8 heads, head_dim 128, inter 12288, vocab 151936)
with random bf16 weights. `--small` runs the tiny demo target on CPU (fp32) as a smoke test.

    python ops/bench/producer_bench.py --out runs/bench          # on the GPU machine
    .venv/bin/python ops/bench/producer_bench.py --small         # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from dflash.common.target.capture import LayerCapture
from dflash.common.target.data import DataConfig
from dflash.producer.buckets import BucketConfig, Bucketer, Sample
from dflash.producer.config import ProducerConfig
from dflash.producer.worker import _all_batches, produce

log = logging.getLogger(__name__)

QWEN3_8B = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def build_model(args):
    from transformers import AutoModelForCausalLM, Qwen3Config

    if args.small:
        from dflash.tools.demo.assets import build_tiny_target

        return build_tiny_target(dtype=torch.float32, seed=0), "tiny-qwen3 (demo)"
    cfg = Qwen3Config(**QWEN3_8B)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval(), "Qwen3-8B-shaped, random weights"


def _lengths(args, rng: np.random.Generator, n: int) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(args.median_len), 0.8, n), 64, args.max_length).astype(int)


def synthetic_workload(args, vocab: int) -> tuple[list[Sample], list]:
    """Samples forming only FULL batches (whole bucket pools), about args.tokens real tokens.

    A real dataset is large enough that nearly every batch is a full pool cut; a small synthetic one
    would be mostly end-of-data leftovers (small batches, launch-bound), which misrepresents steady
    state. So draw lognormal lengths until the bucketer has emitted args.tokens worth of pool cuts, and
    keep exactly those samples: re-bucketing them (as produce() does) yields the same batches.
    """
    rng = np.random.default_rng(args.seed)
    bk = Bucketer(BucketConfig(batch_tokens=args.batch_tokens, pool_batches=args.pool_batches))
    batches, total = [], 0
    while total < args.tokens:
        for n in _lengths(args, rng, 256):
            cut = bk.add(
                Sample(sample_index=0, input_ids=np.empty(int(n), np.int32), loss_mask=np.empty(0, bool))
            )
            batches.extend(cut)
            total += sum(b.num_tokens for b in cut)
    samples = []
    for b in batches:
        for s in b.samples:
            n = len(s)
            s.sample_index = len(samples)
            s.input_ids = rng.integers(0, vocab, n, dtype=np.int32)
            s.loss_mask = np.ones(n, dtype=bool)
            samples.append(s)
    return samples, batches


def padding_waste(args, num_samples: int = 20000) -> float:
    """Bucket padding waste over a long stream of the same length distribution (no model needed)."""
    bk = Bucketer(BucketConfig(batch_tokens=args.batch_tokens))
    rng = np.random.default_rng(args.seed + 1)
    for _ in _all_batches((Sample(i, np.empty(int(n), np.int32), np.empty(0, bool)) for i, n in enumerate(_lengths(args, rng, num_samples))), bk):  # fmt: skip
        pass
    return bk.padding_waste


class MemSampler(threading.Thread):
    """GPU memory allocated/reserved every `every_s`, labelled with the current phase."""

    def __init__(self, device: torch.device, every_s: float = 0.25):
        super().__init__(daemon=True)
        self.device, self.every_s = device, every_s
        self.phase = "init"
        self.series: list[dict] = []
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            if self.device.type == "cuda":
                self.series.append(
                    {
                        "t": round(time.monotonic() - self.t0, 3),
                        "phase": self.phase,
                        "alloc_gb": round(torch.cuda.memory_allocated(self.device) / 1e9, 3),
                        "reserved_gb": round(torch.cuda.memory_reserved(self.device) / 1e9, 3),
                    }
                )

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def summary(self, phase: str) -> dict:
        pts = [p["alloc_gb"] for p in self.series if p["phase"] == phase]
        if not pts:
            return {}
        k = max(1, len(pts) // 5)
        return {
            "max_alloc_gb": max(pts),
            "first_fifth_mean_gb": round(sum(pts[:k]) / k, 3),
            "last_fifth_mean_gb": round(sum(pts[-k:]) / k, 3),
            "samples": len(pts),
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _padded(batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros((len(batch.samples), batch.pad_len), dtype=torch.int64)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    for r, s in enumerate(batch.samples):
        ids[r, : len(s)] = torch.from_numpy(s.input_ids)
        valid[r, : len(s)] = True
    return ids.to(device, non_blocking=True), valid


def bench_hf(model, batches, device, layer_ids, *, hidden_states: bool) -> dict:
    """Bare forward (or the naive output_hidden_states extraction) over the batches; real tokens/s."""
    tokens = 0
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in batches:
            ids, valid = _padded(b, device)
            if hidden_states:
                hs = model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
                feats = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)[valid.to(device)]
                feats.to("cpu")  # synchronous: what a simple extraction script does
                del hs, feats
            else:
                model(input_ids=ids, use_cache=False)
            tokens += int(valid.sum())
    _sync(device)
    dt = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": round(dt, 3), "tok_s": round(tokens / dt, 1)}


def drain(ready: Path, stop: threading.Event) -> None:
    """Play the consumers: delete published shards so the spool stays under budget."""
    while not stop.is_set():
        for p in list(ready.iterdir()) if ready.is_dir() else []:
            shutil.rmtree(p, ignore_errors=True)
        time.sleep(0.05)


VARIANTS = {
    "full": "the producer as shipped (2 writer threads, 8 MB chunks)",
    "nowrite": "writers skip encoding (an empty shard dir is published): the pipeline without zarr/zstd",
    "threads1": "1 writer thread",
    "threads4": "4 writer threads",
    "chunk2m": "2 MB hidden chunks (the shard module's default)",
    "none": "codec none (no compression)",
}
_VARIANT_CFG = {
    "threads1": {"writer_threads": 1},
    "threads4": {"writer_threads": 4},
    "chunk2m": {"chunk_bytes": 2 << 20},
}


@contextlib.contextmanager
def _variant(name: str):
    """Patch the shard writer the producer's writer threads call."""
    import dflash.producer.writers as shard_mod

    orig = shard_mod.write_shard
    if name == "nowrite":
        shard_mod.write_shard = lambda path, shard, codec=None, **kw: (Path(path).mkdir(), 0)[1]
    try:
        yield
    finally:
        shard_mod.write_shard = orig


def bench_producer(
    args, model, samples, device, layer_ids, spool_root: Path, mem: MemSampler, variant: str
) -> dict:
    cfg = ProducerConfig(
        producer_id="bench", model="bench-model", spool=str(spool_root), device=str(device),
        data=DataConfig(dataset="synthetic", max_length=args.max_length),
        buckets=BucketConfig(batch_tokens=args.batch_tokens, pool_batches=args.pool_batches),
        codec="none" if variant == "none" else args.codec,
        budget_bytes=int(args.budget_gb * 1e9), heartbeat_s=0.5, **_VARIANT_CFG.get(variant, {}),
    )  # fmt: skip
    capture = LayerCapture(model, layer_ids, free_unused=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    stop = threading.Event()
    drainer = threading.Thread(target=drain, args=(spool_root / "ready", stop), daemon=True)
    drainer.start()
    beats: list[dict] = []
    mem.phase = "producer" if variant == "full" else f"producer_{variant}"
    t0 = time.perf_counter()
    try:
        with _variant(variant):
            result = produce(cfg, capture, samples, on_heartbeat=beats.append)
    finally:
        stop.set()
        drainer.join()
        capture.close()
    dt = time.perf_counter() - t0
    raw = result["tokens"] * len(layer_ids) * capture.hidden_size * 2
    return {
        "tokens": int(result["tokens"]),
        "seconds": round(dt, 3),
        "tok_s": round(result["tokens"] / dt, 1),
        "shards": int(result["shards"]),
        "padding_waste": round(result["padding_waste"], 4),
        "compression_ratio": round(raw / max(result["bytes"], 1), 3),
        "writer_busy_s": round(result.get("writer_busy_s", 0.0), 3),
        "write_s": round(result.get("write_s", 0.0), 3),
        "d2h_wait_s": round(result.get("d2h_wait_s", 0.0), 3),
        "launch_s": round(result.get("launch_s", 0.0), 3),
        "main_wait_s": round(result.get("main_wait_s", 0.0), 3),
        "budget_wait_s": round(result.get("budget_wait_s", 0.0), 3),
        "heartbeats": [
            {k: b.get(k) for k in ("elapsed_s", "tokens", "tok_s", "phase", "gpu_mem_gb", "spool_bytes")}
            for b in beats
        ],
    }


def markdown(res: dict) -> str:
    r = res["results"]
    rows = [
        ("bare HF forward (full model + lm_head)", r["hf_forward"]),
        ("naive output_hidden_states extraction", r.get("hf_hidden_states")),
        ("dflash producer (hooks + early stop + shards)", r.get("producer")),
        *(
            (f"producer variant `{v}`: {VARIANTS[v]}", r[f"producer_{v}"])
            for v in VARIANTS
            if f"producer_{v}" in r
        ),
    ]
    lines = [
        f"# Producer benchmark ({res['date']})",
        "",
        f"{res['model']} on {res['device_name']}, {res['dtype']}, {r['hf_forward']['tokens']} real tokens, "
        f"batch budget {res['args']['batch_tokens']} tokens, codec {res['args']['codec'] or 'default'}.",
        "",
        "| path | tok/s | seconds |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {name} | {row['tok_s']:,.0f} | {row['seconds']} |" for name, row in rows if row]
    p = r.get("producer") or next(v for k, v in r.items() if k.startswith("producer"))
    lines += [
        "",
        f"- **producer / bare forward = {res['ratio']:.3f}**",
        f"- padding waste of the length buckets: {res['padding_waste_20k']:.2%} over 20K samples of the same "
        f"length distribution (default pool); {p['padding_waste']:.2%} on the {res['num_batches']} timed batches",
        f"- shards: {p['shards']}, compression ratio {p['compression_ratio']}x; writers busy (sum over threads) {p['writer_busy_s']} s "
        f"of {p['seconds']} s (encode+publish {p['write_s']} s, waiting for D2H {p['d2h_wait_s']} s); main "
        f"thread: {p['launch_s']} s queueing forwards, {p['main_wait_s']} s blocked on the writer",
    ]
    for phase, m in res["gpu_memory"].items():
        if m:
            lines.append(
                f"- GPU memory allocated during {phase}: max {m['max_alloc_gb']} GB, first fifth "
                f"{m['first_fifth_mean_gb']} GB, last fifth {m['last_fifth_mean_gb']} GB ({m['samples']} samples)"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny demo target on CPU (smoke test)")
    p.add_argument("--tokens", type=int, help="real tokens per path (default 786432; --small 16384)")
    p.add_argument("--batch-tokens", type=int, help="padded tokens per forward (default 32768; --small 2048)")
    p.add_argument("--max-length", type=int, help="max sample length (default 4096; --small 512)")
    p.add_argument("--median-len", type=float, help="median sample length (default 800; --small 150)")
    p.add_argument("--codec", help="shard codec spec (default: the shard module's default)")
    p.add_argument(
        "--pool-batches", type=int, default=1, help="bucket pool size in batches (1: full batches sooner)"
    )
    p.add_argument("--budget-gb", type=float, default=16.0, help="spool budget (the drain keeps it low)")
    p.add_argument("--no-naive", action="store_true", help="skip the output_hidden_states path")
    p.add_argument(
        "--variants", default="full", help=f"producer variants, comma-separated: {', '.join(VARIANTS)}"
    )
    p.add_argument("--spool-parent", help="where the temp spool goes (default /dev/shm if present)")
    p.add_argument("--out", default="runs/bench", help="folder for producer_bench.json / .md")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    small = args.small
    defaults = dict(tokens=16384 if small else 786432, batch_tokens=2048 if small else 32768,
                    max_length=512 if small else 4096, median_len=150.0 if small else 800.0)  # fmt: skip
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        sys.exit(f"producer_bench: error: --variants {args.variants}: choose from {', '.join(VARIANTS)}")
    args.device = torch.device("cpu" if small else "cuda")
    if not small and not torch.cuda.is_available():
        sys.exit("producer_bench: error: no CUDA device (use --small for the CPU smoke test)")
    return args


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    import torch._dynamo  # noqa: F401  - first import in the main thread (threads below)

    from dflash.common.drafter.layers import default_target_layer_ids

    device = args.device
    mem = MemSampler(device)
    mem.start()
    t_build = time.perf_counter()
    model, model_desc = build_model(args)
    build_s = time.perf_counter() - t_build
    num_layers = model.config.num_hidden_layers
    layer_ids = default_target_layer_ids(num_layers)
    samples, batches = synthetic_workload(args, model.config.vocab_size)
    waste = padding_waste(args)
    log.info("%s: %d samples, %d full batches (%d real tokens); padding waste over 20K samples %.2f%%",
             model_desc, len(samples), len(batches), sum(b.num_tokens for b in batches), 100 * waste)  # fmt: skip

    # Warm-up: the largest batch through both paths (cuBLAS/cuDNN handles, allocator growth).
    mem.phase = "warmup"
    biggest = max(batches, key=lambda b: b.num_padded_tokens)
    bench_hf(model, [biggest], device, layer_ids, hidden_states=False)
    results = {}
    mem.phase = "hf_forward"
    results["hf_forward"] = bench_hf(model, batches, device, layer_ids, hidden_states=False)
    log.info("bare forward: %s", results["hf_forward"])
    if not args.no_naive:
        mem.phase = "hf_hidden_states"
        results["hf_hidden_states"] = bench_hf(model, batches, device, layer_ids, hidden_states=True)
        log.info("naive hidden states: %s", results["hf_hidden_states"])
    if device.type == "cuda":
        torch.cuda.empty_cache()

    parent = args.spool_parent or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    spool_root = Path(tempfile.mkdtemp(prefix="dflash-bench-", dir=parent)) / "spool"
    try:
        for v in args.variants:
            key = "producer" if v == "full" else f"producer_{v}"
            results[key] = bench_producer(args, model, samples, device, layer_ids, spool_root / v, mem, v)
            log.info("%s: %s", key, {k: x for k, x in results[key].items() if k != "heartbeats"})
    finally:
        shutil.rmtree(spool_root.parent, ignore_errors=True)
    mem.stop()
    main_key = "producer" if "producer" in results else f"producer_{args.variants[0]}"

    res = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": model_desc,
        "model_params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "dtype": str(next(model.parameters()).dtype),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "layer_ids": layer_ids,
        "num_samples": len(samples),
        "num_batches": len(batches),
        "padding_waste_20k": round(waste, 4),
        "build_s": round(build_s, 1),
        "args": {k: (str(v) if isinstance(v, torch.device) else v) for k, v in vars(args).items()},
        "results": results,
        "ratio": round(results[main_key]["tok_s"] / results["hf_forward"]["tok_s"], 4),
        "gpu_memory": {
            ph: mem.summary(ph)
            for ph in ("hf_forward", "hf_hidden_states", *results)
            if ph.startswith(("hf", "producer"))
        },
        "gpu_memory_series": mem.series,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "producer_bench_small" if args.small else "producer_bench"
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / f"{name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
