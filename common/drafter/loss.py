"""Draft loss: the target's frozen lm_head + weighted cross-entropy, plus accuracy and τ.

The lm_head + cross-entropy walks the query tokens in chunks (``chunk_tokens`` rows): for each chunk it
computes the logits, each row's cross-entropy, its greedy prediction AND the gradient w.r.t. the hidden
states, then drops the logits; backward only scales the stored gradient by the upstream scalar. At most one
chunk of logits exists at any time and none is recomputed. The per-row loss weights are applied after the
projection back to the hidden width (``diag(w) (G W) = (diag(w) G) W``: exact, and a pass over [rows x H]
instead of [rows x vocab]). Two ways to the row pass over a chunk's logits (``LOSS_IMPLS``):

- ``chunked`` (the default, any device): torch ops in fp32 (logsumexp, gather, argmax, exp, scatter):
  at 32B-class shapes (3,840 query tokens x 151,936) ~14.5 ms a step of elementwise passes (RESULTS.md).
- ``liger`` (CUDA, needs ``liger-kernel``): liger-kernel's Triton cross-entropy kernel
  (``liger_kernel.ops.cross_entropy.liger_cross_entropy_kernel``) over the bf16 logits in place: an online
  softmax pass, then one pass writing the gradient (softmax - onehot) and the argmax, each row's loss
  unreduced. liger's own ``LigerFusedLinearCrossEntropyFunction`` is not used: its loss weights are per
  class (``ce_weight``), not per position, and its ``reduction="none"`` path (the only one taking
  per-position weights, as the upstream gradient) recomputes every chunk's logits in backward (one more
  lm_head GEMM, ~6 TFLOP a step here) and reads the token count back to the host each call.

Sums, not means, come back: the trainer all-reduces `loss_sum` / `weight_sum` / counts across ranks and divides
by the GLOBAL weight sum, so every token weighs the same whatever rank it landed on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

LOSS_IMPLS = ("chunked", "liger")
LinearCrossEntropy = Callable[..., tuple[torch.Tensor, ...]]
"""(hidden [M, H], lm_head weight [V, H], labels [M], weights [M]) -> (sum of weighted CE, argmax [M]); with
``top_k=k`` also each row's top-k ids [M, k] from the same logits (DFlash2's selector candidates)."""
RowPass = Callable[[torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
"""(logits [c, V] in the lm_head's dtype, labels [c], need gradient) -> (each row's cross-entropy, fp32 [c];
its argmax [c]; d CE / d logits [c, V], unweighted, or None): the row pass over one chunk's logits."""


def torch_rows(logits: torch.Tensor, labels: torch.Tensor, need_grad: bool):
    """The row pass in torch ops, fp32 (``RowPass``)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    row_loss = lse - logits.gather(1, labels[:, None]).squeeze(1)
    preds = logits.argmax(dim=-1)
    if not need_grad:
        return row_loss, preds, None
    grad = torch.exp(logits - lse[:, None])
    grad.scatter_add_(1, labels[:, None], -torch.ones_like(lse)[:, None])
    return row_loss, preds, grad


def liger_rows(logits: torch.Tensor, labels: torch.Tensor, need_grad: bool):
    """The row pass in liger-kernel's Triton kernel (``RowPass``; CUDA): the logits become the gradient in
    place. reduction "sum" leaves each row's loss unscaled; no index is ignored (every label is a token)."""
    import triton  # CUDA only: optional, and absent from CPU installs
    from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel

    rows, vocab = logits.shape
    logits = logits.contiguous()
    labels = labels.contiguous()
    row_loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    preds = torch.empty(rows, dtype=torch.int64, device=logits.device)
    liger_cross_entropy_kernel[(rows,)](
        X_ptr=logits,
        X_stride=logits.stride(-2),
        Y_ptr=labels,
        Y_stride=labels.stride(-1),
        weight_ptr=None,
        loss_ptr=row_loss,
        z_loss_ptr=None,
        loss_stride=row_loss.stride(-1),
        token_accuracy_ptr=None,
        token_accuracy_stride=0,
        predicted_tokens_ptr=preds,
        predicted_tokens_stride=preds.stride(-1),
        n_cols=vocab,
        n_non_ignore=1,
        sum_non_ignore_weight=1,
        weight_sum=0.0,
        ignore_index=-100,
        lse_square_scale=0.0,
        label_smoothing=0.0,
        reduction="sum",
        softcap=None,
        RETURN_Z_LOSS=False,
        RETURN_TOKEN_ACCURACY=False,
        RETURN_PREDICTED_TOKENS=True,
        BLOCK_SIZE=min(32768, triton.next_power_of_2(vocab)),
        HAS_WEIGHT=False,
        HAS_SOFTCAPPING=False,
        HAS_GRADIENTS=need_grad,
        num_warps=32,
    )
    return row_loss, preds, logits if need_grad else None


ROW_PASSES: dict[str, RowPass] = {"chunked": torch_rows, "liger": liger_rows}


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(hidden_i @ weight.T, label_i), the argmax of each row and (``top_k`` > 0, DFlash2's
    selector) the ids of each row's top_k logits, in chunks of rows: one lm_head pass for all three."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_tokens: int, row_pass: RowPass, top_k: int = 0):
        num_rows = hidden.shape[0]
        top = torch.empty(num_rows, top_k, dtype=torch.int64, device=hidden.device)
        need_hidden_grad, need_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        preds = torch.empty(num_rows, dtype=torch.int64, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight_grad else None
        for start in range(0, num_rows, chunk_tokens):
            end = min(start + chunk_tokens, num_rows)
            h = hidden[start:end]
            w = weights[start:end].float()
            logits = h.to(weight.dtype) @ weight.t()  # [chunk, V] in the lm_head's dtype
            if top_k:  # before the row pass: liger's turns the logits into the gradient in place
                top[start:end] = logits.topk(top_k, dim=-1).indices
            need_grad = need_hidden_grad or need_weight_grad
            row_loss, preds[start:end], grad = row_pass(logits, labels[start:end], need_grad)
            loss_sum = loss_sum + (row_loss * w).sum()
            del logits
            if grad is None:
                continue
            grad = grad.to(weight.dtype)
            if need_hidden_grad:  # the weights scale rows of the [chunk, H] product, not of the logits
                grad_hidden[start:end] = ((grad @ weight).float() * w[:, None]).to(hidden.dtype)
            if need_weight_grad:
                grad_weight.add_(grad.t().float() @ (h.float() * w[:, None]))
        ctx.mark_non_differentiable(preds, top)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss_sum, preds, top

    @staticmethod
    def backward(ctx, grad_loss, grad_preds, grad_top):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_loss.to(grad_hidden.dtype) if grad_hidden is not None else None
        gw = (grad_weight * grad_loss).to(ctx.weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    chunk_tokens: int,
    row_pass: RowPass = torch_rows,
    top_k: int = 0,
) -> tuple[torch.Tensor, ...]:
    """(sum of weighted CE [scalar fp32, differentiable], greedy predictions [M] int64) for hidden [M, H];
    with ``top_k`` > 0 also the ids of each row's top_k logits [M, top_k] (DFlash2's candidates)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    loss, preds, top = _ChunkedLinearCrossEntropy.apply(
        hidden, weight, labels, weights, chunk_tokens, row_pass, top_k
    )
    return (loss, preds, top) if top_k else (loss, preds)


def linear_cross_entropy(impl: str, *, chunk_tokens: int = 2048) -> LinearCrossEntropy:
    """The loss's lm_head + cross-entropy for ``impl`` (``LOSS_IMPLS``), ``chunk_tokens`` rows at a time."""
    if impl not in ROW_PASSES:
        raise ValueError(f"loss impl must be one of {LOSS_IMPLS}, got {impl!r}")
    row_pass = ROW_PASSES[impl]
    return lambda h, w, lab, wt, top_k=0: chunked_linear_cross_entropy(
        h, w, lab, wt, chunk_tokens=chunk_tokens, row_pass=row_pass, top_k=top_k
    )


@dataclass(kw_only=True)
class DraftLossOutput:
    """Sums over one rank's step; divide after an all-reduce (see module docstring)."""

    loss_sum: torch.Tensor  # scalar fp32, differentiable: sum of label_weight * CE
    weight_sum: torch.Tensor  # scalar fp32: sum of label_weights
    correct: torch.Tensor  # [B] int64: greedy prediction == label at block position k, over valid labels
    valid: torch.Tensor  # [B] int64: labels with weight > 0 at block position k (0 at k=0)
    tau_sum: torch.Tensor  # scalar fp32: sum over valid blocks of τ
    num_blocks: torch.Tensor  # scalar int64: valid blocks
    selector: SelectorOutput | None = None  # DFlash2: the selector term (already weighed into loss_sum)

    def loss(self) -> torch.Tensor:
        """Local weighted mean (single process / logging); training divides by the global weight sum."""
        return self.loss_sum / self.weight_sum.clamp_min(1e-6)


@dataclass(kw_only=True)
class SelectorOutput:
    """DFlash2's selector term over one rank's step (sums; ``loss_sum`` is unweighted by alpha)."""

    loss_sum: torch.Tensor  # scalar fp32: sum of label_weight * selector CE over covered rows
    correct: torch.Tensor  # scalar int64: covered valid rows whose best score is the label
    covered: torch.Tensor  # scalar int64: valid rows whose label is among the top-k candidates
    valid: torch.Tensor  # scalar int64: valid rows


@dataclass(kw_only=True)
class SelectorTerm:
    """What the loss needs of a DFlash2 drafter: its ``CandidateSelector`` and the step's weight alpha
    (``selector_weight``: 0 through the warm-up, then ramped)."""

    selector: torch.nn.Module
    alpha: float


def selector_weight(
    step: int, total_steps: int, alpha: float, warmup_ratio: float, ramp_ratio: float
) -> float:
    """The selector loss's weight at optimizer step ``step`` of ``total_steps``: 0 for the first
    warmup_ratio of the steps, then linear up to ``alpha`` over the next ramp_ratio, then ``alpha``
    (SpecForge's DFlash2 schedule: fractions of the optimizer-step horizon)."""
    warm = warmup_ratio * total_steps
    ramp = ramp_ratio * total_steps
    if step < warm:
        return 0.0
    if ramp <= 0 or step >= warm + ramp:
        return float(alpha)
    return float(alpha) * (step - warm) / ramp


def top_k_ids(hidden: torch.Tensor, weight: torch.Tensor, k: int, chunk_tokens: int) -> torch.Tensor:
    """The k best lm_head tokens [M, k] of hidden rows [M, H], ``chunk_tokens`` rows of logits at a time
    (no gradient: only the ids; the scores are recomputed for them with a gradient)."""
    out = torch.empty(hidden.shape[0], k, dtype=torch.int64, device=hidden.device)
    with torch.no_grad():
        for start in range(0, hidden.shape[0], chunk_tokens):
            logits = hidden[start : start + chunk_tokens].to(weight.dtype) @ weight.t()
            out[start : start + chunk_tokens] = logits.topk(k, dim=-1).indices
    return out


def selector_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    predecessors: torch.Tensor,
    weights: torch.Tensor,
    selector: torch.nn.Module,
    *,
    chunk_tokens: int = 2048,
    candidates: torch.Tensor | None = None,
) -> SelectorOutput:
    """DFlash2's selector objective on rows hidden [M, H] (teacher-forced: each row's predecessor is the
    true previous token): cross-entropy over the STRICT top-k of the draft logits, re-scored by the
    selector; a row whose label is not among its k candidates contributes nothing (SpecForge DFlash2,
    "strict top-k"; ``covered`` counts the others). The unary scores of the candidates are recomputed with a
    gradient from their lm_head rows, so the term also trains the draft (no stop-gradient, SpecForge's
    default). Rows are weighted like the draft loss (``weights``: position decay, 0 off the loss mask).
    ``candidates`` [M, k]: the rows' top-k ids when the draft loss's lm_head pass gave them, else computed
    here (one more chunked pass)."""
    if candidates is None:
        candidates = top_k_ids(hidden, weight, selector.top_k, chunk_tokens)  # [M, k]
    unary = torch.einsum("mh,mkh->mk", hidden.to(weight.dtype), weight[candidates]).float()  # [M, k]
    scores = selector.scores(hidden, unary, candidates, predecessors).float()
    hit = candidates == labels[:, None]
    covered = hit.any(-1) & (weights > 0)
    ce = torch.logsumexp(scores, dim=-1) - (scores * hit).sum(-1)
    ce = torch.where(covered, ce, torch.zeros_like(ce))
    with torch.no_grad():
        best = candidates.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)
        correct = (covered & (best == labels)).sum()
    return SelectorOutput(
        loss_sum=(ce * weights.float()).sum(),
        correct=correct,
        covered=covered.sum(),
        valid=(weights > 0).sum(),
    )


def _with_selector(
    rows: torch.Tensor,
    batch: Any,
    lm_head_weight: torch.Tensor,
    lab: torch.Tensor,
    w: torch.Tensor,
    lce: LinearCrossEntropy,
    selector: SelectorTerm,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, SelectorOutput]:
    """``draft_loss``'s DFlash2 part: (draft loss + alpha x selector term, argmax, the selector's sums).
    One lm_head pass gives the draft loss and the candidates; the predecessors are the anchor for block
    position 1 and the label of position k-1 for position k (teacher forcing)."""
    loss_sum, preds, candidates = lce(rows, lm_head_weight, lab, w, top_k=selector.selector.top_k)
    labels = batch.labels
    predecessors = torch.cat([batch.block_input_ids[:, :1], labels[:, 1:-1]], dim=1).reshape(-1)
    out = selector_loss(
        rows,
        lm_head_weight,
        lab,
        predecessors,
        w,
        selector.selector,
        chunk_tokens=chunk_tokens,
        candidates=candidates,
    )
    return loss_sum + selector.alpha * out.loss_sum, preds, out


def draft_loss(
    hidden: torch.Tensor,
    batch: Any,
    lm_head_weight: torch.Tensor,
    *,
    chunk_tokens: int = 2048,
    lce: LinearCrossEntropy | None = None,
    selector: SelectorTerm | None = None,
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
    ``selector`` (DFlash2): adds alpha x the selector term (``selector_loss``; predecessors: the anchor for
    position 1, the label of position k-1 for position k) to ``loss_sum``, over the same weight sum.
    """
    labels, label_weights, anchor_valid = batch.labels, batch.label_weights, batch.anchor_valid
    n, b, h = hidden.shape
    lab = labels[:, 1:].reshape(-1)
    w = label_weights[:, 1:].reshape(-1)
    lce = lce or linear_cross_entropy("chunked", chunk_tokens=chunk_tokens)
    rows = hidden[:, 1:].reshape(-1, h)
    selector_out = None
    if selector is None:
        loss_sum, preds = lce(rows, lm_head_weight, lab, w)
    else:
        loss_sum, preds, selector_out = _with_selector(
            rows, batch, lm_head_weight, lab, w, lce, selector, chunk_tokens
        )
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
            selector=selector_out,
        )
