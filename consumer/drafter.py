"""The DFlash drafter: config, the target's frozen embedding/lm_head, and the draft model itself.

Architecture (public facts: z-lab/dflash `DFlashDraftModel`, ARCHITECTURE §4). Parameter names equal the public
model's, so `state_dict()` exports without renames: `layers.{i}.input_layernorm`, `layers.{i}.self_attn.{q,k,v,o}_proj`,
`layers.{i}.self_attn.{q,k}_norm`, `layers.{i}.post_attention_layernorm`, `layers.{i}.mlp.{gate,up,down}_proj`, `fc`,
`hidden_norm`, `norm`. Per layer, as in the public model: the block goes through `input_layernorm`; the context
feature `hidden_norm(fc(concat of K target layers))` does NOT (it is normed once, shared by all layers); K and V
are `cat(proj(context), proj(block))`; `k_norm` applies to both halves, `q_norm` to the block queries; rotary uses
the context tokens' document positions and anchor_pos + k for block token k.

The target's embedding and lm_head are NOT part of this module (not parameters, not buffers): they are held by a
separate `TargetHead`, so they are never trained, saved in a checkpoint, handed to the optimizer, or broadcast by
DDP (DDP broadcasts every registered buffer; a 250K x H embedding each step would be ruinous).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.common.layers import default_target_layer_ids
from dflash.consumer.attention import Backend, DraftMask, build_draft_mask, draft_attention
from dflash.consumer.batching import DraftBatch

__all__ = [
    "DFlashDrafter",
    "DrafterConfig",
    "TargetHead",
    "choose_mask_token_id",
    "default_target_layer_ids",
    "load_target_head",
]

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------- config


def _rope_from_target(cfg: Any) -> tuple[float, dict | None]:
    """(rope_theta, extra rope parameters or None) from a transformers 5 or 4 style config."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if "rope_theta" not in params and "full_attention" in params:  # per-layer-type rope parameters
            params = params["full_attention"]
        theta = float(params["rope_theta"])
        extra = {k: v for k, v in params.items() if k != "rope_theta"}
    else:  # transformers 4: rope_theta + rope_scaling
        theta = float(getattr(cfg, "rope_theta", 10000.0))
        extra = dict(getattr(cfg, "rope_scaling", None) or {})
        if "type" in extra and "rope_type" not in extra:
            extra["rope_type"] = extra.pop("type")
    if extra.get("rope_type", "default") == "default" and set(extra) <= {"rope_type"}:
        return theta, None
    return theta, extra


@dataclass(kw_only=True)
class DrafterConfig:
    """Shape of one drafter. Width/heads/vocab/rope come from the target (the drafter reuses its embedding,
    lm_head and, through the context feature, its hidden space)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # rope parameters beyond theta, e.g. {"rope_type": "yarn", "factor": 4.0, ...}; None = plain rope
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    num_layers: int = 5
    block_size: int = 16
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    initializer_range: float = 0.02  # std of Linear init, as the public model's post_init

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "num_layers",
            "num_target_layers",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DrafterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DrafterConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"DrafterConfig.head_dim must be even for rotary embeddings, got {self.head_dim}"
            )
        if self.block_size < 2:
            raise ValueError(f"DrafterConfig.block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("DrafterConfig.target_layer_ids must not be empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"DrafterConfig.target_layer_ids {bad} outside [0, {self.num_target_layers})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DrafterConfig.mask_token_id={self.mask_token_id} outside [0, {self.vocab_size})"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(
                f"DrafterConfig.rms_norm_eps / rope_theta must be > 0, got {self.rms_norm_eps}, {self.rope_theta}"
            )
        if self.rope_scaling is not None and "rope_type" not in self.rope_scaling:
            raise ValueError(f"DrafterConfig.rope_scaling needs a 'rope_type', got {self.rope_scaling}")
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def rope_parameters(self) -> dict:
        """transformers 5 style `rope_parameters` (what the exported config.json carries)."""
        return {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        return cls(**d)

    def to_qwen3_config(self):
        """The Qwen3Config the public `DFlashDraftModel` loads this drafter with (export, rotary init)."""
        from transformers import Qwen3Config

        return Qwen3Config(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=self.rope_parameters,
            max_position_embeddings=self.max_position_embeddings,
            num_hidden_layers=self.num_layers,
            layer_types=["full_attention"] * self.num_layers,
            attention_bias=False,
            hidden_act="silu",
            tie_word_embeddings=False,
            initializer_range=self.initializer_range,
            architectures=["DFlashDraftModel"],
            num_target_layers=self.num_target_layers,
            block_size=self.block_size,
            dflash_config={
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
            },
        )

    @classmethod
    def from_target_config(
        cls,
        target_config: Any,
        *,
        num_layers: int = 5,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        mask_token_id: int | None = None,
        num_context_layers: int = 5,
        tokenizer: Any = None,
    ) -> DrafterConfig:
        """Derive a drafter config from the target's HF config (`text_config` of multimodal models).

        head_dim: the target's `head_dim` when set (Qwen3), else hidden_size // num_attention_heads (Llama).
        target_layer_ids: default `default_target_layer_ids(L, num_context_layers)`.
        mask_token_id: default `choose_mask_token_id(tokenizer, vocab_size)` when a tokenizer is given, else the
        config-only rule (the config's `mask_token_id`, else pad_token_id when it differs from eos/bos, else
        vocab_size - 1).
        """
        cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = int(cfg.num_attention_heads)
        hidden = int(cfg.hidden_size)
        num_target_layers = int(cfg.num_hidden_layers)
        vocab = int(cfg.vocab_size)
        theta, scaling = _rope_from_target(cfg)
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_context_layers)
        if mask_token_id is None:
            if tokenizer is not None:
                mask_token_id = choose_mask_token_id(tokenizer, vocab_size=vocab)
            else:
                mask_token_id = _mask_token_from_config(cfg, vocab)
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or hidden // heads),
            intermediate_size=int(cfg.intermediate_size),
            vocab_size=vocab,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 32768)),
            num_layers=num_layers,
            block_size=block_size,
            target_layer_ids=list(target_layer_ids),
            num_target_layers=num_target_layers,
            mask_token_id=int(mask_token_id),
        )


def _as_id_set(x: Any) -> set[int]:
    if x is None:
        return set()
    return {int(i) for i in x} if isinstance(x, list | tuple) else {int(x)}


def _mask_token_from_config(cfg: Any, vocab_size: int) -> int:
    declared = getattr(cfg, "mask_token_id", None)
    if declared is not None:
        return int(declared)
    pad = getattr(cfg, "pad_token_id", None)
    reserved = _as_id_set(getattr(cfg, "eos_token_id", None)) | _as_id_set(getattr(cfg, "bos_token_id", None))
    if pad is not None and int(pad) not in reserved and 0 <= int(pad) < vocab_size:
        log.info("mask_token_id: using the target's pad_token_id %d (no tokenizer given)", pad)
        return int(pad)
    log.warning(
        "mask_token_id: no tokenizer and no distinct pad token; using vocab_size-1 = %d", vocab_size - 1
    )
    return vocab_size - 1


def choose_mask_token_id(tokenizer: Any, vocab_size: int | None = None) -> int:
    """The token id that fills draft positions 1..B-1. Order, first that applies:

    1. a declared mask token (`tokenizer.mask_token_id`, or a `<|MASK|>` token as SGLang's DFlash names it);
    2. the first embedding row no token uses, len(tokenizer), when the target's vocab_size is larger: it never
       occurs in data. This is what the public Qwen3 DFlash drafters use (151669 = len(Qwen3 tokenizer));
    3. the pad token when it differs from eos/bos: packed data has no padding inside documents;
    4. vocab_size - 1 (or len(tokenizer) - 1), with a warning: it may be a real token.
    The id goes into the exported config (`dflash_config.mask_token_id`), so inference uses the same one.
    """
    declared = getattr(tokenizer, "mask_token_id", None)
    if declared is not None:
        return int(declared)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if "<|MASK|>" in vocab:
        return int(vocab["<|MASK|>"])
    num_tokens = len(tokenizer)
    if vocab_size is not None and vocab_size > num_tokens:
        return num_tokens
    pad = getattr(tokenizer, "pad_token_id", None)
    reserved = _as_id_set(getattr(tokenizer, "eos_token_id", None)) | _as_id_set(
        getattr(tokenizer, "bos_token_id", None)
    )
    if pad is not None and int(pad) not in reserved:
        return int(pad)
    last = (vocab_size or num_tokens) - 1
    log.warning("mask_token_id: no mask/unused/pad token found; using %d, which may be a real token", last)
    return last


# ---------------------------------------------------------------------------------------------- target head


class TargetHead(nn.Module):
    """The target's token embedding and lm_head, frozen. Tied targets store one tensor (moved once by `.to`)."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        self.tied = lm_head_weight is None
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        if not self.tied:
            if lm_head_weight.shape != embed_weight.shape:
                raise ValueError(
                    f"lm_head {list(lm_head_weight.shape)} and embedding {list(embed_weight.shape)} shapes differ"
                )
            self.register_buffer("lm_head", lm_head_weight.detach(), persistent=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_weight if self.tied else self.lm_head

    @property
    def vocab_size(self) -> int:
        return self.embed_weight.shape[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)


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
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _local_dir(target: str | Path) -> Path:
    """A local folder as is; a hub id through huggingface_hub's cache (config + index first, shards on demand)."""
    path = Path(target)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

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
        embed = target.get_input_embeddings().weight
        out = target.get_output_embeddings()
        tied = out is None or out.weight.data_ptr() == embed.data_ptr()
        head = TargetHead(
            embed.detach().to(dtype).clone(), None if tied else out.weight.detach().to(dtype).clone()
        )
        return head.to(device) if device is not None else head

    from safetensors import safe_open
    from transformers import AutoConfig

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
            from huggingface_hub import hf_hub_download

            file = Path(hf_hub_download(str(target), file.name))
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return f.get_tensor(key).to(dtype)

    embed = read(embed_key)
    head = TargetHead(embed, read(head_key) if head_key is not None else None)
    log.info("target head from %s: embed %s, lm_head %s", target, embed_key, head_key or "tied to embed")
    return head.to(device) if device is not None else head


# --------------------------------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary integer positions; inv_freq from transformers' rope init for the exported config,
    so training and the public inference code rotate identically (also for yarn/llama3/linear scaling)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        rope_type = config.rope_parameters["rope_type"]
        if rope_type == "default":
            dim = config.head_dim
            inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unsupported rope_type {rope_type!r}")
            if rope_type == "dynamic":
                log.warning(
                    "rope_type 'dynamic' rescales at inference past max_position_embeddings; training uses the base table"
                )
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config.to_qwen3_config(), None)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [L, heads, D]; cos/sin [L, D]. HF's rotate_half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class DraftAttention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x, context, cos, sin, mask: DraftMask) -> torch.Tensor:
        """x [Q, H] normed block states; context [S, H] context feature; cos/sin [S+Q, D] (context, then block)."""
        q_len, d = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x).view(q_len, self.num_heads, d))
        k = torch.cat([self.k_proj(context), self.k_proj(x)], dim=0).view(-1, self.num_kv_heads, d)
        v = torch.cat([self.v_proj(context), self.v_proj(x)], dim=0).view(-1, self.num_kv_heads, d)
        # one dtype for q/k/v: under autocast the norms return fp32 while v_proj returns the autocast dtype
        k = _rotate(self.k_norm(k), cos, sin).to(v.dtype)
        q = _rotate(q, cos[-q_len:], sin[-q_len:]).to(v.dtype)
        out = draft_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale=d**-0.5
        )
        return self.o_proj(out[0].transpose(0, 1).reshape(q_len, self.num_heads * d))


class DraftMLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def forward(self, x, context, cos, sin, mask: DraftMask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """N Qwen3-style layers drafting B-token blocks from the target's K-layer context feature.

    `forward(batch)` returns the final-normed hidden states of the block tokens [N, B, H]; the loss applies the
    target's lm_head (`draft_loss(out, drafter.target_head.lm_head_weight, ...)`).
    The target head is attached unregistered: move it with `drafter.target_head.to(device)` (or pass
    `device=` to `load_target_head`); `drafter.to()` moves only the drafter's own parameters.
    """

    def __init__(
        self,
        config: DrafterConfig,
        target_head: TargetHead | None = None,
        *,
        attention_backend: Backend = "auto",
    ):
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend
        h = config.hidden_size
        self.layers = nn.ModuleList(DraftDecoderLayer(config) for _ in range(config.num_layers))
        self.fc = nn.Linear(config.num_context_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.set_target_head(target_head)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Public model's init: Linear ~ N(0, initializer_range), norms = 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def set_target_head(self, head: TargetHead | None) -> None:
        if head is not None and head.vocab_size < self.config.vocab_size:
            raise ValueError(
                f"target head has {head.vocab_size} rows, config vocab_size is {self.config.vocab_size}"
            )
        # bypass nn.Module registration on purpose (see the module docstring)
        object.__setattr__(self, "_target_head", head)

    def _apply(self, fn, recurse=True):
        # `.to(device)` / `.cuda()` move the (unregistered) target head along, keeping its own dtype: a drafter
        # cast to fp32 must not turn a 250K x H bf16 embedding into fp32.
        result = super()._apply(fn, recurse)
        head = getattr(self, "_target_head", None)
        if head is not None and head.embed_weight.device != self.fc.weight.device:
            head.to(self.fc.weight.device)
        return result

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.target_head.lm_head_weight

    @property
    def target_head(self) -> TargetHead:
        if self._target_head is None:
            raise RuntimeError(
                "DFlashDrafter has no target head: pass one or call set_target_head(load_target_head(...))"
            )
        return self._target_head

    def build_mask(self, batch: DraftBatch) -> DraftMask:
        """The step's attention mask (once per step; pass it to forward to build it outside a compiled region)."""
        return build_draft_mask(
            batch.doc_ids,
            batch.anchors,
            batch.anchor_valid,
            block_size=batch.block_size,
            backend=self.attention_backend,
        )

    def forward(self, batch: DraftBatch, mask: DraftMask | None = None) -> torch.Tensor:
        num_blocks, block_size = batch.block_input_ids.shape
        dtype = self.fc.weight.dtype
        if mask is None:
            mask = self.build_mask(batch)
        hidden = batch.hidden
        if not torch.is_autocast_enabled(
            hidden.device.type
        ):  # under autocast fc casts; no fp32 copy of [S, K*H]
            hidden = hidden.to(dtype)
        context = self.hidden_norm(self.fc(hidden))  # [S, H]
        x = self.target_head.embed(batch.block_input_ids.reshape(-1)).to(dtype)  # [N*B, H]
        positions = torch.cat([batch.positions, batch.block_positions.reshape(-1)])
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, context, cos, sin, mask)
        return self.norm(x).view(num_blocks, block_size, -1)
