"""Speculative decoding against the target: the draft -> verify loop (``speculative_generate``) and plain greedy
decoding with the same KV cache (``greedy_generate``: the baseline for speed and for the lossless check).
The drafter's side of the loop is common/drafter/decode.py; the target's, runner.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from dflash.common.drafter.decode import Generation, Proposer, _emit
from dflash.common.target.runner import TargetRunner

log = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def speculative_generate(
    target: TargetRunner,
    proposer: Proposer,
    prompt: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    block_size: int | None = None,
) -> Generation:
    """Greedy DFlash decoding of `prompt` [P]; see the module docstring for the loop."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    block = block_size or proposer.block_size
    stop = set(stop_token_ids)
    _sync(target.device)
    t0 = time.perf_counter()
    target.reset()
    proposer.reset()
    logits, feats = target.forward(prompt, last_logits_only=True)
    proposer.extend(feats, 0)
    gen = Generation(tokens=[int(logits[-1].argmax())], target_forwards=1)
    stopped = gen.tokens[0] in stop
    while not stopped and len(gen.tokens) < max_new_tokens:
        anchor_pos = target.length
        remaining = max_new_tokens - len(gen.tokens)
        b = min(block, remaining + 1)
        draft = proposer.propose(gen.tokens[-1], anchor_pos, b)
        ids = torch.cat([torch.tensor([gen.tokens[-1]]), draft.to(torch.long).cpu()])
        logits, feats = target.forward(ids)
        gen.target_forwards += 1
        greedy = logits.argmax(-1).cpu()  # greedy[k]: the target's token after ids[:k+1]
        accepted = int(torch.cumprod((draft == greedy[:-1]).long(), 0).sum())
        new, stopped = _emit(draft[:accepted].tolist() + [int(greedy[accepted])], remaining, stop)
        gen.steps.append((b, accepted, len(new)))
        gen.tokens.extend(new)
        target.crop(anchor_pos + accepted + 1)
        if not stopped and len(gen.tokens) < max_new_tokens:
            proposer.extend(feats[: accepted + 1], anchor_pos)
    _sync(target.device)
    gen.wall_s = time.perf_counter() - t0
    return gen


@torch.inference_mode()
def greedy_generate(
    target: TargetRunner, prompt: torch.Tensor, *, max_new_tokens: int, stop_token_ids: Sequence[int] = ()
) -> Generation:
    """Plain greedy decoding with the same cache: the baseline for speed and for the lossless check."""
    stop = set(stop_token_ids)
    _sync(target.device)
    t0 = time.perf_counter()
    target.reset()
    logits, _ = target.forward(prompt, last_logits_only=True, capture=False)
    gen = Generation(tokens=[int(logits[-1].argmax())], target_forwards=1)
    while gen.tokens[-1] not in stop and len(gen.tokens) < max_new_tokens:
        logits, _ = target.forward(torch.tensor([gen.tokens[-1]]), capture=False)
        gen.tokens.append(int(logits[-1].argmax()))
        gen.target_forwards += 1
    _sync(target.device)
    gen.wall_s = time.perf_counter() - t0
    return gen
