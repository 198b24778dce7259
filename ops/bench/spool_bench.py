#!/usr/bin/env python
"""Shard codec benchmark: encode/decode speed and compression ratio of each codec on real hidden states.

Why: a producer must never wait on its shard encoder (target: 50 KB/token x 10K tok/s = 500 MB/s per
producer) and a consumer must decode faster than it trains, while the spool lives in RAM, so every byte of
compression buys buffered tokens. This measures the real writer and reader (`write_shard` / `read_shard`,
zarr pipeline, files on tmpfs included), not the codec in isolation, on:

- `hidden`: hidden states from a real forward pass of a Qwen3-architecture model built from a config
  (random init, --hidden wide, --layers deep, fp32 forward cast to bf16, as a producer captures them)
  over real token ids (the demo chat dataset through the demo tokenizer, chat template applied);
- `random`: N(0, 1) bf16 noise of the same shape, for contrast.

Each codec runs with zarr encoding one chunk at a time (`async.concurrency=1`: one core's worth) and with
`--threads` chunks in flight. Speeds are MB/s of raw bf16 `hidden` bytes (the 1-D arrays are written too,
as in production); `MB/cpu-s` divides by the process CPU time (all threads), i.e. throughput per core
actually used. FP8 codecs (`fp8:zstd:3`) get the shard already quantized, as a GPU producer hands it to its
writers; their ratio counts `hidden` and `hidden_scales` against raw bf16. Best of --repeat. Example:

    .venv/bin/python ops/bench/spool_bench.py --tokens 2048 --hidden 4096 --layers 8 --repeat 5
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import zarr

from dflash.common.contract import hidden_fp8
from dflash.common.contract.codecs import DEFAULT_CODEC_SPEC, CodecConfig
from dflash.common.contract.shard import DEFAULT_CHUNK_BYTES, Shard, ShardMeta
from dflash.common.contract.shard_reader import read_shard, shard_nbytes
from dflash.common.contract.shard_writer import write_shard
from dflash.common.drafter.layers import default_target_layer_ids
from dflash.common.target.capture import LayerCapture

log = logging.getLogger(__name__)

DEFAULT_CODECS = "none,zstd:1,zstd:3,zstd:1:shuffle,zstd:3:shuffle,zstd:5:shuffle,fp8:none,fp8:zstd:3"
PRODUCER_NEED_MB_S = 500.0  # 50 KB/token x 10K tok/s
TARGET_ENCODE_MB_S, TARGET_DECODE_MB_S = 400.0, 600.0  # per core, from the issue


def real_token_ids(num_tokens: int) -> tuple[torch.Tensor, int, str]:
    """Token ids of real text: the demo chat dataset through the demo tokenizer, or UTF-8 bytes of the
    Python stdlib sources if the demo assets are absent. Returns (ids, vocab size, description)."""
    try:
        from transformers import AutoTokenizer

        from dflash.tools.demo.assets import demo_dataset_path, tiny_target_dir

        tok = AutoTokenizer.from_pretrained(tiny_target_dir())
        ids: list[int] = []
        with open(demo_dataset_path()) as f:
            for line in f:
                ids += tok.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=False)
                if len(ids) >= num_tokens:
                    break
        if len(ids) >= num_tokens:
            return torch.tensor(ids[:num_tokens]), len(tok), "demo chat dataset, demo tokenizer"
    except (ImportError, OSError, ValueError, KeyError) as e:
        log.warning("demo assets unusable (%s); using stdlib source bytes as token ids", e)
    text = b""
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        text += path.read_bytes()
        if len(text) >= num_tokens:
            break
    return torch.tensor(list(text[:num_tokens])), 256, "UTF-8 bytes of Python stdlib sources"


def real_hidden_states(args: argparse.Namespace) -> tuple[torch.Tensor, list[int], str]:
    """[tokens, K*hidden] bf16 captured from a Qwen3 model's forward pass, as a producer would."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    ids, vocab, source = real_token_ids(args.tokens)
    layer_ids = default_target_layer_ids(args.layers, args.capture)
    head_dim = 128 if args.hidden % 128 == 0 else 64
    heads = max(1, args.hidden // head_dim)
    config = Qwen3Config(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        # Like a producer, run only the layers needed, plus one, so that the deepest captured layer is not
        # the model's last (whose feature is the final norm's output: the capture rule, feature_module).
        num_hidden_layers=max(layer_ids) + 2,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=max(4096, args.seq_len),
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    parts = []
    capture = LayerCapture(model, layer_ids)  # the producer's capture: the drafter's one capture rule
    try:
        with torch.no_grad():
            for start in range(0, ids.numel(), args.seq_len):
                parts.append(capture.run(ids[None, start : start + args.seq_len]).to(torch.bfloat16))
    finally:
        capture.close()
    log.info("forward of %d tokens: %.1f s", ids.numel(), time.perf_counter() - t0)
    desc = (
        f"Qwen3 from config (random init, fp32 forward -> bf16): hidden {args.hidden}, {args.layers} layers "
        f"(first {config.num_hidden_layers} run), layers {layer_ids} captured, {args.tokens} tokens of {source}, seq len {args.seq_len}"
    )
    return torch.cat(parts).contiguous(), layer_ids, desc


def make_shard(hidden: torch.Tensor, layer_ids: list[int], hidden_size: int, seq_len: int) -> Shard:
    num_tokens = hidden.shape[0]
    cu = list(range(0, num_tokens, seq_len)) + [num_tokens]
    return Shard(
        input_ids=torch.zeros(num_tokens, dtype=torch.int32),
        loss_mask=torch.ones(num_tokens, dtype=torch.bool),
        cu_seqlens=torch.tensor(cu, dtype=torch.int64),
        sample_index=torch.arange(len(cu) - 1, dtype=torch.int64),
        hidden=hidden,
        meta=ShardMeta(
            target_model="bench",
            layer_ids=layer_ids,
            hidden_size=hidden_size,
            producer_id="bench",
            bucket=seq_len,
        ),
    )


def quantized(shard: Shard) -> Shard:
    """The shard as a GPU producer hands it to its writers with an FP8 codec: already e4m3 + scales."""
    values, scales = hidden_fp8.quantize(shard.hidden, shard.meta.num_layers)
    return dataclasses.replace(shard, hidden=values, hidden_scales=scales)


def measure(shard: Shard, codec: CodecConfig, threads: int, args: argparse.Namespace, work: Path) -> dict:
    raw = shard.hidden.numel() * 2
    path = work / "bench.zarr"
    if codec.fp8:  # quantized before timing (on the GPU in production); speeds stay MB/s of raw bf16
        shard = quantized(shard)
    best = {"enc_s": float("inf"), "dec_s": float("inf"), "enc_cpu": float("inf"), "dec_cpu": float("inf")}
    with zarr.config.set({"async.concurrency": threads}):
        for _ in range(args.repeat):
            shutil.rmtree(path, ignore_errors=True)
            w0, c0 = time.perf_counter(), time.process_time()
            nbytes = write_shard(path, shard, codec, chunk_bytes=args.chunk_bytes)
            w1, c1 = time.perf_counter(), time.process_time()
            back = read_shard(path)
            w2, c2 = time.perf_counter(), time.process_time()
            best["enc_s"], best["enc_cpu"] = min(best["enc_s"], w1 - w0), min(best["enc_cpu"], c1 - c0)
            best["dec_s"], best["dec_cpu"] = min(best["dec_s"], w2 - w1), min(best["dec_cpu"], c2 - c1)
    same = back.hidden.view(torch.uint8).flatten(), shard.hidden.view(torch.uint8).flatten()
    assert torch.equal(*same) and (not codec.fp8 or torch.equal(back.hidden_scales, shard.hidden_scales)), (
        "round trip not exact"
    )
    hidden_bytes = sum(shard_nbytes(path / a) for a in ("hidden", "hidden_scales") if (path / a).is_dir())
    shutil.rmtree(path)
    mb = raw / 1e6
    return {
        "codec": codec.spec,
        "threads": threads,
        "ratio": raw / hidden_bytes,
        "shard_bytes": nbytes,
        "encode_MB_s": mb / best["enc_s"],
        "decode_MB_s": mb / best["dec_s"],
        "encode_MB_cpu_s": mb / max(best["enc_cpu"], 1e-9),
        "decode_MB_cpu_s": mb / max(best["dec_cpu"], 1e-9),
    }


def markdown(rows: list[dict], threads: int) -> str:
    head = (
        f"| data | codec | ratio | enc MB/s 1 thr | dec MB/s 1 thr | enc MB/s {threads} thr | dec MB/s {threads} thr "
        "| enc MB/cpu-s | dec MB/cpu-s |\n|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    by_key = {(r["data"], r["codec"], r["threads"]): r for r in rows}
    for data, codec in dict.fromkeys((r["data"], r["codec"]) for r in rows):
        one, many = by_key[(data, codec, 1)], by_key.get((data, codec, threads), by_key[(data, codec, 1)])
        mark = " (default)" if codec == DEFAULT_CODEC_SPEC else ""
        lines.append(
            f"| {data} | {codec}{mark} | {one['ratio']:.3f} | {one['encode_MB_s']:.0f} | {one['decode_MB_s']:.0f} "
            f"| {many['encode_MB_s']:.0f} | {many['decode_MB_s']:.0f} "
            f"| {one['encode_MB_cpu_s']:.0f} | {one['decode_MB_cpu_s']:.0f} |"
        )
    return "\n".join(lines)


def verdict(rows: list[dict], threads: int) -> str:
    mine = [r for r in rows if r["data"] == "hidden" and r["codec"] == DEFAULT_CODEC_SPEC]
    if not mine:
        return f"default {DEFAULT_CODEC_SPEC} not measured (not in --codecs)"
    one = next(r for r in mine if r["threads"] == 1)
    many = next((r for r in mine if r["threads"] == threads), one)
    per_core = one["encode_MB_s"] >= TARGET_ENCODE_MB_S and one["decode_MB_s"] >= TARGET_DECODE_MB_S
    parallel = many["encode_MB_s"] >= PRODUCER_NEED_MB_S
    return (
        f"default {DEFAULT_CODEC_SPEC}: one core encodes {one['encode_MB_s']:.0f} MB/s (target {TARGET_ENCODE_MB_S:.0f}) "
        f"and decodes {one['decode_MB_s']:.0f} MB/s (target {TARGET_DECODE_MB_S:.0f}): "
        f"{'MET' if per_core else 'NOT met'}; with {threads} threads it encodes {many['encode_MB_s']:.0f} MB/s "
        f"vs the producer's {PRODUCER_NEED_MB_S:.0f} MB/s: {'MET' if parallel else 'NOT met'}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=2048, help="tokens in the benchmark shard (default 2048)")
    p.add_argument(
        "--hidden", type=int, default=4096, help="hidden size of the model (default 4096, as Qwen3-8B)"
    )
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the model (default 8)")
    p.add_argument("--capture", type=int, default=5, help="layers captured, evenly from 1 to L-3 (default 5)")
    p.add_argument(
        "--seq-len", type=int, default=1024, help="tokens per forward pass / sample (default 1024)"
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="runs per measurement; the best is reported (default 3)"
    )
    p.add_argument(
        "--codecs", default=DEFAULT_CODECS, help=f"comma-separated codec specs (default {DEFAULT_CODECS})"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="chunks in flight for the parallel columns (default: cores)",
    )
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="bytes per hidden chunk")
    p.add_argument("--no-random", action="store_true", help="skip the random-numbers rows")
    p.add_argument(
        "--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None, help="where to write shards"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    for name in ("tokens", "hidden", "layers", "capture", "seq_len", "repeat", "threads", "chunk_bytes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.layers < args.capture + 3:
        # Fewer would capture a layer twice, and zstd would find the copies: an inflated ratio.
        p.error(f"--layers must be >= --capture + 3 = {args.capture + 3} for distinct layers from 1 to L-3")
    try:
        args.codec_list = [CodecConfig.parse(s) for s in args.codecs.split(",")]
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    # zarr sizes its thread pool once, on first use: make it large enough for --threads chunks in flight.
    zarr.config.set({"threading.max_workers": max(args.threads, 1) + 4})
    torch.set_num_threads(os.cpu_count() or 1)
    hidden, layer_ids, desc = real_hidden_states(args)
    datasets = {"hidden": hidden}
    if not args.no_random:
        datasets["random"] = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1)).to(
            torch.bfloat16
        )
    rows = []
    with tempfile.TemporaryDirectory(prefix="spool_bench-", dir=args.dir) as work:
        for data, h in datasets.items():
            shard = make_shard(h, layer_ids, args.hidden, args.seq_len)
            for codec in args.codec_list:
                for threads in sorted({1, args.threads}):
                    row = {"data": data, **measure(shard, codec, threads, args, Path(work))}
                    log.info("%s", row)
                    rows.append(row)
    print(f"hidden: {desc}; shard {tuple(hidden.shape)} = {hidden.numel() * 2 / 1e6:.1f} MB raw bf16\n")
    print(markdown(rows, args.threads))
    print()
    print(verdict(rows, args.threads))
    if args.json:
        result = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "processor": platform.processor(),
            },
            "versions": {"torch": torch.__version__, "zarr": zarr.__version__},
            "hidden_description": desc,
            "args": {k: v for k, v in vars(args).items() if k != "codec_list"},
            "rows": rows,
            "verdict": verdict(rows, args.threads),
        }
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
