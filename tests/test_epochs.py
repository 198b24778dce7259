"""Epochs: sample ids per (epoch, row), per-epoch orders from the seed, the producer's plan, the campaign's
step count and the schedule sized from it."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from dflash.common.contract.epochs import Campaign, Epochs
from dflash.common.contract.sample_set import SampleSet
from dflash.common.target.data import slice_indices
from dflash.common.target.drops import campaign_counts
from dflash.consumer.schedule import WarmupCosine
from dflash.producer.slice_plan import plan_epochs


def test_ids_name_each_epoch_apart_and_map_back():
    e = Epochs(rows=10, epochs=3, seed=7)
    rows = np.array([0, 4, 9])
    for k in range(3):
        ids = e.ids(k, rows)
        assert (e.epoch_of(ids) == k).all() and (e.row_of(ids) == rows).all()
    assert e.ids(0, rows).tolist() == rows.tolist()  # one epoch: id == row
    with pytest.raises(ValueError):
        e.ids(3, rows)
    with pytest.raises(ValueError):
        Epochs(rows=10, epochs=0)


def test_epoch_orders_differ_and_are_reproducible_from_the_seed():
    a, b = Epochs(rows=50, epochs=3, seed=1), Epochs(rows=50, epochs=3, seed=1)
    orders = [a.order(k) for k in range(3)]
    assert all(sorted(o.tolist()) == list(range(50)) for o in orders)
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    assert all(np.array_equal(a.order(k), b.order(k)) for k in range(3))
    assert not np.array_equal(a.order(0), Epochs(rows=50, epochs=3, seed=2).order(0))


def _tok_ds(rows: np.ndarray, bad: set[int]) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {
            "sample_index": rows.tolist(),
            "input_ids": [[1] * (10 + int(r)) if r not in bad else [] for r in rows],
            "loss_mask": [[True] * (10 + int(r)) if r not in bad else [] for r in rows],
            "num_loss_tokens": [10 + int(r) if r not in bad else 0 for r in rows],
            "status": ["ok" if r not in bad else "bad:no assistant turn" for r in rows],
        }
    )


def test_producers_cover_every_epoch_exactly_once_in_its_order_and_skip_what_was_trained():
    epochs, world, bad = Epochs(rows=23, epochs=2, seed=3), 3, {5, 11}
    produced: list[int] = []
    for rank in range(world):
        mine = slice_indices(epochs.rows, rank=rank, world=world)
        positions, ids, counts = plan_epochs(_tok_ds(mine, bad), mine, epochs, None)
        assert (mine[positions] == epochs.row_of(ids)).all()  # position and id name the same row
        per_epoch = [epochs.row_of(ids[epochs.epoch_of(ids) == k]).tolist() for k in range(2)]
        for k in range(2):  # this producer walks its rows in the epoch's global order
            rank_in_order = {int(r): i for i, r in enumerate(epochs.order(k))}
            assert per_epoch[k] == sorted(per_epoch[k], key=rank_in_order.__getitem__)
        assert counts["dropped"] == len(bad & set(mine.tolist())) and counts["skipped"] == 0
        produced += ids.tolist()
    eligible = [r for r in range(23) if r not in bad]
    assert sorted(produced) == sorted(eligible + [23 + r for r in eligible])  # once per epoch
    # resume mid-epoch 2: the checkpoint trained epoch 0 and part of epoch 1
    trained = SampleSet.from_indices(eligible + [23 + r for r in eligible[:7]])
    left = []
    for rank in range(world):
        mine = slice_indices(epochs.rows, rank=rank, world=world)
        _, ids, counts = plan_epochs(_tok_ds(mine, bad), mine, epochs, trained)
        left += ids.tolist()
    assert sorted(left) == [23 + r for r in eligible[7:]]


def test_campaign_counts_and_steps():
    rows = np.arange(6)
    c = campaign_counts(_tok_ds(rows, {2}))
    assert c == {"samples": 5, "tokens": sum(10 + r for r in (0, 1, 3, 4, 5)), "loss_tokens": c["tokens"]}
    camp = Campaign.from_states([{**c}, {**c}], epochs=3)
    assert (camp.samples, camp.tokens) == (10, 2 * c["tokens"])
    per_epoch = -(-camp.tokens // (16 * 2))
    assert camp.steps_per_epoch(16, 2) == per_epoch and camp.total_steps(16, 2) == -(-3 * camp.tokens // 32)


def test_schedule_resizes_and_survives_the_scheduler_state():
    import torch

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(1, 10_000))
    sched.lr_lambdas[0].resize(100, 0.04)
    assert (sched.lr_lambdas[0].warmup_steps, sched.lr_lambdas[0].total_steps) == (4, 100)
    state = sched.state_dict()
    other = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([p], lr=1.0), WarmupCosine(1, 10_000))
    other.load_state_dict(state)
    assert other.lr_lambdas[0].total_steps == 100
    f = WarmupCosine(4, 100)
    assert f(0) == 0.25 and f(3) == 1.0 and f(100) == pytest.approx(0.0) and 0 < f(50) < 1


def test_a_short_stream_lengthens_the_schedule_so_the_decay_ends_with_the_data():
    import torch

    f = WarmupCosine(1, 10)  # the plan: 1000 tokens in full streams of 100 = 10 steps
    f.resize(10, 0.1)
    for step in range(1, 4):  # three full streams
        f.tokens_done += 100
        f.replan(step, 1000, 100)
    assert f.total_steps == 10
    f.tokens_done += 40  # a stream packed short: 60 tokens of data still to come -> one more step
    f.replan(4, 1000, 100)
    assert (f.total_steps, f.warmup_steps) == (11, 1)
    for step in range(5, 12):  # the rest in full streams, the last one short
        f.tokens_done += min(100, 1000 - f.tokens_done)
        f.replan(step, 1000, 100)
    assert f.tokens_done == 1000 and f.total_steps == 11  # the decay reached 0 at the last step, not before
    assert f(10) > 0 and f(11) == pytest.approx(0.0)
    # the count survives a checkpoint (LambdaLR keeps the callable's attributes)
    p = torch.nn.Parameter(torch.zeros(1))
    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([p], lr=1.0), f)
    other = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([p], lr=1.0), WarmupCosine(1, 10))
    other.load_state_dict(sched.state_dict())
    assert (other.lr_lambdas[0].tokens_done, other.lr_lambdas[0].total_steps) == (1000, 11)


def test_the_token_clock_keeps_one_curve_across_world_sizes_and_never_reaches_0_early():
    """Sized from the data, the curve runs on tokens: the same tokens trained give the same rate whatever
    the step size, a resume in another world size moves it by one step's change, the warm-up keeps its
    tokens, and the plan's last step is not at 0 even when the data gives more than counted."""
    import torch

    def fresh(step_tokens: int) -> WarmupCosine:
        f = WarmupCosine(1, 10_000)
        f.resize(-(-10_000 // step_tokens), 0.1)
        f.follow_tokens(10_000, step_tokens)
        return f

    two, one = fresh(200), fresh(100)  # 2 ranks x 100 tokens, 1 rank x 100 tokens
    assert (two.warmup_tokens, two.warmup_steps, one.warmup_tokens) == (1000, 5, 1000)
    for done in (0, 400, 1000, 5000, 9800):
        two.tokens_done = one.tokens_done = done
        if done >= 1000:  # past the warm-up the rate is a function of the tokens alone
            assert two(0) == pytest.approx(one(0))
    # train 3000 tokens on 2 ranks, checkpoint, resume on 1 rank: the rate goes on from where it was
    f = fresh(200)
    rates = []
    for _ in range(15):
        rates.append(f(0))
        f.tokens_done += 200
    p = torch.nn.Parameter(torch.zeros(1))
    state = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([p], lr=1.0), f).state_dict()
    g = WarmupCosine(1, 10_000)
    torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([p], lr=1.0), g).load_state_dict(state)
    g.resize(100, 0.1)  # the 1-rank plan would warm up over 10 steps of 100: the tokens stay 1000
    g.follow_tokens(10_000, 100)
    assert g.warmup_tokens == 1000
    assert g(0) == pytest.approx(f(0))  # the rate the 2-rank run would have trained its next step at
    assert (
        abs(g(0) - rates[-1]) <= 1.2 * abs(rates[-1] - rates[-2]) and g(0) <= rates[-1]
    )  # one step's change
    # the last planned step trains above 0, and more data than counted never drives the rate to 0
    g.tokens_done = 9_900
    assert g(0) > 0
    last_step = g(0)
    g.tokens_done = 12_000
    assert g(0) == pytest.approx(last_step) and g(0) > 0
