"""Write a model folder as a fine-grained FP8 checkpoint in the format Qwen publishes and transformers loads
(its ``FineGrainedFP8Config`` integration): each linear weight of the decoder layers as ``weight`` in e4m3
and ``weight_scale_inv`` (fp32, one per 128 x 128 block: the factor that restores it), everything else as
it was, and ``quantization_config`` in config.json.

Why: the FP8 target's tests and the demo's comparison need an FP8 checkpoint of the tiny targets, and
nothing is fetched from a hub; writing one from the bf16 folder is what a published one is.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.common.target.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

BLOCK = 128
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
    "modules_to_not_convert": ["lm_head"],
}
# the projections of a decoder layer (Qwen3 attention and MLP, Qwen3.5 gated attention and Gated DeltaNet)
LINEAR_SUFFIXES = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
    "in_proj_qkv.weight",
    "in_proj_qkvz.weight",
    "in_proj_z.weight",
    "out_proj.weight",
)


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], fp32 scales [ceil(N/block), ceil(K/block)]) with ``w ~= values * scale`` per block."""
    n, k = w.shape
    rows, cols = math.ceil(n / block), math.ceil(k / block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32)
    padded[:n, :k] = w.float()
    tiles = padded.view(rows, block, cols, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows * block, cols * block)[:n, :k].contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The fp32 weights a block-quantized pair restores to."""
    n, k = q.shape
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return q.float() * full


def is_decoder_linear(name: str) -> bool:
    return ".layers." in name and name.endswith(LINEAR_SUFFIXES) and "visual" not in name


def write_fp8_checkpoint(src: Path, dst: Path) -> int:
    """``src`` (a one-file safetensors model folder) as a fine-grained FP8 checkpoint in ``dst``; the
    other files (tokenizer, template) are copied. Returns how many weights were quantized."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    count = 0
    for name, t in tensors.items():
        if t.dim() == 2 and is_decoder_linear(name):
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = quantize_blocks(t)
            count += 1
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return count
