"""The target's frozen embedding and lm_head, read alone from its safetensors (never the whole model).

Why alone: a consumer needs only these two tensors of a 27B-70B target (the drafter borrows them); loading
the model would cost tens of GB of host memory and minutes. Sharded checkpoints are read through their
index, tied embeddings reuse the embedding, multimodal checkpoints find the text model's tensors."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from huggingface_hub import hf_hub_download, snapshot_download
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

if TYPE_CHECKING:
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
    from dflash.common.drafter.dflash import TargetHead  # see target_fingerprint

    if isinstance(target, nn.Module):
        shared = TargetHead.of(target)  # the target's own tensors; copied below in `dtype`
        head = TargetHead(
            shared.embed_weight.to(dtype).clone(),
            None if shared.tied else shared.lm_head_weight.to(dtype).clone(),
        )
        head.fingerprint = fingerprint_of(shared.embed_weight, None if shared.tied else shared.lm_head_weight)
        return head.to(device) if device is not None else head
    files, embed_key, head_key = _head_keys(target)

    def read(key: str) -> torch.Tensor:
        with safe_open(str(_shard_file(target, files[key])), framework="pt", device="cpu") as f:
            return f.get_tensor(key)

    embed = read(embed_key)
    lm_head = read(head_key) if head_key is not None else None
    head = TargetHead(embed.to(dtype), lm_head.to(dtype) if lm_head is not None else None)
    head.fingerprint = fingerprint_of(embed, lm_head)
    log.info("target head from %s: embed %s, lm_head %s", target, embed_key, head_key or "tied to embed")
    return head.to(device) if device is not None else head


def _head_keys(target: Any) -> tuple[dict[str, Path], str, str | None]:
    """(tensor name -> file, the embedding's name, the lm_head's name or None when tied)."""
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
    return files, embed_key, head_key


def _shard_file(target: Any, file: Path) -> Path:
    """The local file of a shard; for a hub snapshot, just the shard holding the tensor is fetched."""
    return file if file.exists() else Path(hf_hub_download(str(target), file.name))


FINGERPRINT_ROWS = 64


def _rows(n: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, FINGERPRINT_ROWS).astype(np.int64))


def _digest(parts: list[tuple[tuple[int, ...], torch.Tensor] | None]) -> str:
    h = hashlib.sha256()
    for part in parts:
        if part is None:
            h.update(b"tied")
            continue
        shape, rows = part
        h.update(str(tuple(shape)).encode())
        h.update(rows.to(torch.float32).contiguous().numpy().tobytes())
    return "sha256:" + h.hexdigest()[:32]


def fingerprint_of(embed: torch.Tensor, lm_head: torch.Tensor | None) -> str:
    """A short digest of a target's embedding and lm_head: their shapes and 64 rows spread over the
    vocabulary, as float32 values (the same for the bf16 file and a bf16 or fp32 copy of it).

    Why a digest of the head: the drafter is trained on these exact tensors (it borrows them), so a target
    of the same shape with other weights (another fine-tune) decodes with a drafter that never saw it; and
    64 rows are read in milliseconds from a 2.5 GB embedding, where hashing all of it takes seconds."""
    return _digest(
        [
            None if t is None else (tuple(t.shape), t[torch.from_numpy(_rows(t.shape[0]))].cpu())
            for t in (embed, lm_head)
        ]
    )


def target_fingerprint(target: Any) -> str:
    """``fingerprint_of`` the target's head, reading only the sampled rows (safetensors slices).

    The drafter module (it imports transformers' Qwen3 model and torch._dynamo, ~1 s) only for an
    in-memory model: dflash-produce's parent fingerprints a folder at every launch and needs neither."""
    if isinstance(target, nn.Module):
        from dflash.common.drafter.dflash import TargetHead

        shared = TargetHead.of(target)
        return fingerprint_of(shared.embed_weight, None if shared.tied else shared.lm_head_weight)
    files, embed_key, head_key = _head_keys(target)

    def sampled(key: str) -> tuple[tuple[int, ...], torch.Tensor]:
        with safe_open(str(_shard_file(target, files[key])), framework="pt", device="cpu") as f:
            sl = f.get_slice(key)
            shape = tuple(sl.get_shape())
            return shape, torch.cat([sl[int(r) : int(r) + 1] for r in _rows(shape[0])])

    return _digest([sampled(embed_key), sampled(head_key) if head_key is not None else None])
