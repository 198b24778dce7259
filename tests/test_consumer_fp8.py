"""A consumer reads FP8 shards, bf16 shards or a spool of both without a flag (each shard's attributes say
its codec): FP8 stays FP8 through the feed and is dequantized after the copy to the device."""

from __future__ import annotations

import math
import time

import torch

from dflash.common.contract import hidden_fp8
from dflash.common.contract.codecs import CodecConfig
from dflash.common.contract.names import shard_name
from dflash.common.contract.shard import Shard, ShardMeta
from dflash.common.contract.shard_writer import write_shard
from dflash.common.contract.spool import Spool
from dflash.consumer.feed import ShardFeed

LAYER_IDS = [1, 2, 3, 4, 5]  # the demo target's default capture (8 layers, hidden 256)
HIDDEN = 256


def fill(spool: Spool, codecs: list[str], *, samples: int = 4, tokens: int = 24, seed: int = 0) -> None:
    """One shard per codec spec, `samples` samples of `tokens` tokens each; the producer done."""
    g = torch.Generator().manual_seed(seed)
    for seq, spec in enumerate(codecs):
        t = samples * tokens
        shard = Shard(
            input_ids=torch.randint(4, 4000, (t,), generator=g, dtype=torch.int32),
            loss_mask=torch.rand(t, generator=g) > 0.2,
            cu_seqlens=torch.arange(0, t + 1, tokens, dtype=torch.int64),
            sample_index=torch.arange(seq * samples, (seq + 1) * samples, dtype=torch.int64),
            hidden=torch.randn(t, len(LAYER_IDS) * HIDDEN, generator=g).to(torch.bfloat16),
            meta=ShardMeta(
                target_model="tiny", layer_ids=LAYER_IDS, hidden_size=HIDDEN, producer_id="p0", bucket=tokens
            ),
        )
        tmp = spool.new_tmp_path(shard_name(tokens, "p0", seq))
        spool.publish(tmp, nbytes=write_shard(tmp, shard, CodecConfig.parse(spec)))
    spool.register_producers(["p0"])
    spool.mark_done("p0")


def test_the_feed_reads_both_codecs_without_a_flag_and_keeps_fp8_as_stored(tmp_path):
    spool = Spool(tmp_path / "spool")
    fill(spool, ["fp8", "fp8", "zstd:1:shuffle", "fp8:none"])
    feed = ShardFeed(spool, "c0", context_tokens=96, poll_s=0.01, bucket=None, pool_streams=1)
    dtypes, seen = [], []
    deadline = time.monotonic() + 30
    try:
        while not feed.exhausted():
            assert time.monotonic() < deadline, "the feed did not finish"
            packed = feed.next_packed(wait_s=0.2)
            if packed is None:
                continue
            fp8 = packed.hidden.dtype == hidden_fp8.FP8_DTYPE
            assert fp8 == (packed.hidden_scales is not None)
            dtypes.append("fp8" if fp8 else str(packed.hidden.dtype))
            seen += packed.sample_index
            feed.commit()
    finally:
        feed.close()
    assert sorted(seen) == list(range(16)) and feed.counters.shards_quarantined == 0
    assert "fp8" in dtypes and "torch.bfloat16" in dtypes, dtypes


def test_a_trainer_trains_from_a_spool_of_both_codecs_without_a_flag(tmp_path, tiny_target):
    from dflash.consumer.config import TrainConfig
    from dflash.consumer.trainer import Trainer

    spool = Spool(tmp_path / "spool")
    fill(spool, ["fp8", "zstd:1:shuffle", "fp8", "zstd:1"])
    cfg = TrainConfig.from_flat(
        spool=str(spool.root),
        target=str(tiny_target),
        compile=False,
        context_tokens=96,
        num_anchors=8,
        max_anchors_per_doc=4,
        num_layers=1,
        block_size=4,
        log_every=1,
        eval_every=10**6,
        bucket="oldest",
        pool_streams=1,
    )
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):  # a Trainer seeds the RNG and flushes denormals: put back
        trainer = Trainer(cfg)
        try:
            summary = trainer.train()
        finally:
            trainer.close()
            torch.set_flush_denormal(False)
            torch.set_num_threads(threads)
    assert sorted(trainer.progress.trained.indices().tolist()) == list(range(16))
    assert summary["history"] and all(math.isfinite(r["loss"]) for r in summary["history"])
    assert not any(spool.ready_dir.iterdir()) and not any(spool.quarantine_dir.iterdir())
