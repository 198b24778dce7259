"""Full streams: a stream waits for a full pool while a producer produces, and is packed short at
once when none can give more soon (blocked on the spool budget, done); ranks step only when every rank
holds a step or has no more data."""

from __future__ import annotations

import time

from test_feed import finish, make_shard, publish

from dflash.common.contract.spool import Spool
from dflash.common.contract.spool_records import BUDGET_PHASE
from dflash.consumer.agreement import RankView, StepAgreement
from dflash.consumer.feed import ShardFeed

CONTEXT = 64


def _first_stream(feed: ShardFeed, *, within_s: float):
    """The first packed stream within ``within_s`` seconds, else None."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        packed = feed.next_packed(wait_s=0.05)
        if packed is not None:
            return packed
    return None


def _feed(spool: Spool) -> ShardFeed:
    # the producer's one heartbeat stays fresh for the test (timeout 60 s); the feed rescans every 5 s
    return ShardFeed(
        spool,
        "c0",
        context_tokens=CONTEXT,
        poll_s=0.01,
        pool_streams=4,
        heartbeat_timeout_s=60.0,
        fill_wait_s=60.0,
        bucket=None,
    )


def test_a_short_pool_waits_while_a_producer_produces_and_packs_once_it_is_blocked_on_the_budget(tmp_path):
    spool = Spool(tmp_path / "spool")
    spool.register_producers(["p0"])
    spool.heartbeat("producer", "p0", {"phase": "produce"})
    publish(spool, make_shard([20, 20], first_index=0), 0)  # 40 tokens: far below a pool of 4 x 64
    feed = _feed(spool)
    try:
        # the producer produces: no stream from a pool of 40 tokens (it would be 62 % padding)
        assert _first_stream(feed, within_s=2.0) is None
        assert feed.producers_producing == 1
        # blocked on the spool budget: it gives nothing more until this consumer trains what it holds
        spool.heartbeat("producer", "p0", {"phase": BUDGET_PHASE})
        packed = _first_stream(feed, within_s=20.0)
        assert packed is not None, "a short stream must be packed when no producer can give more"
        assert sorted(packed.sample_index) == [0, 1]
        assert feed.producers_producing == 0
    finally:
        feed.close()


def test_a_full_pool_packs_at_once_and_a_done_producer_releases_the_rest(tmp_path):
    spool = Spool(tmp_path / "spool")
    spool.register_producers(["p0"])
    spool.heartbeat("producer", "p0", {"phase": "produce"})
    for seq in range(5):  # 5 x 64 tokens: past the pool's 256
        publish(spool, make_shard([40, 24], first_index=2 * seq), seq)
    feed = _feed(spool)
    try:
        packed = _first_stream(feed, within_s=10.0)
        assert packed is not None and int((packed.doc_ids >= 0).sum()) == CONTEXT  # full
        feed.commit()
        finish(spool)  # done: what is left goes out at once, the last stream short
        got = []
        deadline = time.monotonic() + 20.0
        while not feed.exhausted():
            assert time.monotonic() < deadline, "the feed did not drain once the producer was done"
            p = feed.next_packed(wait_s=0.05)
            if p is not None:
                got.append(p)
                feed.commit()
        assert got, "the rest of the pool after the producer finished"
    finally:
        feed.close()


def _rank(has: bool, drained: bool = False, epoch: int = 0, tokens: int = 0) -> list[int]:
    view = RankView(
        has_step=has,
        drained=drained,
        stop_asked=False,
        save_failed=False,
        epoch=epoch if has else -1,
        tokens=tokens,
    )
    return view.encode()


def test_a_rank_view_goes_through_the_collective_unchanged():
    view = RankView(has_step=True, drained=False, stop_asked=True, save_failed=False, epoch=2, tokens=4096)
    assert RankView.decode(view.encode()) == view and all(type(v) is int for v in view.encode())


def test_ranks_step_only_when_every_rank_holds_a_step_or_is_drained():
    waiting = StepAgreement.of([_rank(True, tokens=60), _rank(False)], last_epoch=0)
    assert waiting.have and not waiting.everyone  # rank 1 still fills its stream: rank 0 keeps its step
    both = StepAgreement.of([_rank(True, tokens=60), _rank(True, tokens=50)], last_epoch=0)
    assert both.everyone and both.tokens == 110
    drained = StepAgreement.of([_rank(True, tokens=60), _rank(False, drained=True)], last_epoch=0)
    assert drained.everyone and not drained.exhausted and drained.tokens == 60
    done = StepAgreement.of([_rank(False, drained=True), _rank(False, drained=True)], last_epoch=3)
    assert done.exhausted and not done.have and done.epoch == 3


def test_a_rank_that_can_get_no_shard_soon_does_not_hold_the_others():
    """Rank 1 has no step and no producer produces (the one left waits on the spool budget, which rank
    0's held step fills): rank 0 steps, rank 1 pads. Before, rank 0 kept its step for rank 1, rank 1
    waited for a shard, the producer for the budget: a worker killed at start-up hung the launch."""
    starved = RankView(has_step=False, drained=False, stop_asked=False, save_failed=False, starved=True)
    a = StepAgreement.of([_rank(True, tokens=60), starved.encode()], last_epoch=0)
    assert a.everyone and a.have and not a.exhausted and a.tokens == 60
    assert RankView.decode(starved.encode()) == starved


def test_a_step_trains_the_lowest_epoch_only():
    a = StepAgreement.of([_rank(True, epoch=1, tokens=64), _rank(True, epoch=0, tokens=40)], last_epoch=0)
    assert a.epoch == 0 and a.tokens == 40  # rank 0 pads and keeps its epoch-1 step for later


def test_the_trainer_says_starved_when_no_producer_produces_and_then_the_other_rank_steps(monkeypatch):
    """The trainer's own view (``Trainer._agree``) of rank 1 holding nothing: starved while the producers
    left all wait on the budget (rank 0 steps, rank 1 pads), not while one produces (rank 0 waits for
    rank 1's stream). Rank 0's view is gathered with it."""
    from types import SimpleNamespace

    from dflash.consumer import trainer as trainer_module

    rank0 = RankView(has_step=True, drained=False, stop_asked=False, save_failed=False, epoch=0, tokens=60)
    monkeypatch.setattr(trainer_module.D, "gather_ints", lambda mine, dist: [rank0.encode(), mine])

    def rank1(producing: int) -> SimpleNamespace:
        return SimpleNamespace(
            inputs=SimpleNamespace(exhausted=lambda: False),
            _deferred=None,
            stop_requested=False,
            checkpoints=SimpleNamespace(stop_reason=None),
            progress=SimpleNamespace(epoch=0),
            dist=None,
            feed=SimpleNamespace(producers_producing=producing),
        )

    assert trainer_module.Trainer._agree(rank1(producing=0), None).everyone
    assert not trainer_module.Trainer._agree(rank1(producing=1), None).everyone
