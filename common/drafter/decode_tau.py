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
with no target forward; on other responses it estimates it. ``teacher_forced_generate`` walks one document
through a proposer (``DrafterProposer``: dflash-eval's inference path); ``batched_teacher_forced_generate``,
what the trainer runs, walks every held-out document at once, one drafter forward per round for all of
them (``draft_hidden``, the same inference form), and gives the same result (tests/test_decode_tau.py). Both run eagerly: the training step's compiled graphs are
never touched, so evaluating cannot recompile them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dflash.common.contract.shard_reader import read_shard
from dflash.common.drafter.dflash import Generation, Proposer, emit_tokens
from dflash.common.drafter.report import EvalReport, summarize


@dataclass(kw_only=True)
class HeldOutDoc:
    """One held-out document as the producers spooled it."""

    sample_index: int
    input_ids: np.ndarray  # int [T]
    loss_mask: np.ndarray  # bool [T]
    hidden: torch.Tensor  # [T, K*H]


def read_held_out(shard_paths: Sequence) -> list[HeldOutDoc]:
    """The held-out documents of these eval shards (the spool's eval/), by sample id."""
    docs = []
    for path in shard_paths:
        shard = read_shard(path)
        hidden = shard.restored_hidden()  # bf16 (an FP8 shard dequantized: eval shards are small)
        cu = shard.cu_seqlens.tolist()
        for i, sid in enumerate(shard.sample_index.tolist()):
            a, b = cu[i], cu[i + 1]
            docs.append(
                HeldOutDoc(
                    sample_index=int(sid),
                    input_ids=shard.input_ids[a:b].numpy(),
                    loss_mask=shard.loss_mask[a:b].numpy(),
                    hidden=hidden[a:b],
                )
            )
    return sorted(docs, key=lambda d: d.sample_index)


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
        b = min(block_size, max_new_tokens - len(gen.tokens) + 1)
        draft = proposer.propose(gen.tokens[-1], anchor_pos, b).to(torch.long).cpu()
        accepted, stopped = _verify(gen, ids, anchor_pos, draft, max_new_tokens, stop)
        if not stopped and len(gen.tokens) < max_new_tokens:
            proposer.extend(hidden[anchor_pos : anchor_pos + accepted + 1], anchor_pos)
    return gen


def _verify(
    gen: Generation, ids: list[int], anchor_pos: int, draft: torch.Tensor, max_new_tokens: int, stop: set[int]
) -> tuple[int, bool]:
    """One verify step with the document as the target: the drafts that match the document's next tokens
    are accepted, then the document's token at the first miss (the bonus). Appends to ``gen``; returns
    (accepted drafts, stopped)."""
    b = draft.shape[0] + 1
    truth = torch.tensor(ids[anchor_pos + 1 : anchor_pos + b])  # the target's token after each prefix
    accepted = int(torch.cumprod((draft == truth).long(), 0).sum())
    bonus = ids[anchor_pos + accepted + 1] if anchor_pos + accepted + 1 < len(ids) else ids[-1]
    new, stopped = emit_tokens(draft[:accepted].tolist() + [bonus], max_new_tokens - len(gen.tokens), stop)
    gen.steps.append((b, accepted, len(new)))
    gen.target_forwards += 1
    gen.tokens.extend(new)
    return accepted, stopped


@dataclass(kw_only=True)
class _Walk:
    """One document's decode in a batched walk: its tokens, its remaining budget, its position."""

    ids: list[int]
    start: int
    budget: int
    gen: Generation
    stopped: bool = False

    @property
    def anchor_pos(self) -> int:
        return self.start + len(self.gen.tokens) - 1


@torch.inference_mode()
def batched_teacher_forced_generate(
    drafter: torch.nn.Module,
    docs: Sequence[tuple[Sequence[int], torch.Tensor, int, int]],
    *,
    stop_token_ids: Sequence[int] = (),
) -> list[Generation]:
    """``teacher_forced_generate`` for many documents at once: each round drafts one block for every
    document still decoding, in ONE drafter forward; the same walk, and the same result up to float noise.

    ``docs``: (input_ids, hidden [T, K*H], start, max_new_tokens) per document. The documents' features
    are all known up front (the producer's forward), so each document's context keys/values are projected
    once for all its positions, and a block at ``anchor_pos`` attends to the first ``anchor_pos`` of them
    (a key mask) instead of a cache grown by the accepted tokens: the same keys, the same math.
    """
    d = drafter
    device = d.fc.weight.device
    block = d.spec.block_size
    stop = set(stop_token_ids)
    walks: list[_Walk] = []
    for ids, _, start, budget in docs:
        ids = [int(t) for t in ids]
        if budget < 1 or start + budget > len(ids):
            raise ValueError(f"need 1 <= max_new_tokens <= {len(ids) - start}, got {budget}")
        gen = Generation(tokens=[ids[start]], target_forwards=1)
        walks.append(_Walk(ids=ids, start=start, budget=budget, gen=gen, stopped=gen.tokens[0] in stop))
    if not walks:
        return []

    # context keys/values of every document, padded to the longest: [N, Tmax, kv_heads, head_dim] per layer
    t_max = max(len(w.ids) for w in walks)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for n, (_, hidden, _, _) in enumerate(docs):
        t = hidden.shape[0]
        k_doc, v_doc = d.context_keys_values(hidden, torch.arange(t))
        if not keys:
            keys = [k.new_zeros(len(walks), t_max, *k.shape[1:]) for k in k_doc]
            values = [v.new_zeros(len(walks), t_max, *v.shape[1:]) for v in v_doc]
        for i in range(len(keys)):
            keys[i][n, :t], values[i][n, :t] = k_doc[i], v_doc[i]
    while active := [n for n, w in enumerate(walks) if not w.stopped and len(w.gen.tokens) < w.budget]:
        a = len(active)
        anchor = torch.tensor([walks[n].anchor_pos for n in active], device=device)
        lens = torch.tensor(
            [min(block, walks[n].budget - len(walks[n].gen.tokens) + 1) for n in active], device=device
        )
        ids = torch.full((a, block), d.spec.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0] = torch.tensor([walks[n].gen.tokens[-1] for n in active], device=device)
        span = int(anchor.max())  # context keys past every anchor are masked anyway
        idx = torch.tensor(active, device=device)
        hidden = d.draft_hidden(
            ids, anchor, [k[idx, :span] for k in keys], [v[idx, :span] for v in values], block_len=lens
        )
        drafts = d.logits(hidden).argmax(-1)[:, 1:].cpu()

        for row, n in enumerate(active):
            w = walks[n]
            draft = drafts[row, : int(lens[row]) - 1]
            _, w.stopped = _verify(w.gen, w.ids, w.anchor_pos, draft, w.budget, stop)
    return [w.gen for w in walks]


def decode_order_tau(
    drafter: torch.nn.Module,
    docs: Sequence[HeldOutDoc],
    *,
    max_new_tokens: int | None = None,
    stop_token_ids: Sequence[int] = (),
) -> EvalReport:
    """τ (pooled over verify steps, as dflash-eval reports it) and acceptance per position over the first
    response of every document, each cut to ``max_new_tokens`` (default: the whole response). The
    documents are walked together (``batched_teacher_forced_generate``): one drafter forward per round."""
    was_training = drafter.training
    drafter.eval()
    try:
        walks = []
        for doc in docs:
            span = first_response(doc.loss_mask)
            if span is None:
                continue
            start, end = span
            budget = end - start if max_new_tokens is None else min(max_new_tokens, end - start)
            walks.append((doc.input_ids, doc.hidden, start, budget))
        gens = batched_teacher_forced_generate(drafter, walks, stop_token_ids=stop_token_ids)
        return summarize(gens, drafter.config.block_size)
    finally:
        drafter.train(was_training)
