"""Decode-order τ on held-out documents: the acceptance length serving will see, measured during training.

Why: the trainer's in-loop τ averages over uniformly drawn anchors, but decoding starts each block right after
the previous block's first miss, a harder position (the demo measured in-loop 6.83 vs 3.55 from the real
draft→verify loop on the same drafter and data). This module walks a document the way decoding does, with
the document standing in for the target:

- the first block's anchor is the first supervised token (decoding's prefill emits it); its context is the
  features of every position before it;
- the drafts are compared with the document's next tokens; the leading matches are accepted, and the next
  anchor is the token after them (the target's token at the first miss, the bonus token);
- the features of the anchor and the accepted tokens join the context, taken from the document's hidden
  states (the producer's full forward, what the target's verify forward computes for those tokens).

When the response is the target's own greedy output this IS ``dflash-eval``'s loop, step for step
(``speculative_generate`` with the same budget and stop tokens; tests/test_decode_tau.py checks equality),
with no target forward; on other responses it estimates it. The drafter runs through ``DrafterProposer``,
the same inference path dflash-eval uses, eagerly: the training step's compiled graphs are never touched,
so evaluating cannot recompile them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dflash.consumer.evaluate import DrafterProposer, EvalReport, Generation, Proposer, _emit, summarize


@dataclass(kw_only=True)
class HeldOutDoc:
    """One held-out document as the producers spooled it."""

    sample_index: int
    input_ids: np.ndarray  # int [T]
    loss_mask: np.ndarray  # bool [T]
    hidden: torch.Tensor  # [T, K*H]


def first_response(loss_mask: np.ndarray) -> tuple[int, int] | None:
    """[start, end) of the first supervised span (the first assistant turn), None when there is none."""
    idx = np.flatnonzero(np.asarray(loss_mask, dtype=bool))
    if idx.size == 0:
        return None
    start = int(idx[0])
    gaps = np.flatnonzero(np.diff(idx) != 1)
    end = int(idx[gaps[0]]) + 1 if gaps.size else int(idx[-1]) + 1
    return start, end


@torch.inference_mode()
def teacher_forced_generate(
    proposer: Proposer,
    input_ids: Sequence[int],
    hidden: torch.Tensor,
    *,
    start: int,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    block_size: int,
) -> Generation:
    """``speculative_generate`` with ``input_ids[start:]`` as the target's output and ``hidden`` as its features.

    ``input_ids[:start]`` is the prompt; the prefill's token is ``input_ids[start]``; the document must hold
    at least ``start + max_new_tokens`` tokens (the walk reads the next token after each accepted run).
    """
    ids = [int(t) for t in input_ids]
    if max_new_tokens < 1 or start + max_new_tokens > len(ids):
        raise ValueError(f"need 1 <= max_new_tokens <= {len(ids) - start}, got {max_new_tokens}")
    stop = set(stop_token_ids)
    proposer.reset()
    proposer.extend(hidden[:start], 0)
    gen = Generation(tokens=[ids[start]], target_forwards=1)
    stopped = gen.tokens[0] in stop
    while not stopped and len(gen.tokens) < max_new_tokens:
        anchor_pos = start + len(gen.tokens) - 1
        remaining = max_new_tokens - len(gen.tokens)
        b = min(block_size, remaining + 1)
        draft = proposer.propose(gen.tokens[-1], anchor_pos, b).to(torch.long).cpu()
        truth = torch.tensor(ids[anchor_pos + 1 : anchor_pos + b])  # the target's token after each prefix
        accepted = int(torch.cumprod((draft == truth).long(), 0).sum())
        bonus = ids[anchor_pos + accepted + 1] if anchor_pos + accepted + 1 < len(ids) else ids[-1]
        new, stopped = _emit(draft[:accepted].tolist() + [bonus], remaining, stop)
        gen.steps.append((b, accepted, len(new)))
        gen.target_forwards += 1
        gen.tokens.extend(new)
        if not stopped and len(gen.tokens) < max_new_tokens:
            proposer.extend(hidden[anchor_pos : anchor_pos + accepted + 1], anchor_pos)
    return gen


def decode_order_tau(
    drafter: torch.nn.Module,
    docs: Sequence[HeldOutDoc],
    *,
    max_new_tokens: int | None = None,
    stop_token_ids: Sequence[int] = (),
) -> EvalReport:
    """τ (pooled over verify steps, as dflash-eval reports it) and acceptance per position over the first
    response of every document, each cut to ``max_new_tokens`` (default: the whole response)."""
    was_training = drafter.training
    drafter.eval()
    try:
        proposer = DrafterProposer(drafter)
        block = drafter.config.block_size
        gens = []
        for doc in docs:
            span = first_response(doc.loss_mask)
            if span is None:
                continue
            start, end = span
            budget = end - start if max_new_tokens is None else min(max_new_tokens, end - start)
            gens.append(
                teacher_forced_generate(
                    proposer, doc.input_ids, doc.hidden, start=start, max_new_tokens=budget,
                    stop_token_ids=stop_token_ids, block_size=block,
                )  # fmt: skip
            )
        return summarize(gens, block)
    finally:
        drafter.train(was_training)
