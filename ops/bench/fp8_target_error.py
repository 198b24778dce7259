#!/usr/bin/env python
"""What an FP8 target does to the captured hidden states: relative L2 per layer against the target in
full precision, on the same batch (CPU; FP8 emulated by quantize -> dequantize, as the producer does there).

Why: the drafter learns from these states; the FP8 target's error per layer, next to the FP8 shard codec's
(~0.026, docs/benchmarks.md), says what it costs before any training. Rows: a bf16 checkpoint made an FP8
target at load (--target-precision fp8); a published-format fine-grained FP8 checkpoint of it (128 x 128
blocks) loaded as stored (--target-precision bf16: its weights' rounding alone) and run as an FP8 target
(requantized per output channel, activations per row: what the producer runs). Each in fp32 and in bf16
(the GPU's dtype), against the original target in the same dtype.

    .venv/bin/python ops/bench/fp8_target_error.py --out runs/fp8target
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from dflash.common.drafter.layers import default_target_layer_ids
from dflash.common.target.capture import LayerCapture
from dflash.common.target.data import DataConfig, load_raw_dataset
from dflash.common.target.fp8_checkpoint import write_fp8_checkpoint
from dflash.common.target.loading import load_target
from dflash.tools.demo.assets import distilled_dataset_path, tiny_target_dir


def batch(target: Path, rows: int, length: int) -> torch.Tensor:
    """[rows, length] ids: the demo's conversations (chat template) one after another, cut into rows."""
    tok = AutoTokenizer.from_pretrained(target)
    ds = load_raw_dataset(DataConfig(dataset=str(distilled_dataset_path()), max_length=length))
    stream: list[int] = []
    for row in ds:
        out = tok.apply_chat_template(row["messages"], tokenize=True)
        stream += list(out["input_ids"] if hasattr(out, "keys") else out)
        if len(stream) >= rows * length:
            break
    return torch.tensor(stream[: rows * length], dtype=torch.int64).view(rows, length)


def states(
    path: Path, dtype: torch.dtype, precision: str, ids: torch.Tensor, layers: list[int]
) -> torch.Tensor:
    model, _ = load_target(str(path), dtype=dtype, device="cpu", precision=precision)
    capture = LayerCapture(model, layers)
    with torch.inference_mode():
        return capture.run(ids).float()


def rel_l2(ref: torch.Tensor, got: torch.Tensor, k: int) -> list[float]:
    r, g = ref.view(ref.shape[0], k, -1), got.view(got.shape[0], k, -1)
    return [round(float((g[:, j] - r[:, j]).norm() / r[:, j].norm()), 5) for j in range(k)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("runs/fp8target"))
    args = p.parse_args(argv)
    target = tiny_target_dir()
    ids = batch(target, args.rows, args.length)
    with tempfile.TemporaryDirectory() as tmp:
        fp8_ckpt = Path(tmp) / "fp8"
        write_fp8_checkpoint(target, fp8_ckpt)
        n = AutoConfig.from_pretrained(target).num_hidden_layers
        layers = list(range(n))
        res = {
            "tokens": int(ids.numel()),
            "rows": args.rows,
            "length": args.length,
            "layers": layers,
            "error": {},
        }
        res["default_captured"] = default_target_layer_ids(n)
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            ref = states(target, dtype, "bf16", ids, layers)
            for label, path, precision in (
                ("bf16 checkpoint, FP8 at load (--target-precision fp8)", target, "fp8"),
                ("published FP8 checkpoint (block 128) as stored, dequantized", fp8_ckpt, "bf16"),
                ("published FP8 checkpoint as FP8 target (requantized per channel)", fp8_ckpt, "auto"),
            ):
                err = rel_l2(ref, states(path, dtype, precision, ids, layers), len(layers))
                res["error"][f"{label}, {name}"] = err
                print(json.dumps({"case": f"{label}, {name}", "rel_l2": err}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_target_error.json").write_text(json.dumps(res, indent=1))
    lines = ["| target, dtype | " + " | ".join(f"layer {i}" for i in layers) + " |"]
    lines.append("|---|" + "---:|" * len(layers))
    lines += [f"| {k} | " + " | ".join(f"{v:.4f}" for v in e) + " |" for k, e in res["error"].items()]
    (args.out / "fp8_target_error.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
