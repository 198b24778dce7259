"""Benchmark targets: random-weight models of named shapes, in memory or saved to disk with a tokenizer, and
synthetic chat datasets of realistic (long-tailed) lengths. Shared by producer_bench and pipeline_bench.

Shapes (random bf16 weights; what matters for speed is the shape, not the values):
- ``8b``: Qwen3-8B (hidden 4096, 36 layers, 32/8 heads x 128, FFN 12288, vocab 151936);
- ``32b``: Qwen3-32B-class (hidden 5120, 64 layers, 64/8 heads x 128, FFN 25600, vocab 151936);
- ``hybrid27b``: Qwen3.5/3.6-27B (hidden 5120, FFN 17408, 24/4 heads x 256 with output gate, Gated
  DeltaNet 48 value / 16 key heads x 128, full attention every 4th layer, vocab 248320). Its default is an
  8-layer slice (6 GDN + 2 attention, as measured before): the full 64 layers are 54 GB; per-layer rates
  scale (`depth_scale`);
- ``small``: the demo's tiny Qwen3 shape (hidden 256, 8 layers, vocab 4096), ``hybrid_small`` a tiny hybrid
  of the same family: CPU runs.
The saved targets carry the demo's tokenizer (byte-level BPE, 4096 ids, ChatML template): token ids are
below every shape's vocabulary.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import torch

from dflash.common.drafter.layers import default_target_layer_ids
from dflash.tools.demo.assets import tiny_target_dir

QWEN3_8B = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
)
PRESETS: dict[str, dict] = {
    "8b": dict(arch="qwen3", **QWEN3_8B),
    "32b": dict(
        arch="qwen3",
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    "hybrid27b": dict(
        arch="qwen3_5",
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=248320,
        linear_num_value_heads=48,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        default_layers=8,
    ),
    "small": dict(
        arch="qwen3",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=4096,
    ),
    "hybrid_small": dict(
        arch="qwen3_5",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=4096,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
    ),
}


def shape_config(preset: str, layers: int | None = None):
    """The HF config of a preset, cut to ``layers`` decoder layers (default: the preset's own depth)."""
    from transformers import Qwen3_5TextConfig, Qwen3Config

    shape = dict(PRESETS[preset])
    arch, full = shape.pop("arch"), shape.pop("num_hidden_layers")
    n = layers or shape.pop("default_layers", full)
    shape.pop("default_layers", None)
    common = dict(
        num_hidden_layers=n, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False
    )
    if arch == "qwen3":
        return Qwen3Config(**shape, **common, rope_theta=1000000.0)
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    return Qwen3_5TextConfig(**shape, **common, layer_types=types)


def full_depth(preset: str) -> int:
    return PRESETS[preset]["num_hidden_layers"]


def depth_scale(preset: str, layers: int) -> float:
    """Rate of a ``layers``-deep slice x this = the rate at the preset's full depth (layers run, each cut
    after its last captured layer: default ids K=5 from 1 to L-3)."""
    run = lambda n: max(default_target_layer_ids(n)) + 1  # noqa: E731
    return run(layers) / run(full_depth(preset))


def build_target(
    preset: str,
    *,
    layers: int | None = None,
    device: str = "cuda",
    seed: int = 0,
    dtype: torch.dtype | None = None,
):
    """A random-weight causal LM of the preset's shape (default bf16 on CUDA, fp32 on the CPU), in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(preset, layers), dtype=dtype)
    return model.eval()


def save_target(preset: str, root: Path, *, layers: int | None = None, device: str = "cuda") -> Path:
    """A target folder the CLIs load: random weights (bf16) + the demo tokenizer and chat template."""
    if (root / "config.json").exists() and (root / "tokenizer.json").exists():
        return root  # built by an earlier phase or run
    model = build_target(preset, layers=layers, device=device)
    model.to(torch.bfloat16).save_pretrained(root, max_shard_size="20GB")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the benchmark's own process must not hold the GPU the CLIs will share
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_target_dir() / name, root / name)
    return root


WORDS = (
    "the of and to in is that for it as with was on be by this are from or at an which not have one "
    "function value returns list module object string file data time type default error name python "
    "number set class method code given argument if when new first each can used"
).split()


def chat_lengths(
    rng: random.Random, n: int, *, median: int, sigma: float, cap: int, floor: int = 96
) -> list[int]:
    """Long-tailed (log-normal) conversation lengths in tokens, as in real chat data."""
    return [min(cap, max(floor, int(math.exp(rng.gauss(math.log(median), sigma))))) for _ in range(n)]


def write_chat_dataset(path: Path, *, rows: int, median: int, sigma: float, cap: int, seed: int = 0) -> Path:
    """A JSONL of OpenAI-format conversations (system? user, assistant) with log-normal token lengths
    (the demo tokenizer makes ~1.03 tokens per word of this text, plus ~10 for the template; the producer
    truncates at its --max-length); the assistant turn holds ~70 % of each conversation."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for n in chat_lengths(rng, rows, median=median, sigma=sigma, cap=cap):
            words = max(8, n - 10)
            text = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
            user, answer = max(4, words * 3 // 10), max(8, words * 7 // 10)
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": text(user)},
                            {"role": "assistant", "content": text(answer)},
                        ]
                    }
                )
                + "\n"
            )
    return path
