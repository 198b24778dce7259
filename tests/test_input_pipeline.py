"""The overlapped input pipeline and full streams: the same batches as the serial path, split documents
trained once, streams filled."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from dflash.common.contract.names import shard_name
from dflash.common.contract.shard import Shard, ShardMeta
from dflash.common.contract.shard_writer import write_shard
from dflash.common.contract.spool import Spool
from dflash.common.drafter.batch import DraftBatch, build_draft_batch, pack_samples
from dflash.consumer.feed import ShardFeed
from dflash.consumer.input_pipeline import InputPipeline

H, K = 8, 2
CONTEXT = 256


def _publish(spool: Spool, lengths: list[int], first_index: int, seq: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    shard = Shard(
        input_ids=torch.randint(0, 97, (total,), generator=g, dtype=torch.int32),
        loss_mask=torch.rand(total, generator=g) > 0.2,
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
        sample_index=torch.arange(first_index, first_index + len(lengths), dtype=torch.int64),
        hidden=torch.randn(total, K * H, generator=g).to(torch.bfloat16),
        meta=ShardMeta(target_model="t", layer_ids=[1, 2], hidden_size=H, producer_id="p0", bucket=CONTEXT),
    )
    tmp = spool.new_tmp_path(shard_name(CONTEXT, "p0", seq))
    spool.publish(tmp, nbytes=write_shard(tmp, shard))


def _spool(root, *, seed: int = 0, shards: int = 8) -> tuple[Spool, int]:
    """Shards of chat-like lengths (some longer than half a stream, so documents get split)."""
    spool = Spool(root)
    rng = random.Random(seed)
    index = 0
    for seq in range(shards):
        lengths = [rng.choice([20, 40, 90, 150, 200, 250]) for _ in range(6)]
        _publish(spool, lengths, index, seq, seed * 100 + seq)
        index += len(lengths)
    spool.register_producers(["p0"])
    spool.mark_done("p0")
    return spool, index


def _feed(spool: Spool, **kw) -> ShardFeed:
    # fill_wait_s: never pack a short stream because the decode thread was slow on a loaded box
    return ShardFeed(
        spool,
        "c0",
        context_tokens=CONTEXT,
        poll_s=0.01,
        bucket=None,
        min_split_tokens=32,
        fill_wait_s=1e9,
        **kw,
    )


def _builder(seed: int):
    gen = torch.Generator().manual_seed(seed)

    def build(packed) -> DraftBatch:
        return build_draft_batch(
            packed,
            block_size=4,
            num_anchors=24,
            max_anchors_per_doc=6,
            mask_token_id=1,
            gamma=7.0,
            generator=gen,
        )

    return build


def _packed_streams(n: int, seed: int = 0) -> list:
    """A fixed sequence of packed streams (documents of random lengths, split pieces included)."""
    g = torch.Generator().manual_seed(seed)
    streams = []
    for i in range(n):
        docs, used = [], 0
        while used < CONTEXT - 16:
            length = min(CONTEXT - used, int(torch.randint(8, 120, (1,), generator=g)))
            ids = torch.randint(0, 97, (length,), generator=g)
            mask = torch.rand(length, generator=g) > 0.2
            docs.append(
                (ids, mask, torch.randn(length, K * H, generator=g).to(torch.bfloat16), 1000 * i + len(docs))
            )
            used += length
        offsets = [int(torch.randint(0, 50, (1,), generator=g))] + [0] * (len(docs) - 1)
        streams.append(pack_samples(docs, context_tokens=CONTEXT, position_offsets=offsets))
    return streams


def _overlapped(spool: Spool, depth: int) -> tuple[list[DraftBatch], list[list[int]]]:
    feed = _feed(spool)
    pipe = InputPipeline(
        lambda w: feed.next_packed(wait_s=w),
        _builder(7),
        feed.exhausted,
        device=torch.device("cpu"),
        hidden_dtype=torch.float32,
        depth=depth,
        poll_s=0.05,
    )
    batches, trained = [], []
    try:
        while True:
            item = pipe.get(timeout=0.5)
            if item is None:
                if pipe.exhausted():
                    break
                continue
            batches.append(item.batch)
            trained.append(feed.commit())  # oldest packed step first, while later ones are in flight
    finally:
        pipe.close()
        feed.close()
    return batches, trained


def test_overlapped_pipeline_yields_exactly_the_serial_batches():
    """Same packed streams, same seed: the pipeline thread (building 1 or 3 steps ahead) hands out the very
    batches the serial loop builds — same anchors, draft blocks, labels and weights, in the same order."""
    streams = _packed_streams(12)
    build = _builder(7)
    serial = [build(p) for p in streams]
    for depth in (1, 3):
        source = iter(streams)
        left = [len(streams)]

        def next_packed(_wait, source=source, left=left):
            left[0] -= 1
            return next(source, None)

        pipe = InputPipeline(
            next_packed,
            _builder(7),
            lambda left=left: left[0] < 0,
            device=torch.device("cpu"),
            hidden_dtype=torch.float32,
            depth=depth,
        )
        got = []
        try:
            while (item := pipe.get(timeout=5.0)) is not None:
                got.append(item)
        finally:
            pipe.close()
        assert pipe.exhausted() and len(got) == len(serial)
        for s, item in zip(serial, got, strict=True):
            o = item.batch
            for f in dataclasses.fields(DraftBatch):
                a, b = getattr(s, f.name), getattr(o, f.name)
                if isinstance(a, torch.Tensor):
                    assert torch.equal(a.to(b.dtype), b), f.name
                else:
                    assert a == b, f.name
            assert item.tokens == int((s.doc_ids >= 0).sum())
            assert item.weight == float(s.label_weights.sum(dtype=torch.float64))


def test_pipeline_surfaces_a_source_error():
    def broken(_wait):
        raise OSError("spool vanished")

    pipe = InputPipeline(
        broken, _builder(0), lambda: False, device=torch.device("cpu"), hidden_dtype=torch.float32
    )
    try:
        with pytest.raises(RuntimeError, match="input pipeline failed: spool vanished"):
            while pipe.get(timeout=5.0) is None and not pipe.exhausted():
                pass
    finally:
        pipe.close()


def test_split_documents_are_trained_once_with_continuing_positions_and_full_streams(tmp_path):
    spool, num_samples = _spool(tmp_path / "s", seed=3, shards=10)
    batches, trained = _overlapped(spool, depth=3)
    flat = [i for step in trained for i in step]
    assert sorted(flat) == list(range(num_samples)), "every sample trained exactly once"
    # documents were split: some sample index appears in two streams, its second piece continues the
    # positions where the first ended, and the sample counts as trained only with its last piece
    seen_in: dict[int, list[int]] = {}
    for n, b in enumerate(batches):
        for doc, idx in enumerate(b.sample_index):
            seen_in.setdefault(idx, []).append(n)
            pos = b.positions[b.doc_ids == doc]
            assert torch.equal(pos, torch.arange(int(pos[0]), int(pos[0]) + pos.numel()))
    split = {i: steps for i, steps in seen_in.items() if len(steps) > 1}
    assert split, "this length mix must make the packer split documents"
    for idx, steps in split.items():
        done_at = next(n for n, step in enumerate(trained) if idx in step)
        assert done_at == steps[-1], "a split sample is trained when its LAST piece is committed"
        first, second = batches[steps[0]], batches[steps[1]]
        end_first = int(first.positions[first.doc_ids == first.sample_index.index(idx)][-1])
        start_second = int(second.positions[second.doc_ids == second.sample_index.index(idx)][0])
        assert start_second == end_first + 1
    slots = len(batches) * CONTEXT
    real = sum(int((b.doc_ids >= 0).sum()) for b in batches)
    assert real / slots >= 0.9, real / slots  # all but the last streams full (min split 32 of 256)
    assert spool.stats()["states"]["claimed"]["shards"] == 0  # every shard acked after its last sample


def test_without_splitting_streams_hold_whole_documents(tmp_path):
    spool, num_samples = _spool(tmp_path / "w", seed=3, shards=10)
    feed = ShardFeed(spool, "c0", context_tokens=CONTEXT, poll_s=0.01, bucket=None, min_split_tokens=None)
    seen = []
    try:
        while not feed.exhausted():
            packed = feed.next_packed(wait_s=0.2)
            if packed is None:
                continue
            assert all(int(packed.positions[packed.doc_ids == d][0]) == 0 for d in range(packed.num_docs))
            seen += feed.commit()
    finally:
        feed.close()
    assert sorted(seen) == list(range(num_samples))
