#!/usr/bin/env python
"""FP8 hidden-state shards: bytes per token and CPU time on real shards, and the error per captured layer.

Why: the FP8 codec (common/contract/hidden_fp8.py) must halve the bytes every stage moves and cost the
drafter nothing. This measures, on real shards (any codec; their hidden states are restored to bf16 first):

- `bytes`: each codec of --codecs through the real `write_shard` / `read_shard` (zarr, files on tmpfs):
  bytes on disk per token of `hidden` (+ `hidden_scales`) and of the whole shard, the ratio against raw
  bf16 hidden states (K x H x 2 bytes per token), and CPU seconds per GB of raw bf16 (zarr encoding one
  chunk at a time, so one core's work): quantize (what a CPU producer adds; a GPU producer quantizes on its
  GPU), encode, decode (`read_shard`: FP8 stays FP8, as the consumer reads it), dequantize on the CPU (the
  CPU trainer's cost; a GPU trainer dequantizes on its GPU). Best of --repeat.
- `error`: the relative L2 error of the restored hidden states against bf16, per captured layer, with the
  shipped bf16 scales and with fp32 scales, on the real shards and on random activations of an 8B shape
  (hidden 4096, 5 layers) with injected outliers: a few channels 20x the rest on every token (outlier
  channels, 20x and 100x) and massive activations (2 channels 10^2 to 10^5 x on 1 % of the tokens); for those the
  error on the affected tokens alone and the share of their values left in e4m3's subnormals or at zero.

    dflash-produce --gpus cpu:1 --model TARGET --dataset tools/demo/data/demo_chat_distilled.jsonl \\
        --max-length 512 --batch-tokens 4096 --epochs 1 --codec none --spool /tmp/demo-shards
    .venv/bin/python ops/bench/fp8_bench.py --shards /tmp/demo-shards --out runs/fp8
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numcodecs
import numpy as np
import torch
import zarr

from dflash.common.contract import hidden_fp8
from dflash.common.contract.codecs import CodecConfig
from dflash.common.contract.shard import Shard
from dflash.common.contract.shard_reader import read_shard, shard_nbytes
from dflash.common.contract.shard_writer import write_shard

DEFAULT_CODECS = "zstd:1:shuffle,fp8:none,fp8:zstd:1,fp8:zstd:3,fp8:zstd:5,fp8:zstd:9"
OUTLIERS = {  # scenario -> (outlier channels on every token: (count, factor), massive: (count, factor, token share))
    "gaussian": (None, None),
    "outlier channels 20x": ((8, 20.0), None),
    "outlier channels 100x": ((8, 100.0), None),
    "massive 100x": (None, (2, 100.0, 0.01)),
    "massive 1000x": (None, (2, 1000.0, 0.01)),
    "massive 10000x": (None, (2, 10000.0, 0.01)),
    "massive 100000x": (None, (2, 100000.0, 0.01)),
}


def load_shards(folder: Path) -> list[Shard]:
    """The shards under `folder` (a spool or its ready/), hidden states restored to bf16."""
    paths = sorted(p for p in folder.rglob("*.zarr") if (p / "zarr.json").is_file() and "eval" not in p.parts)
    shards = []
    for p in paths:
        s = read_shard(p)
        shards.append(
            Shard(
                input_ids=s.input_ids,
                loss_mask=s.loss_mask,
                cu_seqlens=s.cu_seqlens,
                sample_index=s.sample_index,
                hidden=s.restored_hidden(),
                meta=s.meta,
            )
        )
    if not shards:
        raise SystemExit(f"fp8_bench: error: no shards under {folder}")
    return shards


def quantize_fp32_scales(hidden: torch.Tensor, layers: int) -> torch.Tensor:
    """The alternative not shipped: fp32 scales (amax / 448 unrounded), restored to bf16."""
    t, d = hidden.shape
    x = hidden.float().view(t, layers, d // layers)
    scale = (x.abs().amax(-1, keepdim=True) / hidden_fp8.FP8_MAX).clamp(min=hidden_fp8.MIN_SCALE)
    q = (x / scale).clamp(-hidden_fp8.FP8_MAX, hidden_fp8.FP8_MAX).to(hidden_fp8.FP8_DTYPE)
    return (q.float() * scale).to(torch.bfloat16).view(t, d)


def rel_l2_per_layer(ref: torch.Tensor, got: torch.Tensor, layers: int) -> list[float]:
    r = ref.float().view(ref.shape[0], layers, -1)
    g = got.float().view(got.shape[0], layers, -1)
    return [float((g[:, k] - r[:, k]).norm() / r[:, k].norm()) for k in range(layers)]


def bytes_and_times(shards: list[Shard], codec: CodecConfig, repeat: int, work: Path) -> dict:
    tokens = sum(s.num_tokens for s in shards)
    raw = sum(s.hidden.numel() * 2 for s in shards)
    best = dict.fromkeys(("quantize", "encode", "decode", "dequantize"), float("inf"))
    sizes = {}
    with zarr.config.set({"async.concurrency": 1}):
        for _ in range(repeat):
            spent = dict.fromkeys(best, 0.0)
            sizes = {"hidden": 0, "shard": 0}
            for i, s in enumerate(shards):
                path = work / f"{i}.zarr"
                shutil.rmtree(path, ignore_errors=True)
                c0 = time.process_time()
                if codec.fp8:
                    values, scales = hidden_fp8.quantize(s.hidden, s.meta.num_layers)
                    s = Shard(
                        input_ids=s.input_ids,
                        loss_mask=s.loss_mask,
                        cu_seqlens=s.cu_seqlens,
                        sample_index=s.sample_index,
                        hidden=values,
                        hidden_scales=scales,
                        meta=s.meta,
                    )
                c1 = time.process_time()
                sizes["shard"] += write_shard(path, s, codec)
                c2 = time.process_time()
                back = read_shard(path)
                c3 = time.process_time()
                back.restored_hidden()
                c4 = time.process_time()
                spent["quantize"] += c1 - c0
                spent["encode"] += c2 - c1
                spent["decode"] += c3 - c2
                spent["dequantize"] += c4 - c3 if codec.fp8 else 0.0
                sizes["hidden"] += sum(
                    shard_nbytes(path / a) for a in ("hidden", "hidden_scales") if (path / a).is_dir()
                )
            best = {k: min(best[k], spent[k]) for k in best}
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    gb = raw / 1e9
    return {
        "codec": codec.spec,
        "tokens": tokens,
        "hidden_bytes_per_token": sizes["hidden"] / tokens,
        "shard_bytes_per_token": sizes["shard"] / tokens,
        "raw_bf16_bytes_per_token": raw / tokens,
        "ratio_hidden": raw / sizes["hidden"],
        "ratio_shard": raw / sizes["shard"],
        **{f"{k}_cpu_s_per_gb": round(v / gb, 3) for k, v in best.items()},
    }


def scale_bytes(shards: list[Shard], dtype: torch.dtype) -> float:
    """Bytes per token of the [T, K] scales with zstd(1), as the shard stores them (bf16) or as fp32."""
    total = 0
    for s in shards:
        _, scales = hidden_fp8.quantize(s.hidden, s.meta.num_layers)
        arr = scales.to(dtype).view(torch.uint16 if dtype == torch.bfloat16 else torch.int32).numpy()
        total += len(numcodecs.Zstd(level=1).encode(np.ascontiguousarray(arr)))
    return total / sum(s.num_tokens for s in shards)


def synthetic(
    scenario: str, tokens: int, layers: int, hidden: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """8B-shaped activations: Gaussian with a log-normal scale per channel, plus the scenario's outliers;
    (bf16 [T, K*H], the mask of the massive-activation tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layers, hidden, generator=g) * torch.exp(
        0.5 * torch.randn(1, layers, hidden, generator=g)
    )
    channels, massive = OUTLIERS[scenario]
    affected = torch.zeros(tokens, dtype=torch.bool)
    idx = torch.zeros(0, dtype=torch.int64)
    if channels:
        count, factor = channels
        idx = torch.randperm(hidden, generator=g)[:count]
        x[:, :, idx] *= factor
        affected[:] = True
    if massive:
        count, factor, share = massive
        affected[torch.randperm(tokens, generator=g)[: max(1, int(share * tokens))]] = True
        idx = torch.randperm(hidden, generator=g)[:count]
        rows = affected.nonzero().squeeze(1)
        sub = x[rows]
        sub[:, :, idx] = factor * torch.sign(torch.randn(len(rows), layers, count, generator=g))
        x[rows] = sub
    return x.view(tokens, layers * hidden).to(torch.bfloat16), affected, idx


def error_rows(
    hidden: torch.Tensor,
    layers: int,
    affected: torch.Tensor | None = None,
    channels: torch.Tensor | None = None,
) -> dict:
    """rel L2 per layer (bf16 and fp32 scales); with outliers also on the affected tokens' other channels
    (what the outliers' large scale costs) and on the unaffected tokens, and the share of the affected
    tokens' other values that land in e4m3's subnormals or at zero."""
    values, scales = hidden_fp8.quantize(hidden, layers)
    restored = hidden_fp8.dequantize(values, scales)
    out = {
        "rel_l2_bf16_scales": rel_l2_per_layer(hidden, restored, layers),
        "rel_l2_fp32_scales": rel_l2_per_layer(hidden, quantize_fp32_scales(hidden, layers), layers),
    }
    if affected is not None and channels is not None and bool(affected.any()):
        rows = affected.nonzero().squeeze(1)
        size = hidden.shape[1] // layers
        rest = torch.ones(size, dtype=torch.bool)
        rest[channels] = False
        pick = lambda t: t[rows].view(len(rows), layers, size)[:, :, rest].reshape(len(rows), -1)  # noqa: E731
        out["rel_l2_affected_tokens"] = rel_l2_per_layer(pick(hidden), pick(restored), layers)
        if not bool(affected.all()):
            out["rel_l2_other_tokens"] = rel_l2_per_layer(hidden[~affected], restored[~affected], layers)
        mag, ref = pick(values.view(torch.uint8)).view(hidden_fp8.FP8_DTYPE).float().abs(), pick(hidden)
        out["affected_subnormal_share"] = float(((mag < 2.0**-6) & (mag > 0)).float().mean())
        out["affected_zero_share"] = float(((mag == 0) & (ref != 0)).float().mean())
    return out


def markdown(res: dict) -> str:
    lines = [
        f"# FP8 shards ({res['date']}, {res['machine']})",
        "",
        f"Real shards: {res['shards']}",
        "",
        "| codec | hidden B/token | ratio vs raw bf16 (hidden + scales) | shard B/token | ratio (whole shard) "
        "| quantize cpu-s/GB | encode cpu-s/GB | decode cpu-s/GB | dequantize cpu-s/GB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["bytes"]:
        lines.append(
            f"| {r['codec']} | {r['hidden_bytes_per_token']:.1f} | {r['ratio_hidden']:.3f} | {r['shard_bytes_per_token']:.1f} "
            f"| {r['ratio_shard']:.3f} | {r['quantize_cpu_s_per_gb']:.2f} | {r['encode_cpu_s_per_gb']:.2f} "
            f"| {r['decode_cpu_s_per_gb']:.2f} | {r['dequantize_cpu_s_per_gb']:.2f} |"
        )
    sb = res["scale_bytes_per_token"]
    lines += [
        "",
        f"Scales per token with zstd(1): bf16 {sb['bf16']:.2f} B, fp32 {sb['fp32']:.2f} B.",
        "",
        "| data | layer | rel L2 (bf16 scales) | rel L2 (fp32 scales) | affected tokens, other channels "
        "| unaffected tokens |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, e in res["error"].items():
        for k, layer in enumerate(e["layers"]):
            aff, other = e.get("rel_l2_affected_tokens"), e.get("rel_l2_other_tokens")
            lines.append(
                f"| {name} | {layer} | {e['rel_l2_bf16_scales'][k]:.4f} | {e['rel_l2_fp32_scales'][k]:.4f} "
                f"| {f'{aff[k]:.4f}' if aff else ''} | {f'{other[k]:.4f}' if other else ''} |"
            )
        if "affected_subnormal_share" in e:
            lines.append(
                f"| {name}: affected tokens' other values in e4m3 subnormals / flushed to 0 | | "
                f"{e['affected_subnormal_share']:.3%} / {e['affected_zero_share']:.3%} | | | |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", required=True, type=Path, help="a spool or folder of real shards (any codec)")
    p.add_argument("--codecs", default=DEFAULT_CODECS)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tokens", type=int, default=4096, help="tokens of each synthetic 8B-shaped case")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("runs/fp8"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    shards = load_shards(args.shards)
    layers = shards[0].meta.layer_ids
    res = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, zarr {zarr.__version__}",
        "shards": f"{len(shards)} shards, {sum(s.num_tokens for s in shards)} tokens, {shards[0].meta.target_model}, "
        f"layers {layers}, hidden {shards[0].meta.hidden_size}",
        "bytes": [],
        "error": {},
        "scale_bytes_per_token": {
            "bf16": scale_bytes(shards, torch.bfloat16),
            "fp32": scale_bytes(shards, torch.float32),
        },
    }
    work = Path(tempfile.mkdtemp(prefix="fp8-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        for spec in args.codecs.split(","):
            res["bytes"].append(bytes_and_times(shards, CodecConfig.parse(spec), args.repeat, work))
            print(json.dumps(res["bytes"][-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    real = torch.cat([s.hidden for s in shards])
    res["error"]["demo target (real shards)"] = {"layers": layers, **error_rows(real, len(layers))}
    for i, scenario in enumerate(OUTLIERS):
        hidden, affected, channels = synthetic(scenario, args.tokens, args.layers, args.hidden, seed=i)
        e = error_rows(hidden, args.layers, affected, channels)
        res["error"][f"8B-shaped, {scenario}"] = {"layers": list(range(args.layers)), **e}
        print(scenario, json.dumps(e), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_bench.json").write_text(json.dumps(res, indent=1))
    (args.out / "fp8_bench.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
