"""Greedy DFlash speculative decoding: the drafter at inference and the draft -> verify loop (``dflash-eval``).

The loop (docs/export-and-eval.md), per prompt:

1. Target prefill with a KV cache (HF DynamicCache); hooks capture the K target layers' outputs for every prompt
   token: the drafter's context features. Its last logits give the first new token, the first anchor.
2. The drafter drafts a block [anchor, MASK x (B-1)] at positions anchor_pos..anchor_pos+B-1, attending to the
   context features of ALL positions before the anchor (at inference every context position precedes the
   anchor: the training mask `kv < anchor` of the anchor's own document, with nothing else in the stream).
3. The target verifies [anchor, d_1..d_{B-1}] in ONE forward on its cache. Greedy: d_k is accepted while it
   equals the target's argmax after the tokens before it; the target's argmax after the last accepted token is
   the bonus token. So every verify step emits accepted+1 tokens, exactly the tokens plain greedy decoding
   would emit (lossless, up to floating-point ties).
4. The cache is cropped to the accepted tokens, and their captured features (computed in the verify forward,
   i.e. full-forward hidden states of accepted tokens) are appended to the context. The bonus token is the
   next anchor: its features do not exist until the next verify forward.

τ = tokens emitted per verify step (accepted drafts + bonus, cut at a stop token or the length budget), pooled
over all steps of all prompts: the public DFlash benchmark's "acceptance length". Per block it is the trainer's
`tau`; the trainer averages it over uniformly sampled anchors, decoding over the anchors it visits, which
weighs easy stretches less (docs/export-and-eval.md: why the trainer's number is higher).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

# The command line lives in eval_cli (no torch before parsing); main/build_parser stay importable here.
from dflash.common.drafter.model import _rotate

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------- target


# ------------------------------------------------------------------------------------------------ drafter


class Proposer(Protocol):
    """What the decoding loop asks of a drafter (tests plug in oracles)."""

    block_size: int

    def reset(self) -> None: ...

    def extend(self, features: torch.Tensor, start: int) -> None:
        """Append the context features of positions start..start+n-1 (n = features.shape[0])."""

    def propose(self, anchor_token: int, anchor_pos: int, block_len: int) -> torch.Tensor:
        """Draft tokens [block_len - 1] for positions anchor_pos+1.. given all context so far."""


def context_keys_values(layer: nn.Module, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """One draft layer's keys and values [n, kv_heads, head_dim] of the context ``context`` [n, H] (the
    normed, projected target features) at rotary ``cos``/``sin`` [n, D]: they depend on the context only,
    not on the layer's input, so a decode caches them once per position."""
    attn = layer.self_attn
    n = context.shape[0]
    k = _rotate(attn.k_norm(attn.k_proj(context).view(n, attn.num_kv_heads, attn.head_dim)), cos, sin)
    return k, attn.v_proj(context).view(n, attn.num_kv_heads, attn.head_dim)


def block_layer(
    layer: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor | None,
    values: torch.Tensor | None,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """One draft decoder layer over A blocks ``x`` [A, B, H] at rotary ``cos``/``sin`` [A*B, D]: each block
    attends to its context ``keys``/``values`` [A, L, kv_heads, head_dim] (None: no context) and to all of
    its own positions; ``visible`` [A, 1, 1, L+B] (bool) masks keys out. The inference form of
    ``DFlashDrafter.forward``'s layer (tests compare the two)."""
    attn = layer.self_attn
    a, b, _ = x.shape
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    flat = x.reshape(a * b, -1)
    h = layer.input_layernorm(flat)
    q = _rotate(attn.q_norm(attn.q_proj(h).view(a * b, heads, dim)), cos, sin).view(a, b, heads, dim)
    k = _rotate(attn.k_norm(attn.k_proj(h).view(a * b, kv_heads, dim)), cos, sin).view(a, b, kv_heads, dim)
    v = attn.v_proj(h).view(a, b, kv_heads, dim)
    if keys is not None:
        k, v = torch.cat([keys, k], dim=1), torch.cat([values, v], dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=visible,
        scale=dim**-0.5,
        enable_gqa=heads != kv_heads,
    )  # [A, heads, B, head_dim]
    flat = flat + attn.o_proj(out.transpose(1, 2).reshape(a * b, heads * dim))
    flat = flat + layer.mlp(layer.post_attention_layernorm(flat))
    return flat.view(a, b, -1)


class DrafterProposer:
    """`DFlashDrafter` at inference: the context K/V of every draft layer is cached and grows with the
    accepted tokens (context keys/values depend only on the shared context feature, not on the layer input),
    so a draft costs one pass of B tokens over the cached context instead of re-projecting it.
    Same math as `DFlashDrafter.forward` with the all-visible mask (tests compare the two)."""

    def __init__(self, drafter: nn.Module):
        self.drafter = drafter
        self.config = drafter.config
        self.block_size = self.config.block_size
        self.dtype = drafter.fc.weight.dtype
        self.device = drafter.fc.weight.device
        self.reset()

    def reset(self) -> None:
        self.keys: list[torch.Tensor | None] = [None] * len(self.drafter.layers)
        self.values: list[torch.Tensor | None] = [None] * len(self.drafter.layers)
        self.length = 0

    @torch.inference_mode()
    def extend(self, features: torch.Tensor, start: int) -> None:
        assert start == self.length, f"context is {self.length} tokens, got features from position {start}"
        d = self.drafter
        n = features.shape[0]
        context = d.hidden_norm(d.fc(features.to(self.device, self.dtype)))
        cos, sin = d.rotary_emb(torch.arange(start, start + n, device=self.device), self.dtype)
        for i, layer in enumerate(d.layers):
            k, v = context_keys_values(layer, context, cos, sin)
            self.keys[i] = k if self.keys[i] is None else torch.cat([self.keys[i], k])
            self.values[i] = v if self.values[i] is None else torch.cat([self.values[i], v])
        self.length += n

    @torch.inference_mode()
    def block_hidden(self, block_ids: torch.Tensor, anchor_pos: int) -> torch.Tensor:
        """Final-normed hidden states [b, H] of the block `block_ids` [b] placed at anchor_pos.."""
        d = self.drafter
        b = block_ids.shape[0]
        x = d.target_head.embed(block_ids.to(self.device)).to(self.dtype)[None]
        cos, sin = d.rotary_emb(torch.arange(anchor_pos, anchor_pos + b, device=self.device), self.dtype)
        for i, layer in enumerate(d.layers):
            keys, values = self.keys[i], self.values[i]
            x = block_layer(
                layer, x, cos, sin, None if keys is None else keys[None], None if values is None else values[None]
            )
        return d.norm(x[0])

    @torch.inference_mode()
    def propose(self, anchor_token: int, anchor_pos: int, block_len: int) -> torch.Tensor:
        ids = torch.full((block_len,), self.config.mask_token_id, dtype=torch.long)
        ids[0] = anchor_token
        hidden = self.block_hidden(ids, anchor_pos)[1:]
        head = self.drafter.target_head.lm_head_weight
        return (hidden.to(head.dtype) @ head.t()).argmax(-1).cpu()


# ------------------------------------------------------------------------------------------------ decoding


@dataclass(kw_only=True)
class Generation:
    """One prompt's decode. `steps` holds (block length, accepted drafts, tokens emitted) per verify step."""

    tokens: list[int]
    steps: list[tuple[int, int, int]] = field(default_factory=list)
    target_forwards: int = 0
    wall_s: float = 0.0


def _emit(new: list[int], budget: int, stop: set[int]) -> tuple[list[int], bool]:
    """`new` cut to the length budget and just after the first stop token; (tokens, stopped)."""
    new = new[:budget]
    for i, t in enumerate(new):
        if t in stop:
            return new[: i + 1], True
    return new, False


# ------------------------------------------------------------------------------------------------ metrics


@dataclass(kw_only=True)
class EvalReport:
    prompts: int
    block_size: int
    generated_tokens: int
    verify_steps: int
    tau: float
    """Tokens per verify step (accepted + bonus), pooled over all steps."""
    tau_per_prompt: list[float]
    accept_rate: list[float]
    """[B]: index k = fraction of verify steps whose draft position k was accepted (index 0 = the anchor)."""
    accept_length_hist: list[int]
    """[B+1]: verify steps by tokens emitted."""
    target_forwards_per_token: float
    wall_s: float
    tokens_per_s: float
    baseline: dict | None = None
    outputs: list[list[int]] = field(default_factory=list)
    """Generated token ids per prompt (prompt excluded)."""


def summarize(
    gens: Sequence[Generation], block_size: int, baseline: Sequence[Generation] | None = None
) -> EvalReport:
    steps = [s for g in gens for s in g.steps]
    tokens = sum(len(g.tokens) for g in gens)
    wall = sum(g.wall_s for g in gens)
    drafted = [sum(1 for b, _, _ in steps if b - 1 >= k) for k in range(block_size)]
    accepted = [sum(1 for _, a, _ in steps if a >= k) for k in range(block_size)]
    hist = [0] * (block_size + 1)
    for _, _, n in steps:
        hist[n] += 1
    report = EvalReport(
        prompts=len(gens),
        block_size=block_size,
        generated_tokens=tokens,
        verify_steps=len(steps),
        tau=sum(n for _, _, n in steps) / max(1, len(steps)),
        tau_per_prompt=[sum(n for _, _, n in g.steps) / max(1, len(g.steps)) for g in gens],
        accept_rate=[1.0] + [accepted[k] / drafted[k] if drafted[k] else 0.0 for k in range(1, block_size)],
        accept_length_hist=hist,
        target_forwards_per_token=sum(g.target_forwards for g in gens) / max(1, tokens),
        wall_s=wall,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        outputs=[list(g.tokens) for g in gens],
    )
    if baseline is not None:
        base_tokens = sum(len(g.tokens) for g in baseline)
        base_wall = sum(g.wall_s for g in baseline)
        base_tps = base_tokens / base_wall if base_wall > 0 else 0.0
        report.baseline = {
            "tokens_per_s": base_tps,
            "wall_s": base_wall,
            "speedup": report.tokens_per_s / base_tps if base_tps else 0.0,
            "mismatched_prompts": sum(g.tokens != b.tokens for g, b in zip(gens, baseline, strict=True)),
        }
    return report


# ------------------------------------------------------------------------------------------------ prompts


# ----------------------------------------------------------------------------------------------------- CLI
