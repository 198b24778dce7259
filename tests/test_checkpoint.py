"""dflash.common.checkpoints.save against a local dir and moto's real S3 endpoint: bit-exact round trips and
resumes, atomic `latest`, keep-last-k, corruption fallbacks, retries and credential redaction."""

from __future__ import annotations

import io
import json
import logging
import os
import random
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from dflash.common.checkpoints import store as checkpoint_store
from dflash.common.checkpoints.layout import (
    DATA_FILES,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    step_dir_name,
)
from dflash.common.checkpoints.load import (
    list_steps,
    load_checkpoint,
    load_latest_good,
    read_trained_set,
    restore_rng_state,
)
from dflash.common.checkpoints.s3 import S3Options
from dflash.common.checkpoints.save import capture_rng_state, save_checkpoint
from dflash.common.checkpoints.store import CheckpointStoreError, open_store
from dflash.common.contract.sample_set import SampleSet

RUN = "run1"
FAST = S3Options(max_attempts=3, backoff_s=0.01, max_backoff_s=0.05)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.pipeline)])  # moto: a process
def store(request, tmp_path):
    if request.param == "local":
        return open_store(tmp_path / "ckpt")
    return open_store(request.getfixturevalue("s3_server"), s3_options=FAST)


def make_training(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    return model, opt, sched


def train_steps(model, opt, sched, num_steps: int) -> None:
    """Uses torch, numpy and python RNGs, so a resume is bit-exact only if all of them are restored."""
    for _ in range(num_steps):
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        scale = 1.0 + 0.1 * float(np.random.rand()) + 0.1 * random.random()
        loss = (model(x) * scale - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def save(store, step, model, opt, sched, *, trained=None, config=None, keep_last=3):
    trained = trained if trained is not None else SampleSet.from_indices(range(step), epoch=0)
    return save_checkpoint(
        store,
        RUN,
        step,
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        scheduler_state=sched.state_dict(),
        rng_state=capture_rng_state(),
        trained=trained,
        config=config if config is not None else {"lr": 1e-2, "layers": [1, 2]},
        keep_last=keep_last,
    )


def assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture
def fail_nth_upload(s3_faults, monkeypatch):
    """Make the n-th file upload from now on fail inside the store: S3 through botocore's before-send
    hook, local through the file copy the store makes."""

    def inject(store, n, exc=None):
        exc = exc or RuntimeError("injected upload failure")
        if hasattr(store, "client"):
            return s3_faults(store.client, lambda i, op: exc if i == n else None, operation="PutObject")
        calls = {"n": 0}
        real_copy = shutil.copyfile

        def copyfile(src, dst):
            calls["n"] += 1
            if calls["n"] == n:
                raise OSError(5, str(exc))
            return real_copy(src, dst)

        monkeypatch.setattr(checkpoint_store.shutil, "copyfile", copyfile)
        return calls

    return inject


def test_roundtrip_is_bit_exact(store):
    model, opt, sched = make_training()
    train_steps(model, opt, sched, 3)
    trained = SampleSet.from_indices([0, 5, 99, 123_456], epoch=2)
    rng = capture_rng_state()
    url = save_checkpoint(
        store,
        RUN,
        3,
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        scheduler_state=sched.state_dict(),
        rng_state=rng,
        trained=trained,
        config={"lr": 0.01, "nested": {"k": [1, 2]}},
    )
    assert url == store.url_for(f"{RUN}/step-00000003")
    assert store.get_bytes(f"{RUN}/latest").decode().strip() == "step-00000003"
    assert store.list(f"{RUN}/step-00000003/") == sorted(
        f"{RUN}/step-00000003/{f}" for f in (*DATA_FILES, "meta.json")
    )

    ck = load_checkpoint(store, RUN)
    assert (ck.step, ck.epoch, ck.url) == (3, 2, url)
    assert_same(model.state_dict(), ck.model_state, "model")
    assert_same(opt.state_dict(), ck.optimizer_state, "optimizer")
    assert_same(sched.state_dict(), ck.scheduler_state, "scheduler")
    assert_same(rng, ck.rng_state, "rng")
    assert ck.trained == trained
    assert ck.config == {"lr": 0.01, "nested": {"k": [1, 2]}}
    meta = ck.meta
    assert meta["step"] == 3 and meta["num_trained_samples"] == 4 and set(meta["files"]) == set(DATA_FILES)
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in meta["files"].values())
    for fname in ("optimizer.pt", "scheduler.pt", "rng.pt"):  # weights_only-loadable on their own
        raw = store.get_bytes(f"{RUN}/step-00000003/{fname}")
        torch.load(io.BytesIO(raw), weights_only=True)


def test_resume_continues_bit_exactly(store):
    model, opt, sched = make_training(seed=0)
    train_steps(model, opt, sched, 3)
    save(store, 3, model, opt, sched)
    train_steps(model, opt, sched, 4)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    # a fresh process: different init, different RNG streams
    model2, opt2, sched2 = make_training(seed=123)
    random.seed(7)
    np.random.seed(7)
    ck = load_latest_good(store, RUN)
    model2.load_state_dict(ck.model_state)
    opt2.load_state_dict(ck.optimizer_state)
    sched2.load_state_dict(ck.scheduler_state)
    restore_rng_state(ck.rng_state)
    train_steps(model2, opt2, sched2, 4)
    assert_same(expected, model2.state_dict(), "resumed model")


def test_rng_capture_restore():
    state = capture_rng_state()
    first = (random.random(), float(np.random.rand()), np.random.randn(), torch.rand(3))
    restore_rng_state(state)
    again = (random.random(), float(np.random.rand()), np.random.randn(), torch.rand(3))
    assert first[:3] == again[:3] and torch.equal(first[3], again[3])


def test_failed_upload_never_becomes_latest(store, fail_nth_upload):
    model, opt, sched = make_training()
    save(store, 1, model, opt, sched)
    train_steps(model, opt, sched, 2)
    fail_nth_upload(store, 3)  # the 3rd file of the next checkpoint (scheduler.pt)
    with pytest.raises(CheckpointStoreError, match="injected upload failure"):
        save(store, 2, model, opt, sched)
    assert store.get_bytes(f"{RUN}/latest").decode().strip() == "step-00000001"
    assert list_steps(store, RUN) == [1, 2]  # the unfinished dir exists, but is nobody's latest
    assert load_checkpoint(store, RUN).step == 1
    assert load_latest_good(store, RUN).step == 1
    assert read_trained_set(store, RUN) == SampleSet.from_indices(range(1))

    # the retry of that step (the injected failure is spent) clears the leftovers and succeeds
    save(store, 2, model, opt, sched)
    assert load_checkpoint(store, RUN).step == 2 and list_steps(store, RUN) == [1, 2]


def test_keep_last_k_and_abandoned_steps(store):
    model, opt, sched = make_training()
    for step in (10, 20, 30, 40, 50):
        save(store, step, model, opt, sched, keep_last=2)
    assert list_steps(store, RUN) == [40, 50]
    assert load_checkpoint(store, RUN).step == 50
    assert load_checkpoint(store, RUN, step=40).step == 40
    with pytest.raises(CheckpointNotFoundError, match="step-00000010"):
        load_checkpoint(store, RUN, step=10)
    # resuming from 40 abandons 50: the next save removes it so that no fallback can land on it
    save(store, 45, model, opt, sched, keep_last=2)
    assert list_steps(store, RUN) == [40, 45]
    assert load_checkpoint(store, RUN).step == 45
    # an unfinished dir (failed upload) does not count towards k and is cleaned up
    store.put_bytes(f"{RUN}/step-00000047/model.safetensors", b"half")
    save(store, 48, model, opt, sched, keep_last=2)
    assert list_steps(store, RUN) == [45, 48]


def test_corrupt_file_falls_back_to_previous(store, caplog):
    model, opt, sched = make_training()
    save(store, 1, model, opt, sched)
    train_steps(model, opt, sched, 1)
    save(store, 2, model, opt, sched)
    key = f"{RUN}/step-00000002/optimizer.pt"
    data = bytearray(store.get_bytes(key))
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    store.put_bytes(key, bytes(data))

    with pytest.raises(CheckpointCorruptError, match="optimizer.pt: sha256") as info:
        load_checkpoint(store, RUN)
    assert "\n" not in str(info.value)
    with caplog.at_level(logging.ERROR, logger="dflash.common.checkpoints.load"):
        ck = load_latest_good(store, RUN)
    assert ck.step == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "optimizer.pt" in errors[0] and "falling back to step-00000001" in errors[0]
    # producers: a same-size corruption of another file needs the full check to see the consumer's choice
    assert read_trained_set(store, RUN, full_verify=True) == SampleSet.from_indices(range(1))
    assert read_trained_set(store, RUN) == SampleSet.from_indices(range(2))


def test_missing_or_truncated_files_are_corrupt(store):
    model, opt, sched = make_training()
    save(store, 1, model, opt, sched)
    save(store, 2, model, opt, sched)
    save(store, 3, model, opt, sched)
    store.delete_prefix(f"{RUN}/step-00000003/model.safetensors")
    with pytest.raises(CheckpointCorruptError, match="model.safetensors is missing"):
        load_checkpoint(store, RUN)
    key = f"{RUN}/step-00000002/trained.bin"
    store.put_bytes(key, store.get_bytes(key)[:-1])
    with pytest.raises(CheckpointCorruptError, match="trained.bin: .* bytes, meta.json says"):
        load_checkpoint(store, RUN, step=2)
    assert load_latest_good(store, RUN).step == 1
    assert read_trained_set(store, RUN) == SampleSet.from_indices(range(1))  # same fallback as the consumer

    store.delete_prefix(f"{RUN}/step-00000001/meta.json")
    with pytest.raises(CheckpointCorruptError, match="no usable checkpoint"):
        load_latest_good(store, RUN)


def test_garbage_latest_falls_back_to_newest_good_dir(store):
    model, opt, sched = make_training()
    save(store, 1, model, opt, sched)
    save(store, 2, model, opt, sched)
    store.put_bytes(f"{RUN}/latest", b"\x00garbage")
    with pytest.raises(CheckpointCorruptError, match="does not name a step dir"):
        load_checkpoint(store, RUN)
    assert load_latest_good(store, RUN).step == 2


def test_empty_run_and_unfinished_only(store, caplog):
    assert load_checkpoint(store, RUN) is None
    assert load_latest_good(store, RUN) is None
    assert read_trained_set(store, RUN) is None
    assert list_steps(store, RUN) == []
    store.put_bytes(f"{RUN}/step-00000005/model.safetensors", b"half an upload")
    with caplog.at_level(logging.WARNING, logger="dflash.common.checkpoints.load"):
        assert load_latest_good(store, RUN) is None
    assert any("only unfinished checkpoints" in r.getMessage() for r in caplog.records)


def test_save_rejects_state_torch_load_would_refuse(store):
    model, opt, sched = make_training()
    train_steps(model, opt, sched, 1)
    bad = opt.state_dict()
    bad["state"][0]["extra"] = np.zeros(3)  # an array: torch.load(weights_only=True) would refuse it
    with pytest.raises(ValueError, match=r"optimizer_state\['state'\]\[0\]\['extra'\].*numpy"):
        save_checkpoint(
            store,
            RUN,
            1,
            model_state=model.state_dict(),
            optimizer_state=bad,
            scheduler_state=sched.state_dict(),
            rng_state={},
            trained=SampleSet(),
            config={},
        )
    assert store.list("") == []  # nothing written
    with pytest.raises(ValueError, match="run name"):
        load_checkpoint(store, "a/b")


def test_numpy_scalars_are_stored_as_python_numbers(store):
    model, opt, sched = make_training()
    sched_state = sched.state_dict() | {"np_scale": np.float64(0.5), "np_steps": [np.int64(3)]}
    save_checkpoint(
        store,
        RUN,
        1,
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        scheduler_state=sched_state,
        rng_state=capture_rng_state(),
        trained=SampleSet(),
        config={},
    )
    loaded = load_checkpoint(store, RUN).scheduler_state
    assert loaded["np_scale"] == 0.5 and type(loaded["np_scale"]) is float
    assert loaded["np_steps"] == [3] and type(loaded["np_steps"][0]) is int


def test_meta_and_logs_hold_no_credentials(store, fail_nth_upload, caplog):
    key_id = os.environ.get("AWS_ACCESS_KEY_ID", "AKIAFAKE0TEST0KEY001")
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "fAkE/sEcReT+Key0123456789abcdefGHIJKLMNQ")
    config = {
        "checkpoint_dir": store.url,
        "aws_access_key_id": key_id,
        "aws_secret_access_key": secret,
        "endpoint": f"http://{key_id}:{secret}@minio:9000",
        "note": f"started with AWS_SECRET_ACCESS_KEY={secret}",
        "tokenizer": "Qwen/Qwen3-8B",
    }
    model, opt, sched = make_training()
    with caplog.at_level(logging.DEBUG, logger="dflash"):
        save(store, 1, model, opt, sched, config=config)
        meta_raw = store.get_bytes(f"{RUN}/step-00000001/meta.json").decode()
        # a failure whose message carries the credentials and the endpoint
        fail_nth_upload(store, 1, RuntimeError(f"PUT http://{key_id}:{secret}@minio:9000 failed"))
        with pytest.raises(CheckpointStoreError) as info:
            save(store, 2, model, opt, sched, config=config)
    assert secret not in meta_raw and key_id not in meta_raw
    saved = json.loads(meta_raw)["config"]
    assert saved["tokenizer"] == "Qwen/Qwen3-8B" and saved["checkpoint_dir"] == store.url
    assert saved["aws_secret_access_key"] == "***" and "minio:9000" in saved["endpoint"]
    for text in [str(info.value)] + [r.getMessage() for r in caplog.records]:
        assert secret not in text and key_id not in text, text


def test_s3_save_and_load_survive_transient_errors(s3_server, s3_faults):
    store = open_store(s3_server, s3_options=FAST)
    counts = s3_faults(store.client, lambda n, op: 500 if n % 3 == 2 else None)
    model, opt, sched = make_training()
    save(store, 1, model, opt, sched)
    save(store, 2, model, opt, sched, keep_last=1)
    ck = load_latest_good(store, RUN)
    assert ck.step == 2 and list_steps(store, RUN) == [2]
    assert_same(model.state_dict(), ck.model_state)
    assert read_trained_set(s3_server, RUN) == SampleSet.from_indices(range(2))  # producers pass the url
    assert counts["PutObject"] >= 14 + 4 and counts["GetObject"] >= 2


def test_step_dir_names_sort_by_step(store):
    names = [step_dir_name(s) for s in (1, 20, 300, 99_999_999)]
    assert names == sorted(names) and names[0] == "step-00000001"
    model, opt, sched = make_training()
    for step in (9, 100_000_000):  # past 8 digits the names grow; steps still compare as numbers
        save(store, step, model, opt, sched, trained=SampleSet.from_indices([step]))
    assert list_steps(store, RUN) == [9, 100_000_000]
    assert load_latest_good(store, RUN).step == 100_000_000
