"""ShardFeed: claimed shards -> fixed-size packed streams, ack only after commit, skip trained samples."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from dflash.common.contract.names import shard_name
from dflash.common.contract.sample_set import SampleSet
from dflash.common.contract.shard import Shard, ShardMeta
from dflash.common.contract.shard_writer import write_shard
from dflash.common.contract.spool import Spool
from dflash.consumer.feed import ShardFeed

H, K = 8, 2


def make_shard(lengths: list[int], first_index: int, *, bucket: int = 0) -> Shard:
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    ids = torch.arange(total, dtype=torch.int32) % 97
    return Shard(
        input_ids=ids,
        loss_mask=torch.ones(total, dtype=torch.bool),
        cu_seqlens=cu,
        sample_index=torch.arange(first_index, first_index + len(lengths), dtype=torch.int64),
        hidden=torch.randn(total, K * H).to(torch.bfloat16),
        meta=ShardMeta(target_model="t", layer_ids=[1, 2], hidden_size=H, producer_id="p0", bucket=bucket),
    )


def publish(spool: Spool, shard: Shard, seq: int) -> None:
    tmp = spool.new_tmp_path(shard_name(shard.meta.bucket, "p0", seq))
    n = write_shard(tmp, shard)
    spool.publish(tmp, nbytes=n)


def finish(spool: Spool) -> None:
    spool.register_producers(["p0"])
    spool.mark_done("p0")


def drain(feed: ShardFeed, *, timeout_s: float = 20.0) -> list[list[int]]:
    steps = []
    deadline = time.monotonic() + timeout_s
    while not feed.exhausted():
        assert time.monotonic() < deadline, "feed did not finish"
        packed = feed.next_packed(wait_s=0.2)
        if packed is None:
            continue
        assert packed.input_ids.shape == (64,) and packed.hidden.shape == (64, K * H)
        steps.append(list(packed.sample_index))
        feed.commit()
    return steps


def test_every_sample_once_fixed_shape_and_acked(tmp_path):
    spool = Spool(tmp_path / "spool")
    for seq in range(4):
        publish(spool, make_shard([10, 30, 20], first_index=seq * 3), seq)
    finish(spool)
    feed = ShardFeed(spool, "c0", context_tokens=64, poll_s=0.01)
    try:
        steps = drain(feed)
    finally:
        feed.close()
    got = sorted(i for s in steps for i in s)
    assert got == list(range(12))
    assert not any(spool.ready_dir.iterdir())
    assert spool.stats()["states"]["claimed"]["shards"] == 0  # all acked
    # best-fit packing: 240 tokens fit in 4 streams of 64
    assert len(steps) <= 5


def test_shard_not_acked_before_commit(tmp_path):
    spool = Spool(tmp_path / "spool")
    publish(spool, make_shard([40, 40], first_index=0), 0)
    finish(spool)
    feed = ShardFeed(spool, "c0", context_tokens=64, poll_s=0.01)
    try:
        packed = None
        while packed is None:
            packed = feed.next_packed(wait_s=0.2)
        assert len(packed.sample_index) == 1  # 40 + 40 > 64
        assert feed.commit() == packed.sample_index
        # one sample of the shard is still outstanding: the shard stays claimed
        assert spool.stats()["states"]["claimed"]["shards"] == 1
        packed = None
        deadline = time.monotonic() + 60  # hang guard: the last sample is packed once the end is seen
        while packed is None:
            assert time.monotonic() < deadline, "the last sample was never packed"
            packed = feed.next_packed(wait_s=0.5)
        feed.commit()
        assert spool.stats()["states"]["claimed"]["shards"] == 0
    finally:
        feed.close()


def test_skip_set_drops_trained_samples_and_acks_empty_shards(tmp_path):
    spool = Spool(tmp_path / "spool")
    publish(spool, make_shard([10, 10], first_index=0), 0)
    publish(spool, make_shard([10, 10], first_index=2), 1)
    finish(spool)
    skip = SampleSet.from_indices([0, 1, 3])
    feed = ShardFeed(spool, "c0", context_tokens=64, poll_s=0.01, skip=skip)
    try:
        steps = drain(feed)
    finally:
        feed.close()
    assert sorted(i for s in steps for i in s) == [2]
    assert feed.counters.samples_skipped == 3
    assert spool.stats()["states"]["claimed"]["shards"] == 0


def test_corrupt_shard_is_quarantined_and_feed_continues(tmp_path, caplog):
    """The corrupt shard goes to quarantine/ with its reason, the next one trains, and one log line says
    so (the spool's "quarantined" warning repeated the feed's line)."""
    spool = Spool(tmp_path / "spool")
    publish(spool, make_shard([10], first_index=0), 0)
    publish(spool, make_shard([10], first_index=1), 1)
    # corrupt the first shard's zarr metadata
    bad = spool.ready_dir / shard_name(0, "p0", 0)
    (bad / "zarr.json").write_text("{not json")
    finish(spool)
    feed = ShardFeed(spool, "c0", context_tokens=64, poll_s=0.01)
    with caplog.at_level(logging.INFO):
        try:
            steps = drain(feed)
        finally:
            feed.close()
    assert sorted(i for s in steps for i in s) == [1]
    assert feed.counters.shards_quarantined == 1
    whys = list(spool.quarantine_dir.glob("*.why"))
    assert len(whys) == 1 and whys[0].read_text().strip()
    said = [r.getMessage() for r in caplog.records if bad.name in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"quarantining {bad.name} (unknown samples lost"), said


def test_overlong_sample_is_truncated_and_counted(tmp_path):
    spool = Spool(tmp_path / "spool")
    publish(spool, make_shard([100], first_index=0), 0)
    finish(spool)
    feed = ShardFeed(spool, "c0", context_tokens=64, poll_s=0.01)
    try:
        steps = drain(feed)
    finally:
        feed.close()
    assert steps == [[0]]
    assert feed.counters.samples_truncated == 1


@pytest.mark.parametrize("n_consumers", [2])
def test_two_feeds_share_a_spool_without_duplicates(tmp_path, n_consumers):
    spool_root = tmp_path / "spool"
    spool = Spool(spool_root)
    for seq in range(6):
        publish(spool, make_shard([16, 16], first_index=seq * 2), seq)
    finish(spool)
    feeds = [
        ShardFeed(Spool(spool_root), f"c{i}", context_tokens=64, poll_s=0.01) for i in range(n_consumers)
    ]
    seen: list[int] = []
    try:
        for f in feeds:
            seen += [i for s in drain(f) for i in s]
    finally:
        for f in feeds:
            f.close()
    assert sorted(seen) == list(range(12))
