"""The demo target model, tokenizer and chat dataset shipped with the package.

Why: tests, the demo and the CPU smoke benchmarks need a real tokenizer with a chat template, a real
(small) chat dataset and a target model, with no internet. The assets are built by
`ops/make_demo_assets.py` and live under `tools/demo/data/`. The target's weights are shipped (bf16, trained
for a few CPU minutes on the standard library's text, so its greedy answers are text, not loops);
`build_tiny_target` loads them (or draws untrained ones from a seed), and `materialize_tiny_target`
saves them once so that producers and consumers load the very same weights with `from_pretrained(path)`.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

log = logging.getLogger(__name__)

_ASSETS = Path(__file__).resolve().parent / "data"
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


Weights = Literal["trained", "random"]


def distilled_dataset_path() -> Path:
    """The bundled prompts with the trained target's own greedy answers (what the demo trains on)."""
    path = _ASSETS / "demo_chat_distilled.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"distilled dataset missing at {path}: run ops/make_demo_assets.py --train-target"
        )
    return path


def build_tiny_target(dtype: torch.dtype = torch.float32, seed: int = 0, *, weights: Weights = "trained"):
    """The tiny Qwen3 target: the shipped trained weights, or (``weights="random"``) weights drawn from
    `seed` (same on every machine). `seed` only matters for random weights.

    Random weights are initialized in fp32 on CPU under a forked RNG (the caller's RNG state is untouched),
    then cast, so every dtype is a rounding of the same fp32 weights; trained ones are stored in bf16 and
    cast from there (fp32 holds them exactly).
    """
    config = AutoConfig.from_pretrained(tiny_target_dir())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if weights == "trained":
        path = tiny_target_dir() / "model.safetensors"
        if not path.is_file():
            raise FileNotFoundError(
                f"trained demo weights missing at {path}: run ops/make_demo_assets.py --train-target"
            )
        model.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()}, strict=True)
    elif weights != "random":
        raise ValueError(f"weights must be 'trained' or 'random', got {weights!r}")
    return model.to(dtype).eval()


def materialize_tiny_target(
    out_dir: str | Path, *, dtype: torch.dtype = torch.float32, seed: int = 0, weights: Weights = "trained"
) -> Path:
    """Save the tiny target (safetensors) plus the tokenizer files into `out_dir`; returns the path.

    Idempotent: an existing complete folder is reused (weights are a pure function of `weights` and
    `seed`; pass a fresh folder to switch). Call it once before starting producer/consumer processes; it
    is not meant to race with itself.
    """
    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        src = tiny_target_dir() / name
        if src.is_file():
            shutil.copyfile(src, out / name)
    model = build_tiny_target(dtype=dtype, seed=seed, weights=weights)
    model.save_pretrained(out, safe_serialization=True)  # model.safetensors last: marks completion
    log.info("materialized tiny target (%s weights, seed %d, %s) at %s", weights, seed, dtype, out)
    return out


def self_distill(
    target: Path,
    src: Path,
    dst: Path,
    *,
    limit: int,
    max_new_tokens: int = 96,
    batch: int = 64,
) -> Path:
    """Real-text prompts from the bundled dataset (each row up to its first answer), answered greedily by
    the target through dflash-regenerate's local engine, each answer cut to its longest prefix that
    tokenizes back to the tokens the target wrote (``_round_trip_prefix``).

    This is how drafters are trained in practice (DFlash, EAGLE): the drafter must predict *the target's*
    next tokens, so the responses come from the target. ops/make_demo_assets.py runs it once with the
    trained target and ships the result (``distilled_dataset_path``), so no demo run pays for it; for a
    dataset of one's own, ``dflash-regenerate`` is the command (docs/data.md).
    """
    # here, not at the top: the engine imports the producer's launch (zarr, the spool) for --gpus, which
    # nothing else that loads the demo assets needs
    from dflash.tools.regenerate.config import RegenerateConfig
    from dflash.tools.regenerate.local_engine import LocalEngine
    from dflash.tools.regenerate.reply import Request

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
    # One torch thread: decoding a tiny model gains little from a second one, and on a busy 2-core box the
    # two spin against each other (measured: 128 prompts in 5 s with 1 thread, 32 s with 2; same output).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = RegenerateConfig(
        model=str(target),
        dataset=str(src),
        out=str(dst),
        max_new_tokens=max_new_tokens,
        batch_size=batch,
        gpus="cpu",
    )
    engine = LocalEngine(cfg)
    replies = engine.complete([Request(messages=prompt, tools=None) for _, prompt in rows])
    with open(dst, "w") as out:
        for (rid, prompt), reply in zip(rows, replies, strict=True):
            answer = _round_trip_prefix(engine.tokenizer, reply.ids or [])
            if answer is not None:
                messages = [*prompt, {"role": "assistant", "content": answer}]
                out.write(json.dumps({"id": rid, "messages": messages}) + "\n")
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
