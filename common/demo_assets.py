"""The demo target model, tokenizer and chat dataset shipped with the package.

Why: tests, the demo and the CPU smoke benchmarks need a real tokenizer with a chat template, a real
(small) chat dataset and a target model, with no internet. The assets are built by
`ops/make_demo_assets.py` and live under `common/assets/`. No weights are shipped: `build_tiny_target`
creates them from the config with a fixed seed, and `materialize_tiny_target` saves them once so that
producers and consumers load the very same weights with `from_pretrained(path)`.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_ASSETS = Path(__file__).resolve().parent / "assets"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)

# Token strings of the demo tokenizer (see ops/make_demo_assets.py).
MASK_TOKEN = "<|mask|>"
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"


def tiny_target_dir() -> Path:
    """Folder with config.json + tokenizer files, usable by AutoConfig/AutoTokenizer.from_pretrained."""
    path = _ASSETS / "tiny-qwen3"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"demo assets missing at {path}: run ops/make_demo_assets.py")
    return path


def demo_dataset_path() -> Path:
    """The bundled chat dataset: jsonl, one {"id", "messages": [{role, content}, ...]} per line."""
    path = _ASSETS / "demo_chat.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"demo dataset missing at {path}: run ops/make_demo_assets.py")
    return path


def build_tiny_target(dtype: torch.dtype = torch.float32, seed: int = 0):
    """The tiny Qwen3 target with weights drawn from `seed` (same weights on every machine).

    Weights are initialized in fp32 on CPU under a forked RNG (the caller's RNG state is untouched),
    then cast, so every dtype is a rounding of the same fp32 weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_target_dir())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype).eval()


def materialize_tiny_target(
    out_dir: str | Path, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> Path:
    """Save the tiny target (safetensors) plus the tokenizer files into `out_dir`; returns the path.

    Idempotent: an existing complete folder is reused (weights are a pure function of `seed`). Call it
    once before starting producer/consumer processes; it is not meant to race with itself.
    """
    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        src = tiny_target_dir() / name
        if src.is_file():
            shutil.copyfile(src, out / name)
    model = build_tiny_target(dtype=dtype, seed=seed)
    model.save_pretrained(out, safe_serialization=True)  # model.safetensors last: marks completion
    log.info("materialized tiny target (seed %d, %s) at %s", seed, dtype, out)
    return out
