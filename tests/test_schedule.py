"""``LrSchedule``: the learning rate behind one object. The curve itself (``WarmupCosine``) is tested in
test_epochs.py; here, what the trainer reaches through the object: the token count, sizing from the data
(the rate of the current step set at once), the estimate kept right, and the state a checkpoint stores."""

from __future__ import annotations

import pytest
import torch

from dflash.consumer.schedule import LrSchedule

# no optimizer step here: the rates alone are under test
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")


def _schedule(warmup: int = 2, total: int = 100, lr: float = 1.0) -> LrSchedule:
    p = torch.nn.Parameter(torch.zeros(1))
    return LrSchedule(torch.optim.SGD([p], lr=lr), warmup, total)


def test_on_steps_the_rate_warms_up_then_decays():
    s = _schedule(warmup=2, total=10)
    assert s.lr == pytest.approx(0.5)  # step 0 of a 2-step warm-up
    s.step()
    assert s.lr == pytest.approx(1.0)
    for _ in range(9):
        s.step()
    assert s.lr == pytest.approx(0.0) and (s.warmup_steps, s.total_steps) == (2, 10)


def test_sized_from_the_data_the_current_rate_follows_at_once_and_runs_on_tokens():
    s = _schedule(warmup=1, total=10_000)
    s.size_from_data(10, 0.2, planned_tokens=1000, step_tokens=100, step=0)
    assert (s.warmup_steps, s.total_steps) == (2, 10)
    assert s.lr == pytest.approx(0.5)  # the first step's rate of the resized curve, before any step
    rates = []
    for step in range(1, 11):
        s.count_tokens(100)
        s.step()
        s.replan(step)
        rates.append(s.lr)
    assert rates[0] == pytest.approx(1.0) and rates == sorted(rates, reverse=True)
    assert s.total_steps == 10 and rates[-1] > 0  # never 0 before the data ends


def test_a_short_stream_lengthens_the_estimate_only_when_the_data_sized_it():
    sized, given = _schedule(), _schedule()
    sized.size_from_data(10, 0.1, planned_tokens=1000, step_tokens=100, step=0)
    for s in (sized, given):
        s.count_tokens(40)  # a stream packed short
        s.step()
        s.replan(1)
    assert sized.total_steps == 11  # 1 + the 960 tokens left in full steps of 100
    assert given.total_steps == 100  # a length given by flag stays as given


def test_a_resume_from_before_the_token_count_counts_full_streams():
    s = _schedule()
    s.size_from_data(10, 0.1, planned_tokens=1000, step_tokens=100, step=4)
    assert s.curve.tokens_done == 400 and s.total_steps == 4 + 6


def test_the_state_keeps_the_count_and_the_length():
    s = _schedule()
    s.size_from_data(10, 0.1, planned_tokens=1000, step_tokens=100, step=0)
    s.count_tokens(300)
    s.step()
    other = _schedule()
    other.load_state_dict(s.state_dict())
    assert (other.curve.tokens_done, other.total_steps, other.curve.planned_tokens) == (300, 10, 1000)
