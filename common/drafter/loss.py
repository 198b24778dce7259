"""Draft loss: the target's frozen lm_head + weighted cross-entropy, plus accuracy and τ. Two ways to the
same numbers (``LOSS_IMPLS``; tests/test_loss.py holds them equal to 1e-5 in fp32):

- ``fused`` (CUDA, compiled): one plain function, ``logits = h @ W.T`` in the lm_head's dtype (bf16), the
  cross-entropy in fp32 and the argmax, handed to torch.compile whole, so inductor can fuse the
  log-softmax, the weighted NLL and the argmax into the reduction over the bf16 logits, and the backward's
  softmax - onehot into one pass, without an fp32 [tokens x vocab] buffer (the kernels it makes and their
  time are not yet measured on a GPU: docs/training.md, "Measured on the H200"). At 32B-class shapes (3,840 query tokens x
  151,936) the chunked path spent ~14.5 ms a step in such passes (RESULTS.md's kernel table); the bf16
  logits it keeps for backward are 1.2 GB.
- ``chunked`` (the CPU, and anything short of memory): a custom autograd Function that walks the query
  tokens in chunks: for each chunk it computes the logits, the loss, the greedy predictions AND the
  gradient w.r.t. the hidden states (softmax - onehot, times the weight, times lm_head), then drops the
  logits. Backward only scales the stored gradient by the upstream scalar. At most one chunk of logits
  exists at any time, in forward and backward, and no logits are recomputed.

Why not a library kernel: liger-kernel's fused linear cross-entropy and cut-cross-entropy both return the
loss alone (the per-position accuracy and tau need each query's greedy prediction, a second [tokens x vocab]
pass if done outside) and neither is in this stack's wheels on the device; a compiled plain function gives
inductor the whole graph (GEMM, log-softmax, NLL and argmax) and costs no dependency.

Sums, not means, come back: the trainer all-reduces `loss_sum` / `weight_sum` / counts across ranks and divides
by the GLOBAL weight sum, so every token weighs the same whatever rank it landed on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

LOSS_IMPLS = ("fused", "chunked")
LinearCrossEntropy = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""(hidden [M, H], lm_head weight [V, H], labels [M], weights [M]) -> (sum of weighted CE, argmax [M])."""


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(hidden_i @ weight.T, label_i), and the argmax of each row, in chunks of rows."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_tokens: int):
        num_rows = hidden.shape[0]
        need_hidden_grad, need_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        preds = torch.empty(num_rows, dtype=torch.int64, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight_grad else None
        for start in range(0, num_rows, chunk_tokens):
            end = min(start + chunk_tokens, num_rows)
            h = hidden[start:end]
            lab = labels[start:end]
            w = weights[start:end].float()
            # [chunk, V]: matmul in the lm_head's dtype, softmax in fp32
            logits = (h.to(weight.dtype) @ weight.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, lab[:, None]).squeeze(1)
            loss_sum = loss_sum + ((lse - target) * w).sum()
            preds[start:end] = logits.argmax(dim=-1)
            if need_hidden_grad or need_weight_grad:
                grad_logits = torch.exp(logits - lse[:, None])
                grad_logits.scatter_add_(1, lab[:, None], -torch.ones_like(lse)[:, None])
                grad_logits.mul_(w[:, None])
                if need_hidden_grad:
                    grad_hidden[start:end] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
                if need_weight_grad:
                    grad_weight.add_(grad_logits.t() @ h.float())
        ctx.mark_non_differentiable(preds)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss_sum, preds

    @staticmethod
    def backward(ctx, grad_loss, grad_preds):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_loss.to(grad_hidden.dtype) if grad_hidden is not None else None
        gw = (grad_weight * grad_loss).to(ctx.weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of weighted CE [scalar fp32, differentiable], greedy predictions [M] int64) for hidden [M, H]."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, weights, chunk_tokens)


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of weighted CE [scalar fp32, differentiable], greedy predictions [M] int64), as one function for
    torch.compile to fuse (module docstring). Eager, it materializes fp32 logits: compile it on CUDA."""
    logits = hidden.to(weight.dtype) @ weight.t()
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    return (ce * weights.float()).sum(), logits.argmax(dim=-1)


def linear_cross_entropy(impl: str, *, chunk_tokens: int = 2048, compile_backend: str = "eager") -> LinearCrossEntropy:
    """The loss's lm_head + cross-entropy for ``impl`` (``LOSS_IMPLS``). ``fused`` is compiled once with
    ``compile_backend`` (static shapes: a step's query tokens never change) unless that is "eager"."""
    if impl == "chunked":
        return lambda h, w, lab, wt: chunked_linear_cross_entropy(h, w, lab, wt, chunk_tokens=chunk_tokens)
    if impl != "fused":
        raise ValueError(f"loss impl must be one of {LOSS_IMPLS}, got {impl!r}")
    if compile_backend == "eager":
        return fused_linear_cross_entropy
    return torch.compile(fused_linear_cross_entropy, backend=compile_backend, dynamic=False, fullgraph=True)


@dataclass(kw_only=True)
class DraftLossOutput:
    """Sums over one rank's step; divide after an all-reduce (see module docstring)."""

    loss_sum: torch.Tensor  # scalar fp32, differentiable: sum of label_weight * CE
    weight_sum: torch.Tensor  # scalar fp32: sum of label_weights
    correct: torch.Tensor  # [B] int64: greedy prediction == label at block position k, over valid labels
    valid: torch.Tensor  # [B] int64: labels with weight > 0 at block position k (0 at k=0)
    tau_sum: torch.Tensor  # scalar fp32: sum over valid blocks of τ
    num_blocks: torch.Tensor  # scalar int64: valid blocks

    def loss(self) -> torch.Tensor:
        """Local weighted mean (single process / logging); training divides by the global weight sum."""
        return self.loss_sum / self.weight_sum.clamp_min(1e-6)


def draft_loss(
    hidden: torch.Tensor,
    batch: Any,
    lm_head_weight: torch.Tensor,
    *,
    chunk_tokens: int = 2048,
    lce: LinearCrossEntropy | None = None,
) -> DraftLossOutput:
    """Loss and metrics of draft blocks: hidden [N, B, H] (final-normed drafter output) and the step's batch
    (a `DraftBatch`, or anything with `labels`, `label_weights` [N, B] and `anchor_valid` [N]).

    Block position 0 is never a label (it is the anchor), so only positions 1..B-1 go through the lm_head.
    Accuracy counts a position as correct iff its label is valid (weight > 0) and argmax == label.
    τ (acceptance length, greedy) of a valid block = 1 + the number of leading positions 1..B-1 that are correct;
    the run stops at the first wrong OR invalid position (past the document end or off the loss mask nothing is
    known to be accepted). τ is averaged over valid blocks: tau = tau_sum / num_blocks.
    ``lce`` computes the lm_head and cross-entropy (``linear_cross_entropy``); default the chunked one, whose
    ``chunk_tokens`` query tokens go through the lm_head at a time (peak extra memory ~ chunk_tokens x V x 4 bytes x 2).
    """
    labels, label_weights, anchor_valid = batch.labels, batch.label_weights, batch.anchor_valid
    n, b, h = hidden.shape
    lab = labels[:, 1:].reshape(-1)
    w = label_weights[:, 1:].reshape(-1)
    lce = lce or linear_cross_entropy("chunked", chunk_tokens=chunk_tokens)
    loss_sum, preds = lce(hidden[:, 1:].reshape(-1, h), lm_head_weight, lab, w)
    with torch.no_grad():
        valid = (w > 0).view(n, b - 1)
        correct = (preds == lab).view(n, b - 1) & valid
        zero = torch.zeros(1, dtype=torch.int64, device=hidden.device)
        correct_per_pos = torch.cat([zero, correct.sum(0)])
        valid_per_pos = torch.cat([zero, valid.sum(0)])
        leading = torch.cumprod(correct.to(torch.int64), dim=1).sum(1)
        tau = (1 + leading).float() * anchor_valid.float()
        return DraftLossOutput(
            loss_sum=loss_sum,
            weight_sum=w.float().sum(),
            correct=correct_per_pos,
            valid=valid_per_pos,
            tau_sum=tau.sum(),
            num_blocks=anchor_valid.sum().to(torch.int64),
        )
