"""The target's frozen embedding and lm_head, read alone from its safetensors (never the whole model).

Why alone: a consumer needs only these two tensors of a 27B-70B target (the drafter borrows them); loading
the model would cost tens of GB of host memory and minutes. Sharded checkpoints are read through their
index, tied embeddings reuse the embedding, multimodal checkpoints find the text model's tensors."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import hf_hub_download, snapshot_download
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from dflash.common.drafter.dflash import TargetHead

log = logging.getLogger(__name__)


def _pick_key(keys: list[str], suffix: str, preferred: list[str]) -> str | None:
    for name in preferred:
        if name in keys:
            return name
    hits = [k for k in keys if k.endswith(suffix)]
    if len(hits) > 1:
        raise ValueError(f"several tensors end with {suffix!r}: {hits}; cannot tell which is the target's")
    return hits[0] if hits else None


def _weight_files(root: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the sharded index when there is one."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / fname for name, fname in weight_map.items()}
    single = root / "model.safetensors"
    if not single.exists():
        raise ValueError(f"{root}: no model.safetensors or model.safetensors.index.json")

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _local_dir(target: str | Path) -> Path:
    """A local folder as is; a hub id through huggingface_hub's cache (config + index first, shards on demand)."""
    path = Path(target)
    if path.is_dir():
        return path

    return Path(
        snapshot_download(
            str(target), allow_patterns=["config.json", "*.safetensors.index.json", "model.safetensors"]
        )
    )


def load_target_head(target: Any, *, dtype: torch.dtype = torch.bfloat16, device: Any = None) -> TargetHead:
    """Read ONLY the target's input embedding and lm_head (never the whole model).

    `target`: a local HF folder or hub id (safetensors, sharded or not; `tie_word_embeddings` targets reuse the
    embedding), or an in-memory HF model (tests, or a process that already holds the target).
    """
    if isinstance(target, nn.Module):
        shared = TargetHead.of(target)  # the target's own tensors; copied below in `dtype`
        head = TargetHead(
            shared.embed_weight.to(dtype).clone(),
            None if shared.tied else shared.lm_head_weight.to(dtype).clone(),
        )
        return head.to(device) if device is not None else head


    root = _local_dir(target)
    config = AutoConfig.from_pretrained(str(root))
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    tie = bool(
        getattr(config, "tie_word_embeddings", False) or getattr(text_config, "tie_word_embeddings", False)
    )
    files = _weight_files(root)
    names = list(files)
    embed_key = _pick_key(
        names,
        "embed_tokens.weight",
        ["model.embed_tokens.weight", "model.language_model.embed_tokens.weight"],
    )
    head_key = _pick_key(names, "lm_head.weight", ["lm_head.weight"])
    if embed_key is None:
        raise ValueError(f"{target}: no '*embed_tokens.weight' tensor in the checkpoint")
    if head_key is None and not tie:
        raise ValueError(f"{target}: no lm_head.weight and tie_word_embeddings is false")

    def read(key: str) -> torch.Tensor:
        file = files[key]
        if not file.exists():  # hub snapshot: fetch just the shard holding this tensor

            file = Path(hf_hub_download(str(target), file.name))
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return f.get_tensor(key).to(dtype)

    embed = read(embed_key)
    head = TargetHead(embed, read(head_key) if head_key is not None else None)
    log.info("target head from %s: embed %s, lm_head %s", target, embed_key, head_key or "tied to embed")
    return head.to(device) if device is not None else head
