"""Long by necessity (one self-contained file, ~1570 lines): the whole DFlash drafter, shipped verbatim as every export's remote code.

Why one file: ``dflash-export`` copies this file into every export folder as ``dflash.py`` with
``auto_map {"AutoModel": "dflash.DFlashDraftModel"}`` (the public DFlash drafters' convention), so
``AutoModel.from_pretrained(folder, trust_remote_code=True)`` gives the trained drafter with a working
``spec_generate``. Training (``dflash-consume``), ``dflash-eval`` and the export all run this code, so what
is served is what was trained: there is no second copy of the math. It imports torch, transformers and the
standard library only (tests/test_import_rules.py keeps it that way): no ``dflash`` package is needed to
load an export.

Contents, in order:

1. config glue: ``DraftSpec``, what the math reads from a Qwen3Config carrying the DFlash fields
   (block size, mask token, target layers, layer types, sliding window);
2. the capture rule: which module of the target's decoder gives layer i's feature (``feature_module``);
3. attention: the mask rule (``visible``, ``make_mask_mod``) and its two backends (compiled
   ``flex_attention`` on CUDA, dense SDPA elsewhere);
4. the layers: norms, rotary, attention, MLP, DFlash2's block convolution and candidate selector, the
   decoder layer in its training form (one packed stream) and its inference form (blocks over cached
   context keys/values);
5. ``DraftMath``: the drafter itself (parameters named as the public model's: ``layers.{i}.…``, ``fc``,
   ``hidden_norm``, ``norm``), its training forward, its inference form and ``spec_generate``;
6. decoding: the target with its cache (rolled back exactly after a verify, hybrid targets included) and
   capture hooks (``TargetRunner``), the draft -> verify loop
   (``speculative_generate``), greedy verification and lossless speculative rejection sampling;
7. ``DFlashDraftModel``: the ``PreTrainedModel`` that ``AutoModel`` builds from an export (and
   ``DFlash2DraftModel``, the same class under the public DFlash2 name: its config turns DFlash2 on).

The attention rule (docs/training.md, "Sliding-window layers"): a block's query at position p (anchor a,
offset i, p = a + i) sees, in a full-attention layer, every context position < a of its document and all B
positions of its own block (non-causal); in a sliding-attention layer of window W, only the keys at
positions p-W+1 … p among those (W keys counting itself, the HF convention): context positions in
[a+i-W+1, a) and block offsets j <= i (causal within the block). That is what vLLM (window W, causal) and
SGLang (window_left = W-1, causal) run for sliding DFlash layers, and what SpecForge trains.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import DynamicCache, Qwen3Config
from transformers import cache_utils as hf_cache_utils
from transformers import initialization as hf_init
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel

# The cache layers of linear attention (Gated DeltaNet: Qwen3.5/3.6, Qwen3-Next), in transformers 5.17 and later;
# None in older ones, where a target with such layers is refused (``linear_state_layers``).
LinearAttentionCacheLayerMixin = getattr(hf_cache_utils, "LinearAttentionCacheLayerMixin", None)
CacheLayerMixin = getattr(hf_cache_utils, "CacheLayerMixin", None)

# ------------------------------------------------------------------------------------------ 1. config glue

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)

DFLASH2_CLASS = "DFlash2DraftModel"
"""``architectures[0]`` of a DFlash2 drafter's config.json (z-lab's public DFlash2 checkpoints): every draft
layer wraps attention and MLP in a grouped dynamic causal convolution over the block, and a candidate
selector re-ranks each position's top-k draft tokens (``GroupedDynamicCausalConv``, ``CandidateSelector``)."""
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
"""The public DFlash2 drafters' values of the four extra ``dflash_config`` fields."""


@dataclass(frozen=True, kw_only=True)
class DraftSpec:
    """What the drafter's math reads from its config beyond the module shapes. Built from the exported
    ``config.json`` (a Qwen3Config with the DFlash fields), the one source of truth for both the trainer's
    drafter and the served one."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]
    sliding_window: int | None
    """W of the sliding layers (HF convention: the window includes the current token); None: no sliding layer."""
    initializer_range: float = 0.02
    arch: Literal["dflash", "dflash2"] = "dflash"
    """dflash2 when the config's ``architectures`` names ``DFlash2DraftModel``; the four fields below are
    then read from ``dflash_config`` (0 for dflash: no convolution, no selector)."""
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    output_multiplier: float = 1.0
    """The draft logits are ``softcap(lm_head(h) * output_multiplier)`` (``DraftMath.logits``): the target's
    own logit recipe, 1.0 and no cap for targets without one (Qwen); DFlash2 configs carry both."""
    final_logit_softcapping: float | None = None
    block_causal: bool = True
    """Sliding layers causal within the block (ours, vLLM's and SGLang's rule); False when the config says
    ``is_causal: false`` (the public DFlash2 drafters: z-lab's code then lets sliding layers see the whole
    block, the window on the context only)."""

    @property
    def dflash2(self) -> bool:
        return self.arch == "dflash2"

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``lm_head`` scores -> the draft's logits: times ``output_multiplier``, then the soft cap
        ``c * tanh(x / c)`` (z-lab DFlash2 ``compute_logits``). The identity at the defaults."""
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        cap = self.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def window(self, layer_type: str) -> int | None:
        """The attention window of a layer of this type (None: full attention)."""
        return self.sliding_window if layer_type == SLIDING else None

    @classmethod
    def from_config(cls, config: Any) -> DraftSpec:
        """Read a Qwen3Config (or any object with its attributes) carrying the DFlash fields; ValueError,
        one line naming the field, when one is missing or wrong.

        ``block_size``: ``dflash_config.block_size`` first, then the top level (SGLang's order);
        ``layer_types``: all ``full_attention`` when absent; ``sliding_window``: required when a layer slides.
        """
        dflash = getattr(config, "dflash_config", None) or {}
        if not isinstance(dflash, dict):
            raise ValueError(f"config dflash_config must be a dict, got {type(dflash).__name__}")
        num_layers = int(config.num_hidden_layers)
        block_size = dflash.get("block_size", getattr(config, "block_size", None))
        for name, value in (
            ("block_size", block_size),
            ("dflash_config.mask_token_id", dflash.get("mask_token_id")),
            ("dflash_config.target_layer_ids", dflash.get("target_layer_ids")),
        ):
            if value is None:
                raise ValueError(f"config has no {name}")
        layer_types = tuple(getattr(config, "layer_types", None) or [FULL] * num_layers)
        if len(layer_types) != num_layers or set(layer_types) - set(LAYER_TYPES):
            raise ValueError(
                f"config layer_types {list(layer_types)} must be {num_layers} of {'/'.join(LAYER_TYPES)}"
            )
        window = getattr(config, "sliding_window", None) if SLIDING in layer_types else None
        if SLIDING in layer_types and (window is None or int(window) < 1):
            raise ValueError(
                f"config sliding_window is {window!r} but layers slide (write use_sliding_window: true and "
                "a positive sliding_window)"
            )
        if int(block_size) < 2:
            raise ValueError(f"config block_size must be >= 2, got {block_size}")
        dflash2 = DFLASH2_CLASS in (getattr(config, "architectures", None) or [])
        extra = _dflash2_fields(config, dflash, int(block_size)) if dflash2 else {}
        cap = dflash.get("final_logit_softcapping", getattr(config, "final_logit_softcapping", None))
        return cls(
            block_causal=getattr(config, "is_causal", None) is not False,
            arch="dflash2" if dflash2 else "dflash",
            output_multiplier=float(dflash.get("output_multiplier", 1.0)),
            final_logit_softcapping=None if cap is None else float(cap),
            **extra,
            block_size=int(block_size),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
            layer_types=layer_types,
            sliding_window=None if window is None else int(window),
            initializer_range=float(getattr(config, "initializer_range", 0.02) or 0.02),
        )


def _dflash2_fields(config: Any, dflash: dict, block_size: int) -> dict[str, int]:
    """DFlash2's four ``dflash_config`` fields (the public defaults where absent), range-checked as
    SpecForge checks them; ValueError, one line, otherwise."""
    extra = {k: int(dflash.get(k, v)) for k, v in DFLASH2_DEFAULTS.items()}
    hidden, vocab = int(config.hidden_size), int(config.vocab_size)
    if not 1 <= extra["conv_kernel_size"] <= block_size:
        raise ValueError(f"config dflash_config.conv_kernel_size must be in [1, block_size], got {extra}")
    if extra["conv_group_size"] < 1 or hidden % extra["conv_group_size"]:
        raise ValueError(
            f"config dflash_config.conv_group_size must divide hidden_size {hidden}, got {extra}"
        )
    if extra["selector_rank"] < 1 or not 1 <= extra["selector_top_k"] <= vocab:
        raise ValueError(
            f"config dflash_config selector_rank >= 1, selector_top_k in [1, {vocab}], got {extra}"
        )
    return extra


def head_dim_of(config: Any) -> int:
    """The config's ``head_dim``, else hidden_size // num_attention_heads (as every Qwen3 reader does)."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


# ---------------------------------------------------------------------------------------- 2. capture rule


def find_decoder(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """(text model, its decoder layers, its final norm) of a causal LM or its multimodal wrapper."""
    config = model.config
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = text_cfg.num_hidden_layers
    for mod in model.modules():
        layers = getattr(mod, "layers", None)
        if (
            isinstance(layers, nn.ModuleList)
            and len(layers) == num_layers
            and hasattr(mod, "embed_tokens")
            and isinstance(getattr(mod, "norm", None), nn.Module)
        ):
            return mod, layers, mod.norm
    raise ValueError(
        f"{type(model).__name__}: no decoder with {num_layers} layers, embed_tokens and norm found"
    )


def feature_module(layers: nn.ModuleList, norm: nn.Module, layer_id: int) -> nn.Module:
    """THE capture rule: the module whose output is target layer ``layer_id``'s feature.

    Layer i's feature is the output of decoder layer i, HF ``hidden_states[i + 1]`` (what the public
    ``extract_context_feature`` reads); HF takes the last entry of ``hidden_states`` after the final norm,
    so for i = L-1 the feature is the final norm's output. The producer's capture, ``dflash-eval`` and
    ``spec_generate`` all hook the module this returns.
    """
    if not 0 <= layer_id < len(layers):
        raise ValueError(f"target layer {layer_id} does not exist in a {len(layers)}-layer target")
    return norm if layer_id == len(layers) - 1 else layers[layer_id]


# ------------------------------------------------------------------------------------------- 3. attention

Backend = Literal["auto", "flex", "sdpa"]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Compiled once per process, lazily: compiling at import would cost every CPU-only user (tests, CLIs) the
# compile time, and compiling per call would recompile every step.
_compiled_flex_attention: Callable | None = None
_FLEX_KERNEL = {"FORCE_USE_FLEX_ATTENTION": True}
_compiled_block_mask: Callable | None = None


def resolve_backend(backend: Backend, device: torch.device) -> Literal["flex", "sdpa"]:
    """``auto`` picks flex on CUDA (fused, sparse) and SDPA elsewhere (flex has no backward on CPU)."""
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if backend not in ("flex", "sdpa"):
        raise ValueError(f"attention backend must be 'auto', 'flex' or 'sdpa', got {backend!r}")
    return backend


def visible(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    anchor: torch.Tensor,
    k_in_block: torch.Tensor,
    sliding_window: int | None,
    block_causal: bool = True,
) -> torch.Tensor:
    """THE attention rule on positions, for keys already known to be of the query's document (context)
    or of its own block: a context key is visible iff it precedes the anchor (at inference the target's
    feature at the anchor does not exist yet when the block is drafted); a block key always (full layers).
    A sliding layer keeps only keys at positions q-W+1 … q: causal within the block, a window of W keys
    (``block_causal`` False: every block key, the window on the context only; the public DFlash2
    drafters' ``is_causal: false``). Broadcasting-safe ops only, so flex evaluates it per element and SDPA
    on index grids."""
    seen = k_in_block | (k_pos < anchor)
    if sliding_window is not None:
        in_window = (k_pos <= q_pos) & (q_pos - k_pos < sliding_window)
        seen = seen & (in_window if block_causal else in_window | k_in_block)
    return seen


def make_mask_mod(
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    block_causal: bool = True,
) -> MaskMod:
    """The training step's visibility as a flex ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    One packed stream: S context tokens (documents back to back, doc id -1 = padding), then N blocks of B.
    Query q is block b = q // B, offset q % B; a context key kv < S counts iff it lies in the anchor's
    document, a block key iff it is in block b; then ``visible`` decides. A document is contiguous in the
    stream, so stream-index differences are position differences (what the window measures). Padding blocks
    see nothing.
    """
    context_len = doc_ids.shape[0]
    anchor_doc = doc_ids[anchors]

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        anchor = anchors[block]
        in_context = kv_idx < context_len
        same_doc = doc_ids[kv_idx.clamp(max=context_len - 1)] == anchor_doc[block]
        same_block = (kv_idx - context_len) // block_size == block
        q_pos = anchor + q_idx % block_size
        k_pos = torch.where(in_context, kv_idx, anchor + (kv_idx - context_len) % block_size)
        candidate = torch.where(in_context, same_doc, same_block)
        seen = visible(q_pos, k_pos, anchor, ~in_context, sliding_window, block_causal)
        return anchor_valid[block] & candidate & seen

    return mask_mod


def dense_mask(mask_mod: MaskMod, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Evaluate ``mask_mod`` on the full [q_len, kv_len] grid by broadcasting (the SDPA backend and tests)."""
    zero = torch.zeros((), dtype=torch.int64, device=device)
    q_idx = torch.arange(q_len, device=device)[:, None]
    kv_idx = torch.arange(kv_len, device=device)[None, :]
    return mask_mod(zero, zero, q_idx, kv_idx).expand(q_len, kv_len)


def _draft_block_mask(
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
    kv_len: int,
    sliding_window: int | None,
    block_causal: bool = True,
) -> BlockMask:
    # The mask_mod closure is created inside this function so that, when compiled, its tensors are graph
    # inputs (no guard on a per-step closure object -> no recompile per step; one compile per layer type).
    mask_mod = make_mask_mod(doc_ids, anchors, anchor_valid, block_size, sliding_window, block_causal)
    q_len = anchors.shape[0] * block_size
    return create_block_mask(mask_mod, None, None, q_len, kv_len, device=doc_ids.device)


@dataclass(kw_only=True)
class DraftMask:
    """Everything the attention of one step needs for one layer type; built once per step."""

    backend: Literal["flex", "sdpa"]
    row_valid: torch.Tensor  # [Q] bool: query rows of valid blocks (others must output exactly 0)
    block_mask: BlockMask | None = None  # flex backend
    dense: torch.Tensor | None = None  # sdpa backend: [Q, KV] bool, rows of padding blocks opened (see below)


def build_draft_mask(
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    *,
    block_size: int,
    backend: Backend = "auto",
    compile_mask: bool | None = None,
    sliding_window: int | None = None,
    block_causal: bool = True,
) -> DraftMask:
    """The step's mask for ``draft_attention`` (once per step and layer type, not per layer).

    doc_ids [S] int (-1 = padding), anchors [N] int64 (index into the packed stream), anchor_valid [N] bool.
    ``compile_mask`` (default: on CUDA) builds the flex BlockMask with a compiled ``create_block_mask``,
    which never materialises the dense [Q, KV] mask; eager creation does (fine only for small shapes).
    """
    device = doc_ids.device
    resolved = resolve_backend(backend, device)
    num_blocks = anchors.shape[0]
    kv_len = doc_ids.shape[0] + num_blocks * block_size
    row_valid = anchor_valid.repeat_interleave(block_size)
    if resolved == "flex":
        if compile_mask is None:
            compile_mask = device.type == "cuda"
        fn = _draft_block_mask
        if compile_mask:
            global _compiled_block_mask
            if _compiled_block_mask is None:
                _compiled_block_mask = torch.compile(_draft_block_mask, dynamic=False)
            fn = _compiled_block_mask
        block_mask = fn(doc_ids, anchors, anchor_valid, block_size, kv_len, sliding_window, block_causal)
        return DraftMask(backend="flex", row_valid=row_valid, block_mask=block_mask)
    mask_mod = make_mask_mod(doc_ids, anchors, anchor_valid, block_size, sliding_window, block_causal)
    dense = dense_mask(mask_mod, row_valid.shape[0], kv_len, device)
    # A fully masked row makes SDPA's softmax 0/0 = NaN, and zeroing the output afterwards does not stop the NaN
    # from reaching dK/dV in backward. So padding rows attend to everything and their output is zeroed instead:
    # their upstream gradient is then exactly 0, which contributes exactly 0 to every other gradient.
    return DraftMask(backend="sdpa", row_valid=row_valid, dense=dense | ~row_valid[:, None])


def _flex_fn(device: torch.device) -> Callable:
    if device.type != "cuda":
        return flex_attention  # eager flex on CPU: forward only, materialises scores (the tests' cross-check)
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention


def recompile_count() -> int:
    """Frames torch.compile has compiled in this process so far (first compiles and recompiles alike).

    Every compiled entry point (flex_attention, the block-mask builder, a compiled train step) compiles once
    per distinct shape and layer type; a rise after warm-up with steady shapes is a recompile, i.e. a bug.
    """
    return int(counters["frames"]["total"])


def draft_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DraftMask, *, scale: float | None = None
) -> torch.Tensor:
    """Block queries over [context | blocks] keys under the DFlash mask of one layer type.

    q [1, Hq, Q, D]; k, v [1, Hkv, KV, D] with Hq a multiple of Hkv (GQA). Returns [1, Hq, Q, D]; rows of
    padding blocks are exactly 0 in both backends.
    """
    enable_gqa = q.shape[1] != k.shape[1]
    if mask.backend == "flex":
        # the training kernel at every query length: inductor would lower a short query (<= 128 rows, e.g.
        # few anchors) to flex_decoding, which found no kernel for it on an H200 (fp32, head_dim 16)
        out = _flex_fn(q.device)(
            q,
            k,
            v,
            block_mask=mask.block_mask,
            scale=scale,
            enable_gqa=enable_gqa,
            kernel_options=_FLEX_KERNEL,
        )
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.dense, scale=scale, enable_gqa=enable_gqa
        )
    return out * mask.row_valid[:, None].to(out.dtype)


# ---------------------------------------------------------------------------------------------- 4. layers


class TargetHead(nn.Module):
    """The target's token embedding and lm_head, frozen. Tied targets store one tensor (moved once by `.to`)."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        self.tied = lm_head_weight is None
        self.fingerprint: str | None = None  # of the weights it was read from (dflash.common.target.head)
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        if not self.tied:
            if lm_head_weight.shape != embed_weight.shape:
                raise ValueError(
                    f"lm_head {list(lm_head_weight.shape)} and embedding {list(embed_weight.shape)} shapes differ"
                )
            self.register_buffer("lm_head", lm_head_weight.detach(), persistent=False)

    @classmethod
    def of(cls, target: nn.Module) -> TargetHead:
        """The head of an in-memory HF target, sharing its tensors (no copy)."""
        embed = target.get_input_embeddings().weight
        out = target.get_output_embeddings()
        tied = out is None or out.weight.data_ptr() == embed.data_ptr()
        return cls(embed, None if tied else out.weight)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_weight if self.tied else self.lm_head

    @property
    def vocab_size(self) -> int:
        return self.embed_weight.shape[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)


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


def _rope_parameters(config: Any) -> dict:
    """transformers-5 ``rope_parameters`` of a config (flat: rope_type, rope_theta, scaling fields)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" not in params and FULL in params:  # per-layer-type rope
        params = params[FULL]
    if isinstance(params, dict) and "rope_theta" in params:
        return {"rope_type": "default", **params}
    return {"rope_type": "default", "rope_theta": float(getattr(config, "rope_theta", 10000.0))}


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary integer positions; inv_freq from transformers' rope init for the config, so
    training and any Qwen3 reader of the exported config rotate identically (also yarn/llama3/linear)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        inv_freq, scaling = self.compute_inv_freq()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = scaling

    def compute_inv_freq(self) -> tuple[torch.Tensor, float]:
        params = _rope_parameters(self.config)
        if params["rope_type"] == "default":
            dim, theta = head_dim_of(self.config), float(params["rope_theta"])
            return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
        if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope_type {params['rope_type']!r}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](self.config, None)
        return inv_freq.float(), float(scaling)

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
    """Queries from the block only; keys/values from the context feature (no input norm) and the block.
    ``k_norm`` applies to both halves, ``q_norm`` to the queries; rotary at each token's position."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        h, d = config.hidden_size, head_dim_of(config)
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

    def queries(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[n, H] normed block states -> rotated queries [n, heads, D]."""
        return _rotate(self.q_norm(self.q_proj(h).view(h.shape[0], self.num_heads, self.head_dim)), cos, sin)

    def keys_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, H] (context feature or normed block states) -> rotated keys, values [n, kv_heads, D]. They
        depend on x alone, so a decode projects each context position once and caches it."""
        n = x.shape[0]
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        # one dtype for q/k/v: under autocast the norms return fp32 while v_proj returns the autocast dtype
        k = _rotate(self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)), cos, sin).to(
            v.dtype
        )
        return k, v

    def forward(self, x, context, cos, sin, mask: DraftMask) -> torch.Tensor:
        """Training form. x [Q, H] normed block states; context [S, H]; cos/sin [S+Q, D] (context, then block)."""
        s, q_len = context.shape[0], x.shape[0]
        q = self.queries(x, cos[s:], sin[s:])
        k_ctx, v_ctx = self.keys_values(context, cos[:s], sin[:s])
        k_blk, v_blk = self.keys_values(x, cos[s:], sin[s:])
        k, v = torch.cat([k_ctx, k_blk]), torch.cat([v_ctx, v_blk])
        out = draft_attention(
            q.to(v.dtype).transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            mask,
            scale=self.head_dim**-0.5,
        )
        return self.o_proj(out[0].transpose(0, 1).reshape(q_len, self.num_heads * self.head_dim))

    def attend_blocks(self, h, cos, sin, keys, values, visible_mask) -> torch.Tensor:
        """Inference form. h [A, B, H] normed block states; cos/sin [A*B, D]; keys/values [A, L, kv_heads, D]
        of each block's context (None: no context); visible_mask [A, 1, B, L+B] bool. -> [A, B, H]."""
        a, b, _ = h.shape
        flat = h.reshape(a * b, -1)
        q = self.queries(flat, cos, sin).view(a, b, self.num_heads, self.head_dim)
        k, v = self.keys_values(flat, cos, sin)
        k, v = k.view(a, b, self.num_kv_heads, self.head_dim), v.view(a, b, self.num_kv_heads, self.head_dim)
        if keys is not None:
            k, v = torch.cat([keys, k], dim=1), torch.cat([values, v], dim=1)
        out = F.scaled_dot_product_attention(
            q.to(v.dtype).transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=visible_mask,
            scale=self.head_dim**-0.5,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [A, heads, B, D]
        return self.o_proj(out.transpose(1, 2).reshape(a, b, self.num_heads * self.head_dim))


class DraftMLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedDynamicCausalConv(nn.Module):
    """DFlash2's convolution around one sublayer (attention or MLP) of a draft layer, over the block.

    Tap j of position t reads position t - j of the SAME block (zeros before the block's first position:
    a block never reads its neighbour in the packed training stream, nor anything at decode). Tap j's
    weight per channel is a static ``base_kernel[., j]`` plus a per-token correction predicted from the
    sublayer's input by ``kernel_projection`` and shared by each group of ``group_size`` channels. One
    projection predicts both convolutions' corrections: [0] before the sublayer, [1] after it. Initialised
    to the identity (self tap 1, other taps 0, projection 0), so a new DFlash2 layer is exactly a DFlash
    layer. Parameter names and shapes are the public checkpoints': ``base_kernel`` [2, taps, H],
    ``kernel_projection.weight`` [2 * taps * H / group, H].
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.kernel_projection.zero_init = (
            True  # DFlashDraftModel._init_weights: not N(0, std) as other Linears
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, which: int) -> torch.Tensor:
        """x [A, B, H] blocks; dynamic [A, B, 2, taps, groups] -> [A, B, H]."""
        a, b, h = x.shape
        xs = x.view(a, b, self.groups, self.group_size)
        out = None
        for j in range(self.kernel_size):
            if j == 0:
                shifted = xs
            else:  # position t reads t - j of its own block; the first j positions read zeros
                shifted = torch.cat(
                    [xs.new_zeros(a, min(j, b), self.groups, self.group_size), xs[:, : b - j]], 1
                )
            weight = (
                self.base_kernel[which, j].view(self.groups, self.group_size)
                + dynamic[:, :, which, j, :, None]
            )
            term = weight.to(x.dtype) * shifted
            out = term if out is None else out + term
        return out.view(a, b, h)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sublayer's input convolved, the corrections ``finish`` needs) of x [A, B, H]."""
        dynamic = self.kernel_projection(x).view(*x.shape[:2], 2, self.kernel_size, self.groups)
        return self._convolve(x, dynamic, 0), dynamic

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(y, dynamic, 1)


class CandidateSelector(nn.Module):
    """DFlash2's path selector: each draft position keeps its top-k draft tokens (by the unary logit U_t)
    and scores candidate b after predecessor a as ``U_t(b) + <P[a] * W h_t, S[b]>`` (rank-r codebooks
    ``predecessor_codebook`` P, ``successor_codebook`` S and ``hidden_projection`` W, the public names). A
    decode walks the block from the anchor, each step conditioned on the token it picked; training scores
    the true predecessors (``common/drafter/loss.py``). S starts at zero, so a new selector returns the
    unary ranking: the drafter starts as DFlash."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def reset_parameters(self, std: float = 0.02) -> None:
        with torch.no_grad():
            nn.init.normal_(self.predecessor_codebook, mean=0.0, std=std)
            nn.init.normal_(self.hidden_projection.weight, mean=0.0, std=std)
            self.successor_codebook.zero_()

    def scores(
        self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor, predecessors: torch.Tensor
    ) -> torch.Tensor:
        """hidden [..., H], unary and candidates [..., k], predecessors [...] -> scores [..., k]."""
        gate = F.embedding(predecessors, self.predecessor_codebook) * self.hidden_projection(hidden)
        pair = (gate[..., None, :] * F.embedding(candidates, self.successor_codebook)).sum(-1)
        return unary + pair.to(unary.dtype)

    def walk(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int, sampling: Sampling | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One block's path: hidden [n, H] and draft logits [n, V] of positions 1..n -> (tokens [n], the
        distribution each was drawn from [n, V] when sampling, else None). Greedy takes each step's best
        score; sampling draws from the warped softmax of the scores (so q is known: lossless)."""
        unary, candidates = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1)
        predecessor = torch.tensor(anchor, device=hidden.device)
        tokens, rows = [], []
        for t in range(hidden.shape[0]):
            s = self.scores(hidden[t], unary[t], candidates[t], predecessor)
            if sampling is None or sampling.greedy:
                pick = s.argmax()
            else:
                q = warp_probs(s, sampling)
                pick = _draw(q, sampling.generator)
                rows.append(torch.zeros_like(logits[t], dtype=torch.float32).scatter(0, candidates[t], q))
            predecessor = candidates[t, pick]
            tokens.append(predecessor)
        probs = torch.stack(rows) if rows else None
        return torch.stack(tokens) if tokens else candidates[:, 0], probs


class DraftDecoderLayer(nn.Module):
    """A Qwen3-style decoder layer whose attention reads the context feature; ``layer_type`` says which
    mask it uses (full or sliding). With ``spec.dflash2`` each sublayer sits inside a
    ``GroupedDynamicCausalConv`` (``attention_conv``, ``mlp_conv``: the public names)."""

    def __init__(self, config: Qwen3Config, layer_type: str, spec: DraftSpec | None = None):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)
        self.attention_conv = self.mlp_conv = None
        if spec is not None and spec.dflash2:
            h = config.hidden_size
            with torch.random.fork_rng(
                devices=[]
            ):  # DFlash's draws stay DFlash's (DraftMath.reset_parameters)
                self.attention_conv = GroupedDynamicCausalConv(h, spec.conv_kernel_size, spec.conv_group_size)
                self.mlp_conv = GroupedDynamicCausalConv(h, spec.conv_kernel_size, spec.conv_group_size)

    def forward(self, x, context, cos, sin, mask: DraftMask, block_size: int = 0) -> torch.Tensor:
        """Training form: x [N*B, H] block states of the packed step (``block_size`` B: DFlash2's
        convolutions run within each block of B rows)."""
        if self.attention_conv is None:
            x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        n = x.shape[0]
        blocks = x.view(n // block_size, block_size, -1)
        attend = lambda h: self.self_attn(h.reshape(n, -1), context, cos, sin, mask).view_as(h)  # noqa: E731
        return self._dflash2(blocks, attend).reshape(n, -1)

    def block_forward(self, x, cos, sin, keys, values, visible_mask) -> torch.Tensor:
        """Inference form: x [A, B, H], A blocks over their cached context (``DraftAttention.attend_blocks``)."""
        if self.attention_conv is not None:
            return self._dflash2(
                x, lambda h: self.self_attn.attend_blocks(h, cos, sin, keys, values, visible_mask)
            )
        x = x + self.self_attn.attend_blocks(self.input_layernorm(x), cos, sin, keys, values, visible_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _dflash2(self, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x [A, B, H]: norm -> conv -> sublayer -> conv (corrections from the normed input) -> residual,
        for attention, then for the MLP (z-lab DFlash2's decoder layer)."""
        h, dynamic = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(attend(h), dynamic)
        h, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), dynamic)


# ------------------------------------------------------------------------------------------- 5. the drafter


class DraftMath:
    """The DFlash drafter: N decoder layers drafting B-token blocks from the target's K-layer context
    feature ``hidden_norm(fc(concat of K target layers))``, with the target's frozen embedding and lm_head.

    A mixin of ``nn.Module`` classes, so that the one implementation serves two shells: the trainer's
    ``DFlashDrafter`` (dflash.common.drafter.model, configured by the project's ``DrafterConfig``) and the
    exported ``DFlashDraftModel`` (a transformers ``PreTrainedModel`` configured by ``config.json``). Both
    build their modules with ``_build_draft`` from the same Qwen3Config, so their state dicts are equal.

    The target head is attached unregistered (not a parameter, not a buffer): it is never trained, saved,
    handed to the optimizer or broadcast by DDP (which broadcasts every registered buffer: a 250K x H
    embedding each step would be ruinous). ``.to(device)`` moves it along, keeping its dtype.
    """

    spec: DraftSpec
    layers: nn.ModuleList
    fc: nn.Linear

    def _build_draft(self, config: Qwen3Config, attention_backend: Backend = "auto") -> None:
        self.spec = DraftSpec.from_config(config)
        self.attention_backend = attention_backend
        h = config.hidden_size
        self.layers = nn.ModuleList(DraftDecoderLayer(config, t, self.spec) for t in self.spec.layer_types)
        self.fc = nn.Linear(len(self.spec.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        if self.spec.dflash2:
            with torch.random.fork_rng(devices=[]):
                self.candidate_selector = CandidateSelector(
                    config.vocab_size, h, self.spec.selector_rank, self.spec.selector_top_k
                )
        object.__setattr__(self, "_target_head", None)

    # ------------------------------------------------------------------ parameters and the target head
    def reset_parameters(self) -> None:
        """The public model's init: Linear ~ N(0, initializer_range), norms = 1. DFlash2's convolutions and
        selector are drawn after the rest (identity convolutions, zero successor codebook), so a DFlash2
        drafter of a seed has the DFlash drafter's weights of that seed and computes what it computes."""
        extra = [m for m in self.modules() if isinstance(m, GroupedDynamicCausalConv | CandidateSelector)]
        inside = {id(sub) for m in extra for sub in m.modules()}
        for module in self.modules():
            if id(module) in inside:
                continue
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.spec.initializer_range)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        for module in extra:
            if isinstance(module, CandidateSelector):
                module.reset_parameters(self.spec.initializer_range)
            else:
                module.reset_parameters()

    def reset_rotary(self) -> None:
        """Recompute the rotary table in fp32 (after building on the meta device, or a cast)."""
        inv_freq, _ = self.rotary_emb.compute_inv_freq()
        self.rotary_emb.inv_freq = inv_freq.to(self.fc.weight.device)

    def set_target_head(self, head: TargetHead | None) -> None:
        vocab = getattr(self.config, "vocab_size", None)
        if head is not None and vocab is not None and head.vocab_size < vocab:
            raise ValueError(f"target head has {head.vocab_size} rows, config vocab_size is {vocab}")
        object.__setattr__(self, "_target_head", head)  # unregistered on purpose (see the class docstring)

    def attach_target(self, target: nn.Module) -> None:
        """Borrow an in-memory HF target's embedding and lm_head (shared, not copied), as the public loop does."""
        self.set_target_head(TargetHead.of(target))

    @property
    def target_head(self) -> TargetHead:
        if self._target_head is None:
            raise RuntimeError(
                "the drafter has no target head: pass one, set_target_head(...) or attach_target(target)"
            )
        return self._target_head

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.target_head.lm_head_weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token scores of final-normed hidden states [..., H]: the target's lm_head, in its dtype (then
        the config's output multiplier and soft cap, ``DraftSpec.scale_logits``; none for DFlash)."""
        head = self.lm_head_weight
        return self.spec.scale_logits(hidden.to(head.dtype) @ head.t())

    def _apply(self, fn, recurse=True):
        # `.to(device)` / `.cuda()` move the (unregistered) target head along, keeping its own dtype: a drafter
        # cast to fp32 must not turn a 250K x H bf16 embedding into fp32.
        result = super()._apply(fn, recurse)
        head = getattr(self, "_target_head", None)
        if head is not None and head.embed_weight.device != self.fc.weight.device:
            head.to(self.fc.weight.device)
        return result

    # ------------------------------------------------------------------------------- training form
    def build_mask(self, batch: Any) -> dict[str, DraftMask]:
        """The step's masks, one per layer type present (once per step, outside any compiled region).
        ``batch``: a DraftBatch (doc_ids, anchors, anchor_valid, block_size)."""
        return {
            t: build_draft_mask(
                batch.doc_ids,
                batch.anchors,
                batch.anchor_valid,
                block_size=batch.block_size,
                backend=self.attention_backend,
                sliding_window=self.spec.window(t),
                block_causal=self.spec.block_causal,
            )
            for t in dict.fromkeys(self.spec.layer_types)
        }

    def forward(self, batch: Any, mask: dict[str, DraftMask] | None = None) -> torch.Tensor:
        """Final-normed hidden states [N, B, H] of a packed training step's blocks (apply the target's
        lm_head for logits). ``batch``: a DraftBatch (hidden [S, K*H], positions [S], block_input_ids
        [N, B], block_positions [N, B], and what ``build_mask`` reads)."""
        num_blocks, block_size = batch.block_input_ids.shape
        dtype = self.fc.weight.dtype
        masks = self.build_mask(batch) if mask is None else mask
        hidden = batch.hidden
        # under autocast fc casts; no fp32 copy of [S, K*H]
        if not torch.is_autocast_enabled(hidden.device.type):
            hidden = hidden.to(dtype)
        context = self.hidden_norm(self.fc(hidden))  # [S, H]
        x = self.target_head.embed(batch.block_input_ids.reshape(-1)).to(dtype)  # [N*B, H]
        positions = torch.cat([batch.positions, batch.block_positions.reshape(-1)])
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, context, cos, sin, masks[layer.layer_type], block_size)
        return self.norm(x).view(num_blocks, block_size, -1)

    # ------------------------------------------------------------------------------ inference form
    def context_keys_values(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's keys and values [n, kv_heads, D] of context features [n, K*H] at ``positions`` [n]:
        they depend on the shared context feature only, not on a layer's input, so a decode computes them
        once per position."""
        dtype = self.fc.weight.dtype
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.device, dtype)))
        cos, sin = self.rotary_emb(positions.to(context.device), dtype)
        pairs = [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]
        return [k for k, _ in pairs], [v for _, v in pairs]

    def draft_hidden(
        self,
        block_ids: torch.Tensor,
        anchor_pos: torch.Tensor,
        keys: Sequence[torch.Tensor] | None,
        values: Sequence[torch.Tensor] | None,
        block_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [A, B, H] of A blocks ``block_ids`` [A, B] anchored at ``anchor_pos``
        [A], each over its own context: ``keys``/``values`` per layer [A, L, kv_heads, D] for positions
        0..L-1 (None: no context). The rule is ``visible``'s, so context keys at or past a block's anchor are
        masked (a batch pads contexts to one L); ``block_len`` [A] masks block keys past a shortened block.
        The inference form of ``forward`` (tests compare the two)."""
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        a, b = block_ids.shape
        anchor_pos = anchor_pos.to(device)
        ctx_len = 0 if keys is None else keys[0].shape[1]
        positions = anchor_pos[:, None] + torch.arange(b, device=device)  # [A, B]
        k_pos = torch.cat([torch.arange(ctx_len, device=device).expand(a, ctx_len), positions], dim=1)
        k_in_block = (torch.arange(ctx_len + b, device=device) >= ctx_len)[None, None, :]
        real = torch.ones(a, 1, ctx_len + b, dtype=torch.bool, device=device)
        if block_len is not None:
            real[:, 0, ctx_len:] = torch.arange(b, device=device) < block_len.to(device)[:, None]
        masks = {
            t: (
                real
                & visible(
                    positions[:, :, None],
                    k_pos[:, None, :],
                    anchor_pos[:, None, None],
                    k_in_block,
                    self.spec.window(t),
                    self.spec.block_causal,
                )
            )[:, None]
            for t in dict.fromkeys(self.spec.layer_types)
        }  # [A, 1, B, L+B] per layer type
        x = self.target_head.embed(block_ids.to(device)).to(dtype)
        cos, sin = self.rotary_emb(positions.reshape(-1), dtype)
        for i, layer in enumerate(self.layers):
            x = layer.block_forward(
                x,
                cos,
                sin,
                None if keys is None else keys[i],
                None if values is None else values[i],
                masks[layer.layer_type],
            )
        return self.norm(x)

    @torch.inference_mode()
    def spec_generate(
        self,
        target: nn.Module,
        input_ids: torch.LongTensor,
        max_new_tokens: int,
        stop_token_ids: Sequence[int] | None,
        temperature: float,
        *,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        return_stats: bool = False,
    ) -> torch.Tensor | SimpleNamespace:
        """The public DFlash call: speculative decoding of ``input_ids`` [1, P] with ``target`` (an
        in-memory HF causal LM on this drafter's device) -> output ids [1, P + new] (prompt included, cut
        after the first stop token). ``temperature`` < 1e-5 is greedy (token for token the target's greedy
        decoding); above, lossless speculative rejection sampling with ``top_p`` (every token distributed as
        the target's own sampling). ``return_stats``: a namespace with output_ids, num_input_tokens,
        num_output_tokens, acceptance_lengths (tokens per verify step), the Generation and wall time."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be [1, P] (batch size 1), got {list(input_ids.shape)}")
        self.eval()
        self.attach_target(target)
        sampling = Sampling(temperature=float(temperature), top_p=top_p, generator=generator)
        runner = TargetRunner(target, self.spec.target_layer_ids)
        try:
            gen = speculative_generate(
                runner,
                DrafterProposer(self),
                input_ids[0],
                max_new_tokens=max_new_tokens,
                stop_token_ids=stop_token_ids or (),
                sampling=sampling,
            )
        finally:
            runner.close()
        new = torch.tensor(gen.tokens, dtype=input_ids.dtype, device=input_ids.device)
        output_ids = torch.cat([input_ids, new[None]], dim=1)
        if not return_stats:
            return output_ids
        return SimpleNamespace(
            output_ids=output_ids,
            num_input_tokens=input_ids.shape[1],
            num_output_tokens=len(gen.tokens),
            acceptance_lengths=[n for _, _, n in gen.steps],
            generation=gen,
            wall_s=gen.wall_s,
        )


# ------------------------------------------------------------------------------------------- 6. decoding


LINEAR_ATTENTION = "linear_attention"
STATEFUL_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "mamba2", "ssm")
"""Target layer types whose cache is a running state rather than per-token keys/values. Of these the loop
handles ``linear_attention`` (Gated DeltaNet: conv + recurrent state); the others are refused."""


def linear_state_layers(cache: Any, config: Any) -> list[int]:
    """Indices of the cache layers that hold a linear-attention state (restored and re-advanced after a
    verify instead of cropped: ``TargetRunner.crop``); ValueError, one line, for a layer whose state this loop
    cannot roll back (any other cache family with non-croppable state, e.g. mamba-style, a layer mixing both,
    or a transformers without linear-attention cache layers). Every other layer holds keys/values per token
    and is cropped."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = list(getattr(text, "layer_types", None) or [])
    name = type(text).__name__.removesuffix("Config").removesuffix("Text") or "target"
    handled = (
        "handled: full/sliding attention (keys/values cropped) and linear_attention (Gated DeltaNet: "
        "state restored and re-advanced over the accepted tokens)"
    )
    if LinearAttentionCacheLayerMixin is None:
        stateful = sorted({t for t in layer_types if t in STATEFUL_LAYER_TYPES})
        if stateful:
            raise ValueError(
                f"{name} target: its {'/'.join(stateful)} layers need a transformers with linear-attention "
                "cache layers (cache_utils.LinearAttentionLayer, 5.17 or newer) for exact speculative decoding"
            )
        return []
    state = []
    for i, layer in enumerate(getattr(cache, "layers", None) or []):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue  # keys/values per token: cropped
        kind = layer_types[i] if i < len(layer_types) else "?"
        both = CacheLayerMixin is not None and isinstance(layer, CacheLayerMixin)
        if both or kind != LINEAR_ATTENTION:
            raise ValueError(
                f"{name} target: layer {i} ({kind}, cache {type(layer).__name__}) keeps a state that "
                f"speculative decoding cannot roll back yet; {handled}"
            )
        state.append(i)
    return state


def check_decodable(model: nn.Module) -> list[int]:
    """``linear_state_layers`` of a fresh cache of ``model``: the layers whose state a verify restores;
    ValueError, one line, for a target this loop cannot decode exactly. For tools, right after loading the
    target (before any drafter or checkpoint is read); ``TargetRunner`` checks the same on every reset."""
    return linear_state_layers(DynamicCache(config=model.config), model.config)


@dataclass(kw_only=True)
class _StateSnapshot:
    """The linear-attention states before a multi-token forward, and that forward's tokens (to re-advance)."""

    start: int
    ids: torch.Tensor
    layers: dict[int, list[tuple[torch.Tensor | None, torch.Tensor | None, bool]]]


class TargetRunner:
    """The target LM with one cache and hooks (``feature_module``, the capture rule) that capture the
    drafter's K context layers for every token the target processes: prefill and verify forwards alike.

    Rolling back after a verify (``crop``): attention layers' keys/values are cropped. A linear-attention
    layer (Gated DeltaNet: Qwen3.5/3.6, Qwen3-Next) keeps a conv and a recurrent state that summarise every
    token seen, which no crop can undo; the runner snapshots them (the cache layers' public ``conv_states``,
    ``recurrent_states``, ``has_previous_state``) before every forward of more than one token, and a crop into
    that forward restores them and re-runs the kept tokens (one extra forward of <= B tokens, no capture).
    Every other stateful cache family is refused at ``reset`` (``linear_state_layers``)."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]):
        self.model = model
        _, layers, norm = find_decoder(model)
        self.layer_ids = [int(i) for i in layer_ids]
        bad = [i for i in self.layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"drafter target_layer_ids {bad} do not exist in a {len(layers)}-layer target")
        self._captured: dict[int, torch.Tensor] = {}
        self._capture = False
        self.cache = None
        self.state_layers: list[int] = []
        self._snapshot: _StateSnapshot | None = None
        self.reset()  # a target whose cache this loop cannot roll back is refused here, before any hook is set
        self._handles = [
            feature_module(layers, norm, i).register_forward_hook(self._hook(i))
            for i in sorted(set(self.layer_ids))
        ]
        self.device = next(model.parameters()).device
        # transformers >= 5.2x renamed `past_key_values` to `cache` (the old name warns, then goes away)
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self._capture:
                self._captured[layer] = (output[0] if isinstance(output, tuple) else output)[0]

        return hook

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.state_layers = linear_state_layers(self.cache, self.model.config)
        self._snapshot = None
        for i, layer in enumerate(getattr(self.cache, "layers", None) or []):
            # lets sliding-window layers be cropped; a linear-attention layer keeps its fixed-size states (its
            # rollback is the snapshot), so its conv state does not grow with every token
            if i not in self.state_layers and hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()

    @property
    def length(self) -> int:
        # an int, not the cache's own counter: transformers >= 5.25's linear-attention layers count in a tensor
        # they advance in place, so a kept reference would move with every forward
        return int(self.cache.get_seq_length())

    def crop(self, length: int) -> int:
        """Keep the first ``length`` positions of the cache -> the target forwards this took (0, or 1 when a
        linear-attention state was restored and re-advanced over the kept tokens of the last forward).

        Without linear-attention layers: the cache's own crop (transformers 5 crops by a negative count).
        With them, ``length`` must lie within the last forward of more than one token (a verify): ValueError
        otherwise."""
        remove = self.length - length
        if remove <= 0:
            return 0
        if not self.state_layers:
            self.cache.crop(-remove)
            return 0
        snap = self._snapshot
        if snap is None or not snap.start <= length:
            raise ValueError(
                f"cannot roll the target's linear-attention state back to position {length}: only into the "
                "last forward of more than one token"
            )
        self._snapshot = None
        kv_remove = self.length - snap.start
        for i, layer in enumerate(self.cache.layers):
            if i in snap.layers:
                _restore_linear_state(layer, snap.layers[i], snap.start)
            else:
                layer.crop(-kv_remove)
        keep = snap.ids[: length - snap.start]
        if keep.shape[0] == 0:
            return 0
        self.forward(keep, last_logits_only=True, capture=False)
        return 1

    @torch.no_grad()
    def forward(
        self, ids: torch.Tensor, *, last_logits_only: bool = False, capture: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``ids`` [n] at positions length..length+n-1 -> (logits [n or 1, V], features [n, K*H] or None).
        With linear-attention layers a forward of n > 1 tokens first snapshots their states (``crop``)."""
        start = self.length
        self._snapshot = None
        if self.state_layers and ids.shape[0] > 1:
            layers = {i: _linear_state(self.cache.layers[i]) for i in self.state_layers}
            self._snapshot = _StateSnapshot(start=start, ids=ids.detach().clone(), layers=layers)
        positions = torch.arange(start, start + ids.shape[0], device=self.device)
        self._capture, self._captured = capture, {}
        try:
            out = self.model(
                input_ids=ids[None].to(self.device),
                position_ids=positions[None],
                use_cache=True,
                **{self._cache_kw: self.cache},
                logits_to_keep=1 if last_logits_only else 0,
            )
        finally:
            self._capture = False
        feats = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1) if capture else None
        self._captured = {}
        return out.logits[0], feats

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _linear_state(layer: Any) -> list[tuple[torch.Tensor | None, torch.Tensor | None, bool]]:
    """Copies of a linear-attention cache layer's states, per state index: (conv, recurrent, has_previous)."""
    out = []
    for k in range(layer.number_of_states):
        conv = layer.conv_states[k] if layer.is_conv_states_initialized[k] else None
        rec = layer.recurrent_states[k] if layer.is_recurrent_states_initialized[k] else None
        out.append(
            (
                None if conv is None else conv.clone(),
                None if rec is None else rec.clone(),
                bool(layer.has_previous_state[k]),
            )
        )
    return out


def _restore_linear_state(
    layer: Any, saved: list[tuple[torch.Tensor | None, torch.Tensor | None, bool]], length: int
) -> None:
    """Put a linear-attention cache layer back as ``_linear_state`` found it, when the cache held ``length``
    tokens: in place where the shape allows (the layer marks its tensors as static addresses for CUDA graphs),
    else by assignment. transformers >= 5.25 also counts the layer's tokens (``cumulative_length_linear``)."""
    counter = getattr(layer, "cumulative_length_linear", None)
    if isinstance(counter, torch.Tensor):
        counter.fill_(length)
    for k, (conv, rec, had) in enumerate(saved):
        for states, value in ((layer.conv_states, conv), (layer.recurrent_states, rec)):
            if value is None:
                continue
            if states[k] is not None and states[k].shape == value.shape:
                states[k].copy_(value)
            else:
                states[k] = value
        layer.has_previous_state[k] = had


class Proposer(Protocol):
    """What the decoding loop asks of a drafter (tests plug in oracles). ``draft_logits`` is needed only
    for drafts sampled from the drafter (``Sampling(draft="sample")``)."""

    block_size: int

    def reset(self) -> None: ...

    def extend(self, features: torch.Tensor, start: int) -> None:
        """Append the context features of positions start..start+n-1 (n = features.shape[0])."""

    def propose(self, anchor_token: int, anchor_pos: int, block_len: int) -> torch.Tensor:
        """Draft tokens [block_len - 1] for positions anchor_pos+1.. given all context so far (greedy)."""


class DrafterProposer:
    """A drafter at inference: each layer's context keys/values are cached and grow with the accepted tokens,
    so a draft costs one pass of B tokens over the cached context (``DraftMath.draft_hidden``)."""

    def __init__(self, drafter: DraftMath):
        self.drafter = drafter
        self.block_size = drafter.spec.block_size
        self.mask_token_id = drafter.spec.mask_token_id
        self.device = drafter.fc.weight.device
        self.reset()

    def reset(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0

    @torch.inference_mode()
    def extend(self, features: torch.Tensor, start: int) -> None:
        assert start == self.length, f"context is {self.length} tokens, got features from position {start}"
        n = features.shape[0]
        keys, values = self.drafter.context_keys_values(features, torch.arange(start, start + n))
        if self.length:
            keys = [torch.cat([old, new]) for old, new in zip(self.keys, keys, strict=True)]
            values = [torch.cat([old, new]) for old, new in zip(self.values, values, strict=True)]
        self.keys, self.values, self.length = keys, values, self.length + n

    @torch.inference_mode()
    def block_hidden(self, block_ids: torch.Tensor, anchor_pos: int) -> torch.Tensor:
        """Final-normed hidden states [b, H] of the block ``block_ids`` [b] placed at anchor_pos.."""
        keys = [k[None] for k in self.keys] if self.length else None
        values = [v[None] for v in self.values] if self.length else None
        anchor = torch.tensor([anchor_pos], device=self.device)
        return self.drafter.draft_hidden(block_ids[None].to(self.device), anchor, keys, values)[0]

    @torch.inference_mode()
    def draft_logits(self, anchor_token: int, anchor_pos: int, block_len: int) -> torch.Tensor:
        """The drafter's logits [block_len - 1, V] for block positions 1.. (through the target's lm_head)."""
        ids = torch.full((block_len,), self.mask_token_id, dtype=torch.long)
        ids[0] = anchor_token
        return self.drafter.logits(self.block_hidden(ids, anchor_pos)[1:])

    def propose(self, anchor_token: int, anchor_pos: int, block_len: int) -> torch.Tensor:
        if self.drafter.spec.dflash2:
            return self.selected(anchor_token, anchor_pos, block_len, None)[0]
        return self.draft_logits(anchor_token, anchor_pos, block_len).argmax(-1).cpu()

    @torch.inference_mode()
    def selected(
        self, anchor_token: int, anchor_pos: int, block_len: int, sampling: Sampling | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """DFlash2: the candidate selector's path through the block (``CandidateSelector.walk``): drafts
        [block_len - 1] on the CPU and, when sampling, the distribution each was drawn from [block_len - 1, V]."""
        ids = torch.full((block_len,), self.mask_token_id, dtype=torch.long)
        ids[0] = anchor_token
        hidden = self.block_hidden(ids, anchor_pos)[1:]
        tokens, probs = self.drafter.candidate_selector.walk(
            hidden, self.drafter.logits(hidden), anchor_token, sampling
        )
        return tokens.cpu(), probs


@dataclass(kw_only=True)
class Generation:
    """One prompt's decode. ``steps`` holds (block length, accepted drafts, tokens emitted) per verify step."""

    tokens: list[int]
    steps: list[tuple[int, int, int]] = field(default_factory=list)
    target_forwards: int = 0
    wall_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How tokens are picked. ``temperature`` < 1e-5: greedy (the public code's threshold). Otherwise the
    target's distribution is softmax(logits / T) cut to the top-p nucleus, and drafts are verified by
    speculative rejection sampling (``verify_sampled``): ``draft="greedy"`` drafts the drafter's argmax
    (one-hot q, vLLM's and SGLang's default), ``"sample"`` samples drafts from the drafter's distribution
    under the same temperature and top-p. ``generator``: on the target's device (None: torch's global RNG)."""

    temperature: float = 0.0
    top_p: float = 1.0
    draft: Literal["greedy", "sample"] = "greedy"
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.draft not in ("greedy", "sample"):
            raise ValueError(f"draft must be 'greedy' or 'sample', got {self.draft!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def warp_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[..., V] logits -> fp32 probabilities of softmax(logits / T) restricted to the top-p nucleus (the
    smallest set of most likely tokens whose mass reaches top_p, ties broken by sort order), renormalised."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < sampling.top_p  # mass before a token < top_p: it is in
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return kept / kept.sum(-1, keepdim=True)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def verify_sampled(
    target_logits: torch.Tensor,
    draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: Sampling,
) -> tuple[int, int]:
    """Speculative rejection sampling of one block: (accepted drafts, the next token).

    ``target_logits`` [b, V] after [anchor, d_1..d_{b-1}]; ``draft`` [b-1]; ``draft_probs`` [b-1, V] the
    distribution each draft was sampled from (None: greedy drafts, q one-hot). d_k is accepted with
    probability min(1, p_k(d_k) / q_k(d_k)) while all before it were; at the first rejection the token is
    drawn from the residual max(p_k - q_k, 0), normalised; after b-1 acceptances from p_b (the bonus).
    Every emitted token is then distributed exactly as the target's own sampling (Leviathan et al. 2023;
    vLLM's "standard" rejection sampler; SGLang's target-only rule with thresholds 1).
    """
    p = warp_probs(target_logits, sampling)
    n = draft.shape[0]
    d = draft.to(p.device, torch.long)
    rows = torch.arange(n, device=p.device)
    q_d = torch.ones(n, device=p.device) if draft_probs is None else draft_probs[rows, d].float()
    gen = sampling.generator
    u = torch.rand(n, generator=gen, device=p.device if gen is None else gen.device).to(p.device)
    accepted = int(torch.cumprod((u * q_d < p[rows, d]).long(), 0).sum()) if n else 0
    if accepted == n:
        return n, int(_draw(p[n], gen))
    q = F.one_hot(d[accepted], p.shape[-1]).float() if draft_probs is None else draft_probs[accepted].float()
    residual = (p[accepted] - q).clamp(min=0)
    if float(residual.sum()) <= 0:  # p == q (a rejection then has probability 0): p itself is the answer
        residual = p[accepted]
    return accepted, int(_draw(residual / residual.sum(), gen))


def emit_tokens(new: list[int], budget: int, stop: set[int]) -> tuple[list[int], bool]:
    """``new`` cut to the length budget and just after the first stop token; (tokens, stopped)."""
    new = new[:budget]
    for i, t in enumerate(new):
        if t in stop:
            return new[: i + 1], True
    return new, False


def _pick(logits: torch.Tensor, sampling: Sampling | None) -> int:
    """The next token from last-position logits [V]: argmax, or a sample of the warped distribution."""
    if sampling is None or sampling.greedy:
        return int(logits.argmax())
    return int(_draw(warp_probs(logits, sampling), sampling.generator))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def _draft(
    proposer: Proposer, anchor: int, anchor_pos: int, b: int, sampling: Sampling | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block's draft [b-1] on the CPU, and its probabilities when drafts are sampled (None: greedy)."""
    if sampling is not None and sampling.draft == "sample":
        if isinstance(proposer, DrafterProposer) and proposer.drafter.spec.dflash2:
            return proposer.selected(anchor, anchor_pos, b, sampling)
        draft_probs = warp_probs(proposer.draft_logits(anchor, anchor_pos, b), sampling)
        return _draw(draft_probs, sampling.generator).cpu(), draft_probs
    return proposer.propose(anchor, anchor_pos, b).to(torch.long).cpu(), None


def _accept(
    logits: torch.Tensor, draft: torch.Tensor, draft_probs: torch.Tensor | None, sampling: Sampling | None
) -> tuple[int, int]:
    """(draft tokens accepted, the bonus token) of one verify forward: rejection sampling when sampling
    (``verify_sampled``), else d_k accepted while it equals the target's argmax after the tokens before it."""
    if sampling is not None:
        return verify_sampled(logits, draft, draft_probs, sampling)
    greedy = logits.argmax(-1).cpu()  # greedy[k]: the target's token after [anchor, draft][:k+1]
    accepted = int(torch.cumprod((draft == greedy[:-1]).long(), 0).sum())
    return accepted, int(greedy[accepted])


def speculative_generate(
    target: TargetRunner,
    proposer: Proposer,
    prompt: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    block_size: int | None = None,
    sampling: Sampling | None = None,
) -> Generation:
    """DFlash decoding of ``prompt`` [P]: the draft -> verify loop (docs/export-and-eval.md).

    Prefill: the target runs the prompt, its captured features are the context, its last logits give the
    first token (the first anchor). Each step: the drafter drafts [anchor, d_1..d_{b-1}] at positions
    anchor_pos..; the target verifies all of it in ONE forward on its cache; greedy: d_k is accepted while it
    equals the target's argmax after the tokens before it, the argmax after the last accepted one is the
    bonus (exactly greedy decoding's tokens); sampling: ``verify_sampled``. The cache is rolled back to the
    accepted tokens (``TargetRunner.crop``: keys/values cropped, linear-attention states restored and
    re-advanced, counted as a target forward), whose verify-forward features join the context; the bonus is
    the next anchor.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sampled = sampling is not None and not sampling.greedy
    block = block_size or proposer.block_size
    stop = set(stop_token_ids)
    _sync(target.device)
    t0 = time.perf_counter()
    target.reset()
    proposer.reset()
    logits, feats = target.forward(prompt, last_logits_only=True)
    proposer.extend(feats, 0)
    gen = Generation(tokens=[_pick(logits[-1], sampling)], target_forwards=1)
    stopped = gen.tokens[0] in stop
    while not stopped and len(gen.tokens) < max_new_tokens:
        anchor_pos = target.length
        remaining = max_new_tokens - len(gen.tokens)
        b = min(block, remaining + 1)
        draft, draft_probs = _draft(proposer, gen.tokens[-1], anchor_pos, b, sampling if sampled else None)
        logits, feats = target.forward(torch.cat([torch.tensor([gen.tokens[-1]]), draft]))
        gen.target_forwards += 1
        accepted, bonus = _accept(logits, draft, draft_probs, sampling if sampled else None)
        new, stopped = emit_tokens(draft[:accepted].tolist() + [bonus], remaining, stop)
        gen.steps.append((b, accepted, len(new)))
        gen.tokens.extend(new)
        gen.target_forwards += target.crop(anchor_pos + accepted + 1) or 0  # 1: a linear-attention replay
        if not stopped and len(gen.tokens) < max_new_tokens:
            proposer.extend(feats[: accepted + 1], anchor_pos)
    _sync(target.device)
    gen.wall_s = time.perf_counter() - t0
    return gen


@torch.inference_mode()
def plain_generate(
    target: TargetRunner,
    prompt: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    sampling: Sampling | None = None,
) -> Generation:
    """Decoding without a drafter on the same cache code: greedy, or sampled with ``sampling`` (the same
    warped distribution). The baseline for speed and, greedy, for the lossless check."""
    stop = set(stop_token_ids)
    _sync(target.device)
    t0 = time.perf_counter()
    target.reset()
    logits, _ = target.forward(prompt, last_logits_only=True, capture=False)
    gen = Generation(tokens=[_pick(logits[-1], sampling)], target_forwards=1)
    while gen.tokens[-1] not in stop and len(gen.tokens) < max_new_tokens:
        logits, _ = target.forward(torch.tensor([gen.tokens[-1]]), capture=False)
        gen.tokens.append(_pick(logits[-1], sampling))
        gen.target_forwards += 1
    _sync(target.device)
    gen.wall_s = time.perf_counter() - t0
    return gen


def greedy_generate(
    target: TargetRunner, prompt: torch.Tensor, *, max_new_tokens: int, stop_token_ids: Sequence[int] = ()
) -> Generation:
    """Plain greedy decoding with the same cache: the baseline for speed and for the lossless check."""
    return plain_generate(target, prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)


# ------------------------------------------------------------------------------ 7. the transformers model


class DFlashDraftModel(DraftMath, Qwen3PreTrainedModel):
    """The exported drafter as ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` builds it:
    ``config.json`` is a Qwen3Config with the DFlash fields, the weights are ``layers.{i}.…``, ``fc``,
    ``hidden_norm``, ``norm`` (no embedding, no lm_head: ``spec_generate`` borrows the target's)."""

    config_class = Qwen3Config
    _no_split_modules = ["DraftDecoderLayer"]
    supports_gradient_checkpointing = False

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self._build_draft(config)
        self.post_init()

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def mask_token_id(self) -> int:
        return self.spec.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.spec.target_layer_ids)

    def _init_weights(self, module: nn.Module) -> None:
        # transformers builds the model on the meta device and initialises what the checkpoint does not
        # hold: here only the rotary table (a non-persistent buffer), recomputed in fp32
        if isinstance(module, RotaryEmbedding):
            hf_init.copy_(module.inv_freq, module.compute_inv_freq()[0])
        elif isinstance(module, GroupedDynamicCausalConv):  # the identity (DFlash2's start)
            identity = torch.zeros_like(module.base_kernel)
            identity[:, 0] = 1.0
            hf_init.copy_(module.base_kernel, identity)
            hf_init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, CandidateSelector):
            hf_init.normal_(module.predecessor_codebook, mean=0.0, std=self.spec.initializer_range)
            hf_init.zeros_(module.successor_codebook)
        elif isinstance(module, nn.Linear) and getattr(module, "zero_init", False):
            hf_init.zeros_(module.weight)
        elif isinstance(module, nn.Linear):
            hf_init.normal_(module.weight, mean=0.0, std=self.spec.initializer_range)
        elif isinstance(module, RMSNorm):
            hf_init.ones_(module.weight)


class DFlash2DraftModel(DFlashDraftModel):
    """The exported DFlash2 drafter (``architectures: ["DFlash2DraftModel"]``, the public DFlash2 name):
    the same class, whose config turns on the convolutions and the selector (``DraftSpec.dflash2``)."""

    _no_split_modules = ["DraftDecoderLayer"]
