"""The drafter's shape (``DrafterConfig``), sized from the target's HF config, and the choice of its mask
token. Width, heads, vocabulary and rope come from the target: the drafter reuses its embedding, lm_head
and, through the context feature, its hidden space."""

from __future__ import annotations

import dataclasses
import logging
import typing
from dataclasses import dataclass
from typing import Any

from transformers import Qwen3Config

from dflash.common.drafter.layers import (
    FULL,
    SLIDING,
    DrafterArch,
    check_layer_ids,
    default_target_layer_ids,
    resolve_layer_types,
)

log = logging.getLogger(__name__)

DRAFTER_ARCHS = typing.get_args(DrafterArch)
DFLASH2_CLASS = "DFlash2DraftModel"  # = dflash.py's: that file imports nothing of this package


# Rope fields of a target that describe ITS attention, not a rope scaling the drafter shares: Qwen3.5/3.6
# rotate a quarter of each head (partial_rotary_factor 0.25) and their VL variants use multimodal rope,
# while the public drafters for them are plain Qwen3 stacks with full rotary at the target's theta.
_TARGET_ONLY_ROPE_FIELDS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


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
    extra = {k: v for k, v in extra.items() if k not in _TARGET_ONLY_ROPE_FIELDS}
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
    layer_types: list[str] | None = None
    """Per draft layer: full_attention or sliding_attention (None: all full, as in checkpoints made before sliding draft layers existed)."""
    sliding_window: int | None = None
    """W of the sliding layers (HF convention: W keys counting the query's own); None when no layer slides."""
    arch: DrafterArch = "dflash"
    """Drafter architecture: dflash (DFlash v1) or dflash2 (z-lab's DFlash2: convolutions around each draft
    sublayer and a candidate selector over the draft logits; docs/training.md, "DFlash2").
    ``from_target_config(arch="dflash2")`` also takes the target's logit multiplier and soft cap, if any."""
    conv_kernel_size: int = 2
    """DFlash2: causal taps of each block convolution (the public drafters': 2)"""
    conv_group_size: int = 16
    """DFlash2: channels sharing one per-token kernel correction (16)"""
    selector_rank: int = 256
    """DFlash2: rank of the selector's predecessor/successor codebooks (256)"""
    selector_top_k: int = 16
    """DFlash2: draft candidates the selector re-ranks per position (16)"""
    output_multiplier: float = 1.0
    """DFlash2: draft logits = softcap(lm_head(h) * output_multiplier), the target's logit recipe (1.0 for Qwen)"""
    block_causal: bool = True
    """Sliding layers causal within the block (what this project trains); False: the public DFlash2
    drafters' ``is_causal: false`` (all block keys, the window on the context only), read from their config."""
    final_logit_softcapping: float | None = None
    """DFlash2: the soft cap c of ``c * tanh(x / c)`` on the draft logits (None: none, as Qwen targets)"""
    target_fingerprint: str | None = None
    """Digest of the target's embedding and lm_head the drafter was trained with (common/target/head.py):
    dflash-eval refuses another target of the same shape. None: unknown (older checkpoints, public drafters)."""

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
        self.target_layer_ids = check_layer_ids(
            self.target_layer_ids, self.num_target_layers, what="DrafterConfig.target_layer_ids"
        )
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
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {FULL, SLIDING}:
            raise ValueError(
                f"DrafterConfig.layer_types {self.layer_types} must be {self.num_layers} of {FULL}/{SLIDING}"
            )
        if (SLIDING in self.layer_types) != (self.sliding_window is not None):
            raise ValueError(
                f"DrafterConfig.sliding_window={self.sliding_window} with layer_types {self.layer_types}: "
                "a window is needed exactly when a layer slides"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"DrafterConfig.sliding_window must be >= 1, got {self.sliding_window}")
        if self.arch not in DRAFTER_ARCHS:
            raise ValueError(f"DrafterConfig.arch must be one of {DRAFTER_ARCHS}, got {self.arch!r}")
        if self.arch == "dflash2":
            self._check_dflash2()

    def _check_dflash2(self) -> None:
        """The DFlash2 fields' ranges (SpecForge's checks): taps within the block, groups dividing the width."""
        if not 1 <= self.conv_kernel_size <= self.block_size:
            raise ValueError(
                f"DrafterConfig.conv_kernel_size must be in [1, block_size], got {self.conv_kernel_size}"
            )
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"DrafterConfig.conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}"
            )
        if self.selector_rank < 1 or not 1 <= self.selector_top_k <= self.vocab_size:
            raise ValueError(
                f"DrafterConfig.selector_rank must be >= 1 and selector_top_k in [1, {self.vocab_size}], "
                f"got {self.selector_rank}, {self.selector_top_k}"
            )

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
        """The Qwen3Config of this drafter: what ``dflash-export`` writes as config.json and what both the
        trainer's drafter and the exported ``DFlashDraftModel`` are built from. ``use_sliding_window`` must
        be true when a layer slides: transformers' Qwen3Config drops ``sliding_window`` otherwise."""
        sliding = self.sliding_window is not None
        dflash_config: dict[str, Any] = {
            "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id,
        }
        if self.arch == "dflash2":  # the public DFlash2 config (z-lab tests/fixtures/dflash2-config.json)
            dflash_config |= {
                "block_size": self.block_size,
                "conv_kernel_size": self.conv_kernel_size,
                "conv_group_size": self.conv_group_size,
                "selector_rank": self.selector_rank,
                "selector_top_k": self.selector_top_k,
                "output_multiplier": self.output_multiplier,
            }
            if self.final_logit_softcapping is not None:
                dflash_config["final_logit_softcapping"] = self.final_logit_softcapping
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
            layer_types=list(self.layer_types),
            use_sliding_window=sliding,
            sliding_window=self.sliding_window,
            max_window_layers=self.num_layers,
            attention_bias=False,
            hidden_act="silu",
            tie_word_embeddings=False,
            initializer_range=self.initializer_range,
            architectures=[DFLASH2_CLASS if self.arch == "dflash2" else "DFlashDraftModel"],
            num_target_layers=self.num_target_layers,
            block_size=self.block_size,
            dflash_config=dflash_config,
            **({} if self.block_causal else {"is_causal": False}),
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
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        arch: DrafterArch = "dflash",
    ) -> DrafterConfig:
        """Derive a drafter config from the target's HF config (`text_config` of multimodal models).

        head_dim: the target's `head_dim` when set (Qwen3), else hidden_size // num_attention_heads (Llama).
        target_layer_ids: default `default_target_layer_ids(L, num_context_layers)`.
        mask_token_id: default `choose_mask_token_id(tokenizer, vocab_size)` when a tokenizer is given, else the
        config-only rule (the config's `mask_token_id`, else pad_token_id when it differs from eos/bos, else
        vocab_size - 1).
        layer_types / sliding_window: None is ``--draft-layer-types auto`` (layers.resolve_layer_types: the
        public hybrid-target layout, all but the last layer sliding with window 2048, when the target mixes
        in linear attention; else all full).
        """
        cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = int(cfg.num_attention_heads)
        hidden = int(cfg.hidden_size)
        num_target_layers = int(cfg.num_hidden_layers)
        vocab = int(cfg.vocab_size)
        theta, scaling = _rope_from_target(cfg)
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_context_layers)
        if mask_token_id is None and tokenizer is not None:
            mask_token_id = choose_mask_token_id(tokenizer, vocab_size=vocab)
        elif mask_token_id is None:
            mask_token_id = _mask_token_from_config(cfg, vocab)
        layer_types, sliding_window = resolve_layer_types(
            layer_types, num_layers, target_config, sliding_window
        )
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
            layer_types=layer_types,
            sliding_window=sliding_window,
            **({"arch": arch} | (_target_logit_recipe(cfg) if arch == "dflash2" else {})),
        )


def _target_logit_recipe(cfg: Any) -> dict:
    """The target's logit multiplier and soft cap, where its config has them (Qwen's has neither)."""
    out: dict[str, Any] = {}
    if getattr(cfg, "output_multiplier", None) is not None:
        out["output_multiplier"] = float(cfg.output_multiplier)
    if getattr(cfg, "final_logit_softcapping", None) is not None:
        out["final_logit_softcapping"] = float(cfg.final_logit_softcapping)
    return out


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
