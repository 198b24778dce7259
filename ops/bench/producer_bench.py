#!/usr/bin/env python
"""Producer throughput benchmark: the real producer loop, compiled or not, vs a bare HF forward of the same
model on the same samples, in one process on one GPU.

Paths (rates are real, unpadded tokens per second; the same length-bucketed synthetic samples, lognormal
lengths, random ids, unless a variant needs other batches):
- ``hf_forward``: the bare full-model HF forward (all layers + lm_head), eager: the reference rate;
- ``hf_hidden_states`` (``--naive``): ``output_hidden_states`` gathered and copied synchronously;
- ``forward``: the shipped producer's own forward alone (the compiled trunk cut after its last captured
  layer, inputs copied in, features gathered; no D2H, no shards): what the spool must never slow down;
- ``producer_<variant>``: ``dflash.producer.loop.produce`` (compiled trunk warmed first, pinned D2H,
  writer threads encoding zarr+zstd shards into a spool on /dev/shm, deleted by a drain thread that plays
  the consumers), one row per ``--variants`` entry (VARIANTS below).

The JSON/markdown carry every figure, GPU memory over time per path, compile seconds, recompiles after
warm-up, and the producer's acceptance checks with their thresholds (ACCEPT). Presets (ops/bench/
targets.py): ``8b`` (default), ``32b``, ``hybrid27b`` (8-layer slice; rates also scaled to 64 layers).

    python ops/bench/producer_bench.py --preset 8b --variants eager,full,static,trunk --out $OUT   # GPU
    python ops/bench/producer_bench.py --preset hybrid27b --variants full,reference --no-bare       # GPU
    python ops/bench/producer_bench.py --preset hybrid27b --layers 64 --variants full,fp8target \
        --forward-variants fp8target --no-bare                                                   # GPU: FP8 target
    .venv/bin/python ops/bench/producer_bench.py --small                                          # CPU smoke
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_check import kernel_check  # noqa: E402
from kernel_window import KernelWindow  # noqa: E402
from targets import PRESETS, build_target, depth_scale, full_depth  # noqa: E402

import dflash.producer.loop as loop_module  # noqa: E402
from dflash.common.drafter.layers import default_target_layer_ids  # noqa: E402
from dflash.common.target.capture import LayerCapture  # noqa: E402
from dflash.common.target.data import DataConfig  # noqa: E402
from dflash.common.target.fp8 import fp8_matmul_unavailable  # noqa: E402
from dflash.common.target.kernels import (  # noqa: E402
    force_reference_kernels,
    linear_attention_kernels,
    prefer_fast_kernels,
)
from dflash.common.target.loading import fp8_target  # noqa: E402
from dflash.producer.buckets import BucketConfig, Bucketer, Sample  # noqa: E402
from dflash.producer.compile_plan import static_buckets  # noqa: E402
from dflash.producer.config import ProducerConfig, TrunkCompileConfig, Worker, writer_threads_for  # noqa: E402
from dflash.producer.launch import cores_per_gpu  # noqa: E402
from dflash.producer.loop import forward_batch, produce  # noqa: E402
from dflash.producer.trunk import warm_trunk  # noqa: E402

log = logging.getLogger(__name__)

VARIANTS: dict[str, tuple[str, dict]] = {
    "full": ("as shipped: compiled trunk (per layer, dynamic shapes), writers from the cores", {}),
    "eager": ("target eager (--no-compile)", {"compile": False}),
    "static": (
        "compiled, static shapes (a graph per bucket shape, 4 buckets/octave)",
        {"compile_shapes": "static"},
    ),
    "trunk": ("compiled, the whole truncated trunk as one graph", {"compile_scope": "trunk"}),
    "reference": ("as shipped, the hybrid's linear attention on the torch reference kernels", {}),
    "nowrite": ("writers skip encoding (an empty shard dir is published)", {}),
    "threads2": ("2 writer threads", {"writer_threads": 2}),
    "threads6": ("6 writer threads", {"writer_threads": 6}),
    "none": ("codec none (no compression)", {"codec": "none"}),
    "bf16": ("as shipped, bf16 shards (codec zstd:1:shuffle)", {"codec": "zstd:1:shuffle"}),
    "fp8": (
        "as shipped, FP8 shards (codec fp8: e4m3 quantized on the GPU before the D2H copy)",
        {"codec": "fp8"},
    ),
    # converts the shared model in place (its bf16 weights freed: a 64-layer hybrid-27B fits one H100 only
    # so), hence always the last variant
    "fp8target": (
        "as shipped, FP8 target (--target-precision fp8: e4m3 linears, torch._scaled_mm rowwise)",
        {},
    ),
}
# the producer's acceptance: (check, threshold, what); the ratio names are keys of the result's "ratios"
ACCEPT = {
    "8b": [("full_vs_bare", 1.3, "producer >= 1.3x the bare eager full forward")],
    "32b": [("full_vs_bare", 1.2, "producer >= 1.2x the bare eager full forward")],
    "hybrid27b": [
        ("full_vs_reference", 1.5, "fast kernels >= 1.5x the reference kernels"),
        ("full_tok_s_full_depth", 9000, "producer >= 9,000 tok/s at 64 layers (2.1x the replaced system)"),
    ],
}
FIRST_SHARD_S = 180  # a producer with default flags publishes its first shard within 3 minutes of starting
COMMON_ACCEPT = [
    ("full_vs_forward", 0.95, "producer >= 0.95x its own truncated forward (the spool never limits)"),
    ("fp8_vs_bf16", 0.98, "FP8 shards not slower than bf16 shards (>= 0.98x: a run's noise)"),
    ("host_bytes_bf16_over_fp8", 1.9, "FP8 hands the host ~half the bytes (D2H, pinned buffers)"),
    ("fp8target_vs_full", 1.5, "FP8 target >= 1.5x the bf16 target's producer (same call)"),
    ("fp8target_vs_forward", 0.95, "FP8-target producer >= 0.95x its own truncated forward"),
]


def workload(args, vocab: int, buckets: BucketConfig) -> tuple[list[Sample], list]:
    """Samples forming only FULL bucket pools under ``buckets``, about args.tokens real tokens (a real
    dataset is nearly all full-pool batches; a small synthetic one would be end-of-data leftovers)."""
    rng = np.random.default_rng(args.seed)
    bk = Bucketer(buckets)
    batches, total = [], 0
    while total < args.tokens:
        for n in np.clip(rng.lognormal(np.log(args.median_len), 0.8, 256), 64, args.max_length).astype(int):
            cut = bk.add(Sample(0, np.empty(int(n), np.int32), np.empty(0, bool)))
            batches += cut
            total += sum(b.num_tokens for b in cut)
    samples = [s for b in batches for s in b.samples]
    for i, s in enumerate(samples):
        s.sample_index, s.input_ids = i, rng.integers(0, vocab, len(s), dtype=np.int32)
        s.loss_mask = np.ones(len(s), dtype=bool)
    return samples, batches


class MemSampler(threading.Thread):
    """GPU memory allocated every `every_s`, labelled with the current phase."""

    def __init__(self, device: torch.device, every_s: float = 0.25):
        super().__init__(daemon=True)
        self.device, self.every_s, self.phase, self.series = device, every_s, "init", []
        self.t0, self._halt = time.monotonic(), threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            if self.device.type == "cuda":
                gb = round(torch.cuda.memory_allocated(self.device) / 1e9, 3)
                reserved = round(torch.cuda.memory_reserved(self.device) / 1e9, 3)
                self.series.append(
                    {
                        "t": round(time.monotonic() - self.t0, 3),
                        "phase": self.phase,
                        "alloc_gb": gb,
                        "reserved_gb": reserved,
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
        first, last = sum(pts[:k]) / k, sum(pts[-k:]) / k
        reserved = [p.get("reserved_gb", 0) for p in self.series if p["phase"] == phase]
        return {
            "max_alloc_gb": max(pts),
            "max_reserved_gb": max(reserved),
            "first_fifth_mean_gb": round(first, 3),
            "last_fifth_mean_gb": round(last, 3),
            "flat": last <= 1.05 * first + 0.5,
            "samples": len(pts),
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, tokens: int, fn) -> dict:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    dt = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": round(dt, 3), "tok_s": round(tokens / dt, 1)}


def bench_hf(model, batches, device, layer_ids, *, hidden_states: bool) -> dict:
    """Bare forward (or the naive output_hidden_states extraction) over the batches."""

    def run():
        with torch.inference_mode():
            for b in batches:
                ids = torch.zeros((len(b.samples), b.pad_len), dtype=torch.int64)
                valid = torch.zeros_like(ids, dtype=torch.bool)
                for r, s in enumerate(b.samples):
                    ids[r, : len(s)], valid[r, : len(s)] = torch.from_numpy(s.input_ids), True
                ids = ids.to(device, non_blocking=True)
                if hidden_states:
                    hs = model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
                    torch.cat([hs[i + 1] for i in layer_ids], dim=-1)[valid.to(device)].to("cpu")
                else:
                    model(input_ids=ids, use_cache=False)

    return _timed(device, sum(b.num_tokens for b in batches), run)


def bench_forward(trunk, batches, device, window: KernelWindow | None = None) -> dict:
    """The producer's own forward alone, as produce() calls it (pinned H2D, trunk, gather), nothing kept;
    ``window`` profiles some of its batches."""
    step = window.wrap(forward_batch) if window else forward_batch

    def run():
        with torch.inference_mode():
            for b in batches:
                step(trunk, b, device, 0)
            if window:
                window.finish()

    return _timed(device, sum(b.num_tokens for b in batches), run)


def first_tokens(samples: list[Sample], tokens: int | None) -> list[Sample]:
    """The leading samples holding about ``tokens`` real tokens (all of them for None)."""
    if tokens is None:
        return samples
    total = np.cumsum([len(s) for s in samples])
    return samples[: int(np.searchsorted(total, tokens)) + 1]


def producer_batches(samples: list[Sample], buckets: BucketConfig, tokens: int | None = None) -> list:
    """The batches produce() makes of ``samples`` under the trunk's bucket config (rows rounded for fla),
    so the forward alone runs exactly the producer's shapes; the first ``tokens`` worth, when given."""
    bk = Bucketer(buckets)
    out = [b for s in samples for b in bk.add(s)] + bk.flush()
    if tokens is not None:
        total = np.cumsum([b.num_tokens for b in out])
        out = out[: int(np.searchsorted(total, tokens)) + 1]
    return out


def _window(args, label: str) -> KernelWindow | None:
    """A kernel table over ``--profile-batches FIRST:COUNT`` of a path (None without the flag)."""
    if not args.profile_batches:
        return None
    first, count = (int(x) for x in args.profile_batches.split(":"))
    return KernelWindow(
        first, count, args.device, Path(args.out) / f"profile_{args.preset}_{label}.txt", label
    )


def drain(ready: Path, stop: threading.Event, seen: dict) -> None:
    """Play the consumers: delete published shards so the spool stays under budget; ``seen["first"]``:
    when the first shard was seen published (time.perf_counter)."""
    while not stop.is_set():
        for p in list(ready.iterdir()) if ready.is_dir() else []:
            seen.setdefault("first", time.perf_counter())
            shutil.rmtree(p, ignore_errors=True)
        time.sleep(0.05)


def _config(args, variant: str, spool: Path) -> tuple[ProducerConfig, Worker]:
    over = dict(VARIANTS[variant][1])
    buckets = BucketConfig(batch_tokens=args.batch_tokens, pool_batches=args.pool_batches)
    cfg = ProducerConfig(
        model="bench-model",
        data=DataConfig(dataset="synthetic", max_length=args.max_length),
        buckets=buckets,
        codec=over.pop("codec", args.codec),
        heartbeat_s=0.5,
        compile_options=TrunkCompileConfig(
            compile_backend=args.compile_backend,
            **{k: over.pop(k) for k in list(over) if k.startswith("compile")},
        ),
    )
    worker = Worker(
        producer_id="bench",
        spool=str(spool),
        device=str(args.device),
        budget_bytes=int(args.budget_gb * 1e9),
        writer_threads=over.pop("writer_threads", args.writer_threads or _shipped_writers(args)),
    )
    return cfg, worker


def _shipped_writers(args) -> int:
    """The writer threads dflash-produce starts on this machine (producer/launch.py: the writer rule over this
    process's cores per GPU). Leaving the config's None here once benched 2 writers where a launch on a
    16-core H200 host starts 4: the shipped path measured writer-bound (29.9 K tok/s against its own
    forward's 44.3 K)."""
    on_gpu = str(args.device).startswith("cuda")
    return writer_threads_for(
        cores_per_gpu(
            [Worker(producer_id="bench", rank=0, device=str(args.device), cuda_index=0 if on_gpu else None)]
        )
    )


def bench_producer(args, model, work, spool: Path, mem: MemSampler, variant: str) -> dict:
    """One producer variant: warm its trunk on the workload's lengths, produce, report (and, for the
    shipped variant, time its own forward alone on the same batches)."""
    cfg, worker = _config(args, variant, spool)
    samples, _ = work["static" if variant == "static" else "default"]
    if variant in args.variant_tokens:
        samples = first_tokens(samples, args.variant_tokens[variant])
    undo = force_reference_kernels(model) if variant == "reference" else (lambda: None)
    torch._dynamo.reset()  # a variant compiles its own graphs (dynamo caches per code object)
    stop, beats, seen = threading.Event(), [], {}
    fp8_error = None
    if variant == "fp8target":
        probe = error_batch(samples, args.device)
        fp8_error = {"bf16": layer_features(model, args.layer_ids, probe)}
    drainer = threading.Thread(target=drain, args=(spool / "ready", stop, seen), daemon=True)
    drainer.start()
    t_start = time.perf_counter()  # the first-shard clock: warm-up (compile, autotune) included
    if variant == "fp8target":  # as dflash-produce loads it: every decoder linear to FP8, in place
        why = fp8_matmul_unavailable(str(args.device))
        if why:
            log.warning(
                "fp8target: %s: %s", why, "FP8 emulated (quantize -> dequantize): its numbers, not its speed"
            )
        how = fp8_target(model, emulate=why is not None, dtype=next(model.parameters()).dtype)
        log.info("fp8target: %s", how)
    trunk = warm_trunk(
        cfg,
        worker,
        LayerCapture(model, args.layer_ids, free_unused=True),
        linear_attention_kernels(model),
        [len(s) for s in samples],
    )
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    mem.phase = f"producer_{variant}"
    window = _window(args, f"producer_{variant}")
    t0 = time.perf_counter()
    real_forward = loop_module.forward_batch
    try:
        if variant == "nowrite":
            import dflash.producer.writers as writers_mod

            real, writers_mod.write_shard = (
                writers_mod.write_shard,
                lambda path, shard, codec=None, **kw: (Path(path).mkdir(), 0)[1],
            )
        if window:
            loop_module.forward_batch = window.wrap(real_forward)
        result = produce(cfg, worker, trunk, samples, on_heartbeat=beats.append)
        if window:
            window.finish()
    finally:
        loop_module.forward_batch = real_forward
        if variant == "nowrite":
            writers_mod.write_shard = real
        stop.set()
        drainer.join()
    dt = time.perf_counter() - t0
    out = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items()}
    # the rate over the production loop (produce_s: after the pinned buffers are allocated and the writers
    # started, seconds that a long run amortizes and a 5-second one would not); seconds: the whole call
    out.update(trunk.report())
    out["first_shard_s"] = round(seen["first"] - t_start, 2) if "first" in seen else None
    # the host's share: bytes of features (and FP8 scales) copied to the host per token, the pinned buffers
    out["host_bytes_per_token"] = round(result["host_bytes"] / max(1, result["fwd_tokens"]), 1)
    out.update(
        seconds=round(dt, 3),
        tok_s=round(result["tokens"] / result["produce_s"], 1),
        writer_threads=worker.writer_threads,
        compression_ratio=round(result["tokens"] * trunk.feature_size * 2 / result["bytes"], 3)
        if result["bytes"]
        else None,
        heartbeats=[
            {k: b.get(k) for k in ("elapsed_s", "tokens", "tok_s", "gpu_mem_gb", "spool_bytes")}
            for b in beats
        ],
    )
    if window:
        out["profile"] = window.result
    if variant in args.forward_variants and "forward" in args.paths:
        mem.phase = f"forward_{variant}"
        fwd_window = _window(args, f"forward_{variant}")
        fwd_batches = producer_batches(samples, trunk.bucket_config(cfg.buckets), args.forward_tokens)
        out["own_forward"] = bench_forward(trunk, fwd_batches, args.device, fwd_window)
        if fwd_window:
            out["own_forward"]["profile"] = fwd_window.result
    trunk.close()
    undo()
    if fp8_error is not None:
        out["precision"] = how
        out["hidden_rel_l2"] = rel_l2_per_layer(
            fp8_error["bf16"], layer_features(model, args.layer_ids, probe), args.layer_ids
        )
    return out


def error_batch(samples: list[Sample], device: torch.device, rows: int = 4) -> torch.Tensor:
    """[rows, length] ids of the workload's first samples cut to the shortest: the FP8 error's batch."""
    picked = samples[:rows]
    n = min(len(s) for s in picked)
    return torch.tensor(np.stack([s.input_ids[:n] for s in picked]), dtype=torch.int64, device=device)


def layer_features(model, layer_ids: list[int], ids: torch.Tensor) -> torch.Tensor:
    """The captured layers' hidden states [T, K*H] of ``ids`` (eager, no compile), kept in fp32."""
    capture = LayerCapture(model, layer_ids, free_unused=True)
    try:
        with torch.inference_mode():
            return capture.run(ids).float()
    finally:
        capture.close()


def rel_l2_per_layer(ref: torch.Tensor, got: torch.Tensor, layer_ids: list[int]) -> dict:
    """||got - ref|| / ||ref|| per captured layer (features [T, K*H])."""
    k = len(layer_ids)
    r, g = ref.view(ref.shape[0], k, -1), got.view(got.shape[0], k, -1)
    return {
        str(i): round(float((g[:, j] - r[:, j]).norm() / r[:, j].norm()), 5) for j, i in enumerate(layer_ids)
    }


def ratios(results: dict, scale: float) -> dict:
    r, out = results, {}
    full = r.get("producer_full", {}).get("tok_s")
    if full:
        out["full_tok_s_full_depth"] = full * scale
    if full and "hf_forward" in r:
        out["full_vs_bare"] = full / r["hf_forward"]["tok_s"]
    if full and "own_forward" in r.get("producer_full", {}):
        out["full_vs_forward"] = full / r["producer_full"]["own_forward"]["tok_s"]
    for v in VARIANTS:
        if v != "full" and full and f"producer_{v}" in r:
            out[f"full_vs_{v}"] = full / r[f"producer_{v}"]["tok_s"]
    fp8t = r.get("producer_fp8target", {})
    if fp8t.get("tok_s") and full:
        out["fp8target_vs_full"] = fp8t["tok_s"] / full
    if fp8t.get("tok_s") and "own_forward" in fp8t:
        out["fp8target_vs_forward"] = fp8t["tok_s"] / fp8t["own_forward"]["tok_s"]
    fp8, bf16 = r.get("producer_fp8", {}), r.get("producer_bf16", {})
    if fp8.get("tok_s") and bf16.get("tok_s"):
        out["fp8_vs_bf16"] = fp8["tok_s"] / bf16["tok_s"]
        out["host_bytes_bf16_over_fp8"] = bf16["host_bytes_per_token"] / fp8["host_bytes_per_token"]
    return {k: round(v, 4) for k, v in out.items()}


def acceptance(res: dict) -> list[dict]:
    checks = []
    for key, threshold, what in ACCEPT.get(res["preset"], []) + COMMON_ACCEPT:
        value = res["ratios"].get(key)
        checks.append(
            {
                "check": what,
                "key": key,
                "value": value,
                "threshold": threshold,
                "ok": None if value is None else value >= threshold,
            }
        )
    first = {k: v.get("first_shard_s") for k, v in res["results"].items() if k.startswith("producer_")}
    checks.append(
        {
            "check": f"first shard <= {FIRST_SHARD_S} s after the producer's start (warm-up included)",
            "value": first,
            "threshold": FIRST_SHARD_S,
            "ok": all(v is not None and v <= FIRST_SHARD_S for v in first.values()) if first else None,
        }
    )
    compiled = {
        k: v["recompiles"]
        for k, v in res["results"].items()
        if k.startswith("producer_") and v.get("compile_scope")
    }
    checks.append(
        {
            "check": "0 recompiles after warm-up",
            "value": compiled,
            "threshold": 0,
            "ok": all(n == 0 for n in compiled.values()),
        }
    )
    if "kernel_check" in res["results"]:
        kc = res["results"]["kernel_check"]
        checks.append(
            {
                "check": f"fla as accurate as the reference kernels on {kc['layers']} layers ({kc['bound']})",
                "value": {"worst_ratio": kc["worst_ratio"], "per_layer": kc["per_layer"]},
                "ok": kc["ok"],
            }
        )
    flat = {k: m["flat"] for k, m in res["gpu_memory"].items() if m and k != "kernel_check"}
    checks.append(
        {
            "check": "GPU memory flat (last fifth <= 1.05 x first fifth + 0.5 GB)",
            "value": flat,
            "ok": all(flat.values()) if flat else None,
        }
    )
    return checks


def markdown(res: dict) -> str:
    rows = [
        (k, VARIANTS.get(k.removeprefix("producer_"), (k, None))[0], v)
        for k, v in res["results"].items()
        if "tok_s" in v
    ]
    lines = [
        f"# Producer benchmark, {res['model']} ({res['date']})",
        "",
        f"{res['device_name']}, {res['dtype']}, torch {res['torch']}, transformers {res['transformers']}; "
        f"batch budget {res['args']['batch_tokens']} tokens; layers {res['layer_ids']}",
        "",
        "| path | tok/s | seconds | warm-up s | first shard s | recompiles | host B/token | pinned MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, desc, v in rows:
        pinned = f"{v['pinned_bytes'] / 1e6:,.0f}" if "pinned_bytes" in v else ""
        lines.append(
            f"| {key}: {desc} | {v['tok_s']:,.0f} | {v['seconds']} | {v.get('compile_s', '')} | {v.get('first_shard_s', '')} "
            f"| {v.get('recompiles', '')} | {v.get('host_bytes_per_token', '')} | {pinned} |"
        )
        if "own_forward" in v:
            lines.append(
                f"| {key}: its own forward alone | {v['own_forward']['tok_s']:,.0f} | {v['own_forward']['seconds']} | | | | | |"
            )
    fp8t = res["results"].get("producer_fp8target", {})
    if "hidden_rel_l2" in fp8t:
        lines += [
            "",
            f"FP8 target ({fp8t['precision']}): its captured hidden states against the unquantized target's (--dtype), same batch",
            "",
            "| layer | relative L2 |",
            "| ---: | ---: |",
        ]
        lines += [f"| {k} | {v:.4f} |" for k, v in fp8t["hidden_rel_l2"].items()]
    if res["depth_scale"] != 1:
        lines += [
            "",
            f"- slice of {res['layers']} layers: rates x {res['depth_scale']:.4f} = at {res['full_depth']} layers",
        ]
    lines += ["", "Acceptance:"]
    lines += [
        f"- {'PASS' if c['ok'] else 'FAIL' if c['ok'] is False else 'n/a'}: {c['check']}: {c['value']}"
        for c in res["acceptance"]
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="the tiny demo shape on CPU (smoke test)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="target shape (default 8b; --small: small)")
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's; hybrid27b: 8)")
    p.add_argument(
        "--variants", default="full", help=f"producer variants, comma-separated: {', '.join(VARIANTS)}"
    )
    p.add_argument("--no-bare", action="store_true", help="skip the bare HF forward")
    p.add_argument("--no-forward", action="store_true", help="skip timing the producer's own forward alone")
    p.add_argument(
        "--forward-variants",
        default="full",
        help="variants whose own forward alone is timed (comma-separated)",
    )
    p.add_argument(
        "--forward-tokens",
        type=int,
        help="time the own forward over the producer's first batches of this many tokens",
    )
    p.add_argument(
        "--variant-tokens",
        default="",
        help="VARIANT=TOKENS,...: run those variants over the workload's first TOKENS real tokens only",
    )
    p.add_argument(
        "--profile-batches",
        help="FIRST:COUNT: a kernel table (torch.profiler) of those batches of each producer variant and of "
        "its own forward, side by side (profile_<preset>_*.txt in --out)",
    )
    p.add_argument(
        "--kernel-check-layers",
        type=int,
        default=0,
        help="hybrid: check fla and the reference kernels (bf16) against an fp32 forward on a slice this deep "
        "(kernel_check.py; 0: skip)",
    )
    p.add_argument("--naive", action="store_true", help="also time the naive output_hidden_states extraction")
    p.add_argument("--tokens", type=int, help="real tokens per path (default 262144; --small 8192)")
    p.add_argument("--batch-tokens", type=int, help="padded tokens per forward (default 32768; --small 2048)")
    p.add_argument("--max-length", type=int, help="max sample length (default 4096; --small 512)")
    p.add_argument("--median-len", type=float, help="median sample length (default 800; --small 150)")
    p.add_argument(
        "--pool-batches", type=int, default=1, help="bucket pool size in batches (1: full batches sooner)"
    )
    p.add_argument(
        "--compile-backend", default="auto", help="auto (inductor on CUDA, eager on CPU) | aot_eager | ..."
    )
    p.add_argument(
        "--writer-threads", type=int, help="default: the producer's rule from this machine's cores"
    )
    p.add_argument("--codec", help="shard codec spec (default: the shard module's default)")
    p.add_argument("--budget-gb", type=float, default=16.0, help="spool budget (the drain keeps it low)")
    p.add_argument("--spool-parent", help="where the temp spool goes (default /dev/shm if present)")
    p.add_argument("--out", default="runs/bench", help="folder for producer_bench_<preset>.json / .md")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.preset = args.preset or ("small" if args.small else "8b")
    small = args.small
    for k, v in dict(
        tokens=8192 if small else 262144,
        batch_tokens=2048 if small else 32768,
        max_length=512 if small else 4096,
        median_len=150.0 if small else 800.0,
    ).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.forward_variants = {v.strip() for v in args.forward_variants.split(",") if v.strip()}
    args.variant_tokens = {k: int(v) for k, v in (x.split("=") for x in args.variant_tokens.split(",") if x)}
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        sys.exit(f"producer_bench: error: --variants {args.variants}: choose from {', '.join(VARIANTS)}")
    if "fp8target" in args.variants[:-1]:
        sys.exit("producer_bench: error: --variants: fp8target must come last (it converts the shared model)")
    args.paths = {"bare"} - ({"bare"} if args.no_bare else set()) | (
        {"forward"} - ({"forward"} if args.no_forward else set())
    )
    args.device = torch.device("cpu" if small else "cuda")
    if not small and not torch.cuda.is_available():
        sys.exit("producer_bench: error: no CUDA device (use --small for the CPU smoke test)")
    return args


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    import transformers

    device, mem = args.device, MemSampler(args.device)
    mem.start()
    if device.type == "cuda":
        prefer_fast_kernels()  # as dflash-produce loads a target: fla imported first, set to reuse its tuning
    results: dict = {}
    t_build = time.perf_counter()
    model = build_target(args.preset, layers=args.layers, device=str(device))
    build_s = time.perf_counter() - t_build
    layers = model.config.num_hidden_layers
    args.layer_ids = default_target_layer_ids(layers)
    base = BucketConfig(batch_tokens=args.batch_tokens, pool_batches=args.pool_batches)
    work = {"default": workload(args, model.config.vocab_size, base)}
    if "static" in args.variants:
        work["static"] = workload(args, model.config.vocab_size, static_buckets(base))
    batches = work["default"][1]
    kernels = linear_attention_kernels(model)
    log.info(
        "%s x %d layers: %d batches, %d real tokens; kernels %s",
        args.preset,
        layers,
        len(batches),
        sum(b.num_tokens for b in batches),
        kernels.line() if kernels else "-",
    )
    meta = {
        "preset": args.preset,
        "model": f"{args.preset}-shaped ({layers} layers), random weights",
        "layers": layers,
        "full_depth": full_depth(args.preset),
        "depth_scale": round(depth_scale(args.preset, layers), 6),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "dtype": str(next(model.parameters()).dtype),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kernels": kernels.kernels if kernels else None,
        "layer_ids": args.layer_ids,
        "num_batches": len(batches),
        "build_s": round(build_s, 1),
        "args": {k: (str(v) if isinstance(v, torch.device | set) else v) for k, v in vars(args).items()},
    }

    def report(final: bool) -> None:
        """The JSON and markdown of what has finished so far (a call cut at its limit keeps them)."""
        res = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            **meta,
            "complete": final,
            "results": results,
            "ratios": ratios(results, meta["depth_scale"]),
            "gpu_memory": {
                ph: mem.summary(ph) for ph in sorted({p["phase"] for p in mem.series} - {"init", "warmup"})
            },
            "gpu_memory_series": mem.series,
        }
        res["acceptance"] = acceptance(res)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"producer_bench_{args.preset}.json").write_text(json.dumps(res, indent=1))
        md = markdown(res)
        (out / f"producer_bench_{args.preset}.md").write_text(md)
        if final:
            print(md)

    if "bare" in args.paths:
        mem.phase = "warmup"
        bench_hf(
            model,
            [max(batches, key=lambda b: b.num_padded_tokens)],
            device,
            args.layer_ids,
            hidden_states=False,
        )
        mem.phase = "hf_forward"
        results["hf_forward"] = bench_hf(model, batches, device, args.layer_ids, hidden_states=False)
        if args.naive:
            mem.phase = "hf_hidden_states"
            results["hf_hidden_states"] = bench_hf(model, batches, device, args.layer_ids, hidden_states=True)
        report(False)
    parent = args.spool_parent or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    spool_root = Path(tempfile.mkdtemp(prefix="dflash-bench-", dir=parent))
    try:
        for v in args.variants:
            results[f"producer_{v}"] = bench_producer(args, model, work, spool_root / v, mem, v)
            log.info(
                "producer_%s: %s", v, {k: x for k, x in results[f"producer_{v}"].items() if k != "heartbeats"}
            )
            report(False)
    finally:
        shutil.rmtree(spool_root, ignore_errors=True)
    if args.kernel_check_layers:  # last: the producer variants' first shards are timed on cold kernels
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        mem.phase = "kernel_check"
        rng = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, PRESETS[args.preset]["vocab_size"], (4, 1024), generator=rng).to(device)
        results["kernel_check"] = kernel_check(args.preset, args.kernel_check_layers, ids, device)
        log.info("fla vs the fp32 truth: %s", results["kernel_check"])
    mem.stop()
    report(True)


if __name__ == "__main__":
    main()
