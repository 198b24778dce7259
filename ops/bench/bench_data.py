"""Benchmark inputs that go through the user's path: a target folder and a spool of real shards.

- ``write_target_head``: a target model folder (config.json + model.safetensors with ONLY the embedding and
  lm_head, random bf16) of a named shape: what ``dflash-consume --target`` reads.
- ``SpoolFiller``: producer processes writing real shards (the project's zarr writer, its default codec or
  ``codec``, the
  spool's publish protocol and byte budget) with a realistic chat length distribution (log-normal, median
  900 tokens, capped at the context; shards hold one length bucket each, as real producers write them).
  ``learnable=True`` makes tokens follow a sparse random Markov chain over 256 words (2 successors each) and
  hidden states carry the current token, so a drafter can learn (loss curves mean something); otherwise
  tokens and hidden states are random.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.common.contract.codecs import CodecConfig
from dflash.common.contract.names import shard_name
from dflash.common.contract.shard import Shard, ShardMeta
from dflash.common.contract.shard_writer import write_shard
from dflash.common.contract.spool import Spool

BUCKETS = [128, 256, 512, 1024, 2048, 4096, 8192]


def write_target_head(root: Path, shape: dict, *, seed: int = 0, linear: dict | None = None) -> Path:
    """config.json + model.safetensors (embed_tokens + lm_head only) for a Qwen3-architecture target, or with
    ``linear`` (Gated DeltaNet dims) a Qwen3.5 hybrid text target, full attention every 4th layer: the
    consumer then builds the hybrid targets' drafter layout (all layers but the last sliding)."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5TextConfig, Qwen3Config

    root.mkdir(parents=True, exist_ok=True)
    dims = dict(
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        intermediate_size=shape["intermediate_size"],
        vocab_size=shape["vocab_size"],
        num_hidden_layers=shape["num_target_layers"],
        tie_word_embeddings=False,
    )
    if linear:
        n = shape["num_target_layers"]
        types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
        cfg = Qwen3_5TextConfig(**dims, **linear, layer_types=types)
    else:
        cfg = Qwen3Config(**dims)
    cfg.save_pretrained(root)
    g = torch.Generator().manual_seed(seed)
    v, h = shape["vocab_size"], shape["hidden_size"]
    tensors = {
        "model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).to(torch.bfloat16),
        "lm_head.weight": (torch.randn(v, h, generator=g) * 0.02).to(torch.bfloat16),
    }
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


@dataclass
class FillPlan:
    spool: str
    hidden_size: int
    layer_ids: list[int]
    vocab_size: int
    context_tokens: int
    total_tokens: int  # tokens to write over all producers
    budget_bytes: int
    producers: int = 4
    seed: int = 0
    learnable: bool = False
    median_tokens: int = 900
    sigma: float = 0.9
    codec: str | None = None  # the shards' codec spec (None: the shard format's default)


def chat_lengths(rng: random.Random, n: int, *, cap: int, median: int, sigma: float) -> list[int]:
    return [min(cap, max(32, int(math.exp(rng.gauss(math.log(median), sigma))))) for _ in range(n)]


LEARNABLE_VOCAB = 256  # tokens the learnable language uses (a drafter sees each bigram often)
LEARNABLE_SUCCESSORS = 2  # each token is followed by one of 2 (fixed) tokens: ~0.7 nats per position


def _markov_tokens(rng: torch.Generator, n: int, words: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Each token is one of ``table.shape[1]`` successors of the previous one, so text is predictable."""
    out = torch.empty(n, dtype=torch.int64)
    choice = torch.randint(0, table.shape[1], (n,), generator=rng).tolist()
    state = int(torch.randint(0, words.numel(), (1,), generator=rng))
    succ = table.tolist()
    for i in range(n):
        out[i] = state
        state = succ[state][choice[i]]
    return words[out]


def _produce(plan: FillPlan, rank: int) -> int:
    torch.set_num_threads(1)
    spool = Spool(plan.spool)
    pid = f"bench{rank}"
    rng = random.Random(plan.seed * 1000 + rank)
    g = torch.Generator().manual_seed(plan.seed * 1000 + rank)
    width = plan.hidden_size * len(plan.layer_ids)
    share = plan.total_tokens // plan.producers
    codec = CodecConfig.parse(plan.codec) if plan.codec else None
    if plan.learnable:
        tg = torch.Generator().manual_seed(plan.seed)  # the same language for every producer
        words = torch.randperm(plan.vocab_size, generator=tg)[:LEARNABLE_VOCAB]
        table = torch.randint(0, LEARNABLE_VOCAB, (LEARNABLE_VOCAB, LEARNABLE_SUCCESSORS), generator=tg)
        token_code = torch.randn(plan.vocab_size, width, generator=tg).to(torch.bfloat16)
    else:
        noise = torch.randn(plan.context_tokens * 2, width, generator=g).to(torch.bfloat16)
    written, seq, next_index = 0, 0, rank
    while written < share:
        lengths = sorted(
            chat_lengths(rng, 64, cap=plan.context_tokens, median=plan.median_tokens, sigma=plan.sigma)
        )
        by_bucket: dict[int, list[int]] = {}
        for n in lengths:
            by_bucket.setdefault(next(b for b in BUCKETS if n <= b), []).append(n)
        for bucket, group in by_bucket.items():
            per_shard = max(1, 32768 // bucket)
            for i in range(0, len(group), per_shard):
                part = group[i : i + per_shard]
                total = sum(part)
                if plan.learnable:
                    ids = torch.cat([_markov_tokens(g, n, words, table) for n in part])
                    hidden = token_code[ids]
                else:
                    ids = torch.randint(0, plan.vocab_size, (total,), generator=g)
                    start = int(torch.randint(0, noise.shape[0] - plan.context_tokens, (1,), generator=g))
                    hidden = torch.cat([noise[start : start + n] for n in part])
                mask = torch.ones(total, dtype=torch.bool)
                offset = 0
                for n in part:  # the first ~20 % of each chat is the prompt: not supervised
                    mask[offset : offset + n // 5] = False
                    offset += n
                indices = torch.arange(next_index, next_index + plan.producers * len(part), plan.producers)
                next_index += plan.producers * len(part)
                shard = Shard(
                    input_ids=ids.to(torch.int32),
                    loss_mask=mask,
                    cu_seqlens=torch.tensor([0, *torch.tensor(part).cumsum(0).tolist()], dtype=torch.int64),
                    sample_index=indices.to(torch.int64),
                    hidden=hidden,
                    meta=ShardMeta(
                        target_model="bench",
                        layer_ids=plan.layer_ids,
                        hidden_size=plan.hidden_size,
                        producer_id=pid,
                        bucket=bucket,
                    ),
                )
                spool.wait_for_budget(plan.budget_bytes)
                tmp = spool.new_tmp_path(shard_name(bucket, pid, seq))
                spool.publish(tmp, nbytes=write_shard(tmp, shard, codec))
                seq += 1
                written += total
    spool.mark_done(pid)
    return written


class SpoolFiller:
    """``producers`` processes filling the spool (under its byte budget) until ``total_tokens`` are written."""

    def __init__(self, plan: FillPlan) -> None:
        self.plan = plan
        spool = Spool(plan.spool)
        spool.register_producers([f"bench{r}" for r in range(plan.producers)])
        ctx = mp.get_context("spawn")
        self.pool = ctx.Pool(plan.producers)
        self.result = self.pool.starmap_async(_produce, [(plan, r) for r in range(plan.producers)])

    def wait(self) -> int:
        written = sum(self.result.get())
        self.pool.close()
        self.pool.join()
        return written

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


def describe(plan: FillPlan) -> str:
    return json.dumps({k: v for k, v in plan.__dict__.items() if k != "spool"})
