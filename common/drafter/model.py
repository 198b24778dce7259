"""The DFlash draft model: its layers and the target's frozen embedding/lm_head it borrows (``TargetHead``).

Architecture (public facts: z-lab/dflash `DFlashDraftModel`; docs/architecture.md, the drafter). Parameter names equal the public
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

import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dflash.common.drafter.attention import Backend, DraftMask, build_draft_mask, draft_attention
from dflash.common.drafter.batch import DraftBatch
from dflash.common.drafter.config import DrafterConfig

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------- config


# ---------------------------------------------------------------------------------------------- target head


class TargetHead(nn.Module):
    """The target's token embedding and lm_head, frozen. Tied targets store one tensor (moved once by `.to`)."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        self.tied = lm_head_weight is None
        self.fingerprint: str | None = None  # of the weights it was read from (common/target/head.py)
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


def initial_drafter(config: DrafterConfig, head, *, seed: int) -> DFlashDrafter:
    """The drafter a fresh run starts from: weights drawn from `seed` (the consumer's ``--seed`` + rank).

    One function for the trainer and for whoever needs the untrained drafter (the demo's "τ before
    training"), so the two cannot drift apart. Seeding here repeats the trainer's own seeding, with nothing
    random in between, so the weights are those of a fresh launch.
    """
    torch.manual_seed(seed)
    return DFlashDrafter(config, head)
