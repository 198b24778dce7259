"""a consumer refuses a second copy of a sample it holds (pooled, in a step) or trained in this
life, e.g. a leftover shard of an earlier launch and its re-produced twin; each sample is trained once and
the shard holding only copies is acked, not trained."""

from __future__ import annotations

import time

import torch

from dflash.common.contract.names import shard_name
from dflash.common.contract.shard import Shard, ShardMeta
from dflash.common.contract.shard_writer import write_shard
from dflash.common.contract.spool import Spool
from dflash.consumer.feed import ShardFeed

H, K = 8, 2


def _publish(spool: Spool, producer: str, seq: int, indices: list[int], length: int = 10) -> None:
    total = length * len(indices)
    shard = Shard(
        input_ids=torch.arange(total, dtype=torch.int32) % 97,
        loss_mask=torch.ones(total, dtype=torch.bool),
        cu_seqlens=torch.arange(0, total + 1, length, dtype=torch.int64),
        sample_index=torch.tensor(indices, dtype=torch.int64),
        hidden=torch.randn(total, K * H).to(torch.bfloat16),
        meta=ShardMeta(target_model="t", layer_ids=[1, 2], hidden_size=H, producer_id=producer, bucket=0),
    )
    tmp = spool.new_tmp_path(shard_name(0, producer, seq))
    spool.publish(tmp, nbytes=write_shard(tmp, shard))


def test_copies_of_held_or_trained_samples_are_refused(tmp_path):
    spool = Spool(tmp_path / "spool")
    # launch 1 left [0, 1, 2] and [3, 4]; launch 2 re-produced 1..4 and produced 5
    _publish(spool, "n0p0.1", 0, [0, 1, 2])
    _publish(spool, "n0p0.1", 1, [3, 4])
    _publish(spool, "n0p0.2", 0, [1, 2, 3, 4])
    _publish(spool, "n0p0.2", 1, [5])
    spool.register_producers(["n0p0.2"])
    spool.mark_done("n0p0.2")
    feed = ShardFeed(spool, "r0-test", context_tokens=64, poll_s=0.01, bucket=None)
    trained: list[int] = []
    try:
        deadline = time.monotonic() + 30  # a hang guard
        while not feed.exhausted():
            assert time.monotonic() < deadline, "feed did not finish"
            if feed.next_packed(wait_s=0.2) is not None:
                trained += feed.commit()
    finally:
        feed.close()
    assert sorted(trained) == [0, 1, 2, 3, 4, 5]  # each once, whichever copy came first
    assert feed.counters.samples_duplicate == 4
    assert (
        spool.stats()["states"]["claimed"]["shards"] == 0 and spool.stats()["states"]["ready"]["shards"] == 0
    )
