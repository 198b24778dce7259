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
    monkeypatch.setattr(
        checkpointer, "with_retries", lambda write, **kw: outage.with_retries(write, pause_s=0, **kw)
    )


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


class _DownS3Client:
    """A boto3 S3 client whose every call fails with S3's 503 SlowDown: a store outage as the S3 store's
    own backoff sees it (transient: each operation is tried ``operation_attempts`` times)."""

    def __init__(self) -> None:
        self.calls = 0

    def __getattr__(self, name: str):
        from botocore.exceptions import ClientError

        def call(*_args, **_kwargs):
            self.calls += 1
            error = {"Error": {"Code": "SlowDown", "Message": "injected"}}
            raise ClientError({**error, "ResponseMetadata": {"HTTPStatusCode": 503}}, name)

        return call


def test_each_failed_save_is_one_line_with_its_retries_counted_in_it(tmp_path, caplog):
    """Four periodic saves into an S3 store that answers every request 503: four lines at WARNING or above,
    each naming its save and summarising the retries under it (before: 32 retry warnings)."""
    import logging

    from dflash.common.checkpoints.s3 import S3Options, S3Store

    state = _state()
    ckpt = _checkpointer(tmp_path, state, outage_saves=5)
    _train(state, ckpt, 2)  # a good checkpoint first: the failures after it are within the bound
    ckpt.save(final=True)
    client = _DownS3Client()
    options = S3Options(operation_attempts=4, backoff_s=0.0, max_backoff_s=0.0)
    ckpt.store = S3Store("down-bucket", "ckpt", options=options, client=client)
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        for _ in range(4):
            _train(state, ckpt, 2)
            _written(ckpt)
            ckpt.poll()
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    lines = [r.getMessage() for r in said]
    assert len(said) == 4, lines
    for step, line in zip((4, 6, 8, 10), lines, strict=True):
        assert line.startswith(f"checkpoint step {step} failed: ") and "\n" not in line, line
        assert "SlowDown" in line and "(tried 2 times; the store retried 6 operations within them)" in line
        assert f"({step // 2 - 1} of --outage-saves 5 failed in a row)" in line
    assert client.calls == 4 * 2 * 4  # every retry happened: 4 saves x 2 attempts x 4 tries of an operation
    assert ckpt.stop_reason is None
