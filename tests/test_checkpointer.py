"""The consumer's ``Checkpointer`` in-process, on a small model and a local store: it saves on its cadence,
says each save's outcome, resumes the state it was handed, and stops within the outage bound with the
state on local disk (the multi-process versions are test_async_checkpoint.py and test_store_outage.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import wait_until
from ledger_audit import read_jsonl

from dflash.common.contract.sample_set import SampleSet
from dflash.common.metrics import MetricsLog
from dflash.consumer.checkpointing import checkpointer, outage
from dflash.consumer.checkpointing.checkpointer import Checkpointer, StoreOutageError
from dflash.consumer.checkpointing.state import TrainProgress, TrainState
from dflash.consumer.config import CheckpointConfig
from dflash.consumer.distributed import DistInfo
from dflash.consumer.schedule import LrSchedule

ONE_RANK = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    drafter = SimpleNamespace(
        layer_types=["full_attention"],
        sliding_window=None,
        num_layers=1,
        to_dict=lambda: {"layer_types": ["full_attention"]},
    )
    return TrainState(model, optimizer, LrSchedule(optimizer, 2, 10), drafter, TrainProgress())


def _cfg(tmp_path, **overrides) -> CheckpointConfig:
    return CheckpointConfig(store=str(tmp_path / "store"), save_every=2, **overrides)


def _checkpointer(tmp_path, state: TrainState, **overrides) -> Checkpointer:
    metrics = MetricsLog(tmp_path / "run" / "metrics.jsonl")
    return Checkpointer(
        _cfg(tmp_path, **overrides),
        state,
        run="r",
        run_dir=str(tmp_path / "run"),
        dist=ONE_RANK,
        device=torch.device("cpu"),
        metrics=metrics,
    )


def _train(state: TrainState, ckpt: Checkpointer, steps: int) -> None:
    """Steps of the trainer's shape: a step, its samples into the trained set, a save when due."""
    for _ in range(steps):
        state.model(torch.randn(2, 4)).sum().backward()
        state.optimizer.step()
        state.schedule.count_tokens(64)
        state.schedule.step()
        state.progress.step += 1
        state.progress.trained.add([state.progress.step])
        ckpt.save_if_due()


def _events(tmp_path) -> list[tuple[str, int]]:
    return [(r["event"], r["step"]) for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]


@pytest.fixture(autouse=True)
def _no_retry_pause(monkeypatch):
    monkeypatch.setattr(checkpointer, "with_retries", lambda write: outage.with_retries(write, pause_s=0))


def test_saves_on_its_cadence_and_a_fresh_state_resumes_from_the_last(tmp_path):
    state = _state()
    ckpt = _checkpointer(tmp_path, state)
    ckpt.resume()  # an empty store: starts fresh
    _train(state, ckpt, 5)
    ckpt.save(final=True)
    assert _events(tmp_path) == [("checkpoint", 2), ("checkpoint", 4), ("checkpoint", 5)]
    assert ckpt.last_save_stall_s is not None and ckpt.stop_reason is None

    fresh = _state(seed=1)
    _checkpointer(tmp_path, fresh).resume()
    assert fresh.progress.step == 5 and len(fresh.progress.trained) == 5
    assert torch.equal(fresh.model.weight, state.model.weight)
    assert fresh.schedule.curve.tokens_done == 5 * 64  # the schedule's count came back with its state


def test_the_final_save_of_a_step_just_saved_only_waits(tmp_path):
    state = _state()
    ckpt = _checkpointer(tmp_path, state)
    _train(state, ckpt, 4)
    ckpt.save(final=True)
    assert _events(tmp_path) == [("checkpoint", 2), ("checkpoint", 4)]


def test_without_a_store_every_call_is_a_no_op(tmp_path):
    state = _state()
    ckpt = Checkpointer(
        CheckpointConfig(), state, run="default", dist=ONE_RANK, device=torch.device("cpu"), metrics=None
    )
    ckpt.resume()
    _train(state, ckpt, 3)
    ckpt.save(final=True)
    assert not ckpt.enabled and ckpt.last_save_stall_s is None and ckpt.stop_reason is None


def _written(ckpt: Checkpointer) -> None:
    """The background write has ended (its outcome not yet said)."""
    wait_until(lambda: not ckpt.writer.busy(), what="the background write")


def _refusing_store(monkeypatch) -> None:
    """The store refuses every write; the local fallback folder takes them."""
    real = checkpointer.save_checkpoint

    def refuse(store, *args, **kwargs):
        if store.root.name == "store":
            raise OSError("bucket gone")
        return real(store, *args, **kwargs)

    monkeypatch.setattr(checkpointer, "save_checkpoint", refuse)


def test_a_failed_save_before_any_checkpoint_stops_training(tmp_path, monkeypatch):
    state = _state()
    ckpt = _checkpointer(tmp_path, state)
    _refusing_store(monkeypatch)
    _train(state, ckpt, 2)
    _written(ckpt)
    ckpt.poll()
    assert "no checkpoint of run 'r' exists yet" in ckpt.stop_reason


def test_an_outage_past_its_bound_stops_with_the_state_on_local_disk_and_resumes_from_it(
    tmp_path, monkeypatch
):
    state = _state()
    ckpt = _checkpointer(tmp_path, state, outage_saves=2)
    _train(state, ckpt, 2)  # a good checkpoint first: failures after it are within the bound
    ckpt.save(final=True)
    with monkeypatch.context() as patch:
        _refusing_store(patch)
        for _ in range(2):
            _train(state, ckpt, 2)
            _written(ckpt)
            ckpt.poll()
        assert "2 checkpoint saves in a row failed (--outage-saves 2)" in ckpt.stop_reason
        assert [e for e in _events(tmp_path) if e[0] == "checkpoint_failed"] == [
            ("checkpoint_failed", 4),
            ("checkpoint_failed", 6),
        ]
        with pytest.raises(StoreOutageError, match="stopped at step 6, its state saved in"):
            ckpt.stop_to_fallback(ckpt.stop_reason)
    assert (tmp_path / "run" / "fallback-checkpoint" / "r").is_dir()

    fresh = _state(seed=1)
    _checkpointer(tmp_path, fresh).resume()  # the local state goes to the store first, then loads from it
    assert fresh.progress.step == 6 and torch.equal(fresh.model.weight, state.model.weight)
    assert not (tmp_path / "run" / "fallback-checkpoint" / "r").exists()
    assert isinstance(fresh.progress.trained, SampleSet) and len(fresh.progress.trained) == 6
