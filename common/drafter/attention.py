"""DFlash draft attention: one mask rule, two backends (compiled flex_attention on CUDA, dense SDPA on CPU).

Layout of one training step (docs/architecture.md, the training recipe): the context is ONE packed stream of S tokens (documents back to
back, padding with doc id -1) and there are N anchor slots of B block tokens each. Queries are the N*B block
tokens; keys/values are the S context tokens followed by the N*B block tokens. `mask_mod` below is the single
definition of who sees what; the flex backend turns it into a sparse `BlockMask`, the SDPA backend evaluates the
very same function densely, so the two cannot drift apart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

log = logging.getLogger(__name__)

Backend = Literal["auto", "flex", "sdpa"]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Compiled once per process, lazily: compiling at import would cost every CPU-only user (tests, CLIs) the
# compile time, and compiling per call would recompile every step.
_compiled_flex_attention: Callable | None = None
_compiled_block_mask: Callable | None = None


def resolve_backend(backend: Backend, device: torch.device) -> Literal["flex", "sdpa"]:
    """`auto` picks flex on CUDA (fused, sparse) and SDPA elsewhere (flex has no backward on CPU)."""
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if backend not in ("flex", "sdpa"):
        raise ValueError(f"attention backend must be 'auto', 'flex' or 'sdpa', got {backend!r}")
    return backend


def make_mask_mod(
    doc_ids: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int
) -> MaskMod:
    """The DFlash visibility rule as a flex `mask_mod(b, h, q_idx, kv_idx) -> bool`.

    Query q belongs to block b = q // B. A context key kv < S is visible iff the block is valid, kv lies in the
    anchor's document and kv < anchor (strictly before: at inference the target's hidden state at the anchor
    does not exist yet when the block is drafted). A block key kv >= S is visible iff it belongs to the same
    block (bidirectional within the block). Invalid (padding) blocks see nothing.
    Written with broadcasting-safe ops only, so it also evaluates densely on index grids (see `dense_mask`).
    """
    context_len = doc_ids.shape[0]
    anchor_doc = doc_ids[anchors]

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        in_context = kv_idx < context_len
        same_doc = doc_ids[kv_idx.clamp(max=context_len - 1)] == anchor_doc[block]
        sees_context = in_context & same_doc & (kv_idx < anchors[block])
        sees_block = ~in_context & ((kv_idx - context_len) // block_size == block)
        return anchor_valid[block] & (sees_context | sees_block)

    return mask_mod


def dense_mask(mask_mod: MaskMod, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Evaluate `mask_mod` on the full [q_len, kv_len] grid by broadcasting (the SDPA backend and tests)."""
    zero = torch.zeros((), dtype=torch.int64, device=device)
    q_idx = torch.arange(q_len, device=device)[:, None]
    kv_idx = torch.arange(kv_len, device=device)[None, :]
    return mask_mod(zero, zero, q_idx, kv_idx).expand(q_len, kv_len)


def _draft_block_mask(
    doc_ids: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int, kv_len: int
) -> BlockMask:
    # The mask_mod closure is created inside this function so that, when compiled, its tensors are graph
    # inputs (no guard on a per-step closure object -> no recompile per step).
    mask_mod = make_mask_mod(doc_ids, anchors, anchor_valid, block_size)
    q_len = anchors.shape[0] * block_size
    return create_block_mask(mask_mod, None, None, q_len, kv_len, device=doc_ids.device)


@dataclass(kw_only=True)
class DraftMask:
    """Everything the attention of one step needs; built once per step and shared by all draft layers."""
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
) -> DraftMask:
    """Build the step's mask for `draft_attention` (once per step, not per layer).

    doc_ids [S] int (-1 = padding), anchors [N] int64 (index into the packed stream), anchor_valid [N] bool.
    `compile_mask` (default: on CUDA) builds the flex BlockMask with a compiled `create_block_mask`, which never
    materialises the dense [Q, KV] mask; eager creation does, which is fine only for small shapes.
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
        block_mask = fn(doc_ids, anchors, anchor_valid, block_size, kv_len)
        return DraftMask(backend="flex", row_valid=row_valid, block_mask=block_mask)
    dense = dense_mask(
        make_mask_mod(doc_ids, anchors, anchor_valid, block_size), row_valid.shape[0], kv_len, device
    )
    # A fully masked row makes SDPA's softmax 0/0 = NaN, and zeroing the output afterwards does not stop the NaN
    # from reaching dK/dV in backward. So padding rows attend to everything and their output is zeroed instead:
    # their upstream gradient is then exactly 0, which contributes exactly 0 to every other gradient.
    dense = dense | ~row_valid[:, None]
    return DraftMask(backend="sdpa", row_valid=row_valid, dense=dense)


def _flex_fn(device: torch.device) -> Callable:
    if device.type != "cuda":
        # Eager flex on CPU: forward only, materialises scores. Used by tests as a cross-check of the mask.
        return flex_attention
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention


def recompile_count() -> int:
    """Frames torch.compile has compiled in this process so far (first compiles and recompiles alike).

    Every compiled entry point (flex_attention, the block-mask builder, a compiled train step) compiles once per
    distinct shape; a rise after warm-up with steady shapes is a recompile, i.e. a bug.
    """
    return int(counters["frames"]["total"])


def draft_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DraftMask, *, scale: float | None = None
) -> torch.Tensor:
    """Non-causal attention of block queries over [context | blocks] keys under the DFlash mask.

    q [1, Hq, Q, D]; k, v [1, Hkv, KV, D] with Hq a multiple of Hkv (GQA). Returns [1, Hq, Q, D]; rows of
    padding blocks are exactly 0 in both backends.
    """
    enable_gqa = q.shape[1] != k.shape[1]
    if mask.backend == "flex":
        out = _flex_fn(q.device)(q, k, v, block_mask=mask.block_mask, scale=scale, enable_gqa=enable_gqa)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.dense, scale=scale, enable_gqa=enable_gqa
        )
    return out * mask.row_valid[:, None].to(out.dtype)
