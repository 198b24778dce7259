"""dflash-produce end to end on CPU: shards cover the dataset exactly, stop is clean, user errors are one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pipeline_helpers import SemaphoreSpy
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash.common.contract.sample_set import SampleSet
from dflash.common.contract.shard_reader import read_shard
from dflash.common.contract.spool_records import BUDGET_PHASE
from dflash.common.target.capture import LayerCapture
from dflash.common.target.chat import tokenize_conversations
from dflash.producer.cli import main
from dflash.producer.launch import parse_gpus
from dflash.tools.demo.assets import demo_dataset_path, materialize_tiny_target

MAX_LENGTH = 128


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return materialize_tiny_target(tmp_path_factory.mktemp("target") / "tiny")


@pytest.fixture(scope="module")
def demo_rows() -> list[dict]:
    with open(demo_dataset_path(), encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(40), f, strict=False)]


def _env(tmp_path: Path) -> dict:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "hf"),
        "TOKENIZERS_PARALLELISM": "false",
    }


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash.producer.cli", *args]


def _dataset(tmp_path: Path, demo_rows: list[dict]) -> tuple[Path, list[dict], set[int], set[int]]:
    """Demo rows with bad and too-short rows mixed in; returns (path, rows, bad indices, short indices)."""
    rows = [{"messages": r["messages"]} for r in demo_rows[:16]]
    bad = {
        3: {"messages": [{"role": "user", "content": "no answer"}]},
        8: {"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x" * 80}]},
        12: {"messages": "not a list"},
    }
    short = {5: {"messages": [{"role": "user", "content": "Ok?"}, {"role": "assistant", "content": "Yes."}]}}
    for i, r in sorted({**bad, **short}.items()):
        rows.insert(i, r)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows, set(bad), set(short)


def _save_trained(store: Path, run: str, trained: set[int]) -> None:
    from dflash.common.checkpoints.save import capture_rng_state, save_checkpoint

    save_checkpoint(
        str(store),
        run,
        10,
        model_state={"w": torch.zeros(2)},
        optimizer_state={},
        scheduler_state={},
        rng_state=capture_rng_state(),
        trained=SampleSet.from_indices(sorted(trained)),
        config={},
    )


@pytest.mark.slow
def test_two_cpu_workers_cover_dataset_exactly(tmp_path, target, demo_rows):
    data, rows, bad, short = _dataset(tmp_path, demo_rows)
    trained = {1, 10}
    _save_trained(tmp_path / "ckpt", "demo", trained)
    spool, run_dir = tmp_path / "spool", tmp_path / "run"
    res = subprocess.run(
        _cmd(
            "--gpus",
            "cpu:2",
            "--model",
            str(target),
            "--dataset",
            str(data),
            "--spool",
            str(spool),
            "--run",
            "demo",
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--run-dir",
            str(run_dir),
            "--max-length",
            str(MAX_LENGTH),
            "--batch-tokens",
            "512",
            "--cache-dir",
            str(tmp_path / "hf"),
            "--progress-s",
            "1",
        ),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "dflash-produce: done:" in res.stderr

    shards = [read_shard(p) for p in sorted((spool / "ready").iterdir())]
    got = [int(i) for s in shards for i in s.sample_index]
    expected = set(range(len(rows))) - bad - short - trained
    assert len(got) == len(set(got)) and set(got) == expected
    assert {s.meta.producer_id for s in shards} == {"n0p0.1", "n0p1.1"}  # .1: the spool's first launch
    assert all(
        int(i) % 2 == int(s.meta.producer_id.split(".")[0][-1]) for s in shards for i in s.sample_index
    )
    assert not any((spool / "tmp").iterdir())
    state = spool / "state"
    assert (state / "DONE-n0p0.1").exists() and (state / "DONE-n0p1.1").exists()
    counters = [json.loads((state / f"producer-n0p{p}.1.json").read_text())["counters"] for p in (0, 1)]
    assert sum(c["skipped"] for c in counters) == len(trained)
    assert sum(c["bad"] for c in counters) == len(bad) and sum(c["short"] for c in counters) == len(short)
    assert sum(c["dropped"] for c in counters) == len(bad) + len(short)
    assert sum(c["samples"] for c in counters) == len(expected)
    for p in (0, 1):
        lines = (run_dir / "metrics" / f"producer-n0p{p}.1.jsonl").read_text().splitlines()
        assert json.loads(lines[-1])["done"] is True

    # Tokens, loss mask and hidden states of one shard are those of the target on each sample alone.
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    cap = LayerCapture(model, shards[0].meta.layer_ids)
    assert shards[0].meta.layer_ids == [1, 2, 3, 4, 5] and shards[0].meta.hidden_size == 256
    for shard in shards[:2]:
        cu = shard.cu_seqlens.tolist()
        for n, idx in enumerate(shard.sample_index.tolist()):
            [(ids, mask)] = tokenize_conversations(tok, [rows[idx]["messages"]])[0]
            a, b = cu[n], cu[n + 1]
            assert shard.input_ids[a:b].tolist() == ids[:MAX_LENGTH]
            assert shard.loss_mask[a:b].tolist() == mask[:MAX_LENGTH]
            with torch.inference_mode():
                ref = cap.run(torch.tensor([ids[:MAX_LENGTH]]))
            # the default codec is FP8: within its rounding (2^-4 of a value) of the target's states
            assert shard.fp8
            torch.testing.assert_close(
                shard.restored_hidden()[a:b].float(), ref.bfloat16().float(), rtol=0.1, atol=0.05
            )


@pytest.mark.slow
def test_sigterm_under_backpressure_stops_cleanly(tmp_path, target, demo_rows):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in demo_rows[:24]))
    spool = tmp_path / "spool"
    sems = SemaphoreSpy(tmp_path)
    proc = subprocess.Popen(
        _cmd(
            "--gpus",
            "cpu:1",
            "--model",
            str(target),
            "--dataset",
            str(data),
            "--spool",
            str(spool),
            "--max-length",
            str(MAX_LENGTH),
            "--batch-tokens",
            "256",
            "--budget-gb",
            "1e-6",
            "--cache-dir",
            str(tmp_path / "hf"),
        ),
        env={**_env(tmp_path), **sems.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        hb = spool / "state" / "producer-n0p0.1.json"
        while time.monotonic() < deadline:
            # The spool is over budget after the first shard: the writer blocks, the forward loop waits.
            if hb.exists() and json.loads(hb.read_text())["counters"].get("phase") == BUDGET_PHASE:
                break
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.2)
        else:
            pytest.fail("producer never blocked on the spool budget")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "stopped before the end" in err
    assert len(list((spool / "ready").iterdir())) == 1
    assert not any((spool / "tmp").iterdir())
    assert not (spool / "state" / "DONE-n0p0.1").exists()
    counters = json.loads((spool / "state" / "producer-n0p0.1.json").read_text())["counters"]
    assert counters["phase"] == "stopped" and counters["done"] is False
    # Not one named POSIX semaphore (mp.Queue/Event/Lock of a spawn context) in the producer or its worker:
    # each is a file in /dev/shm that outlives a launch killed with its process group (13 per launch
    # leaked before the supervisor talked to its workers over pipes).
    assert sems.anonymous() >= 1, "the spy saw no lock at all: did it load?"
    assert sems.named() == [], sems.named()[0][-3000:]


def test_parse_gpus():
    assert parse_gpus("0-3") == [("cuda", i) for i in range(4)]
    assert parse_gpus("0,2") == [("cuda", 0), ("cuda", 2)]
    assert parse_gpus("cpu:2") == [("cpu", None)] * 2


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("missing_dataset", r"dataset path .*nope\.jsonl does not exist"),
        ("bad_gpus", r"--gpus 'zero'"),
        ("columns", r"no 'messages' or 'conversations' column \(columns: prompt\)"),
        ("no_template", r"has no chat template"),
        ("layer_ids", r"--layer-ids \[1, 8\]: outside 0..7 \(the target has 8 layers\)"),
        (
            "layer_ids_repeated",
            r"--layer-ids \[3, 1, 1\]: layer ids must be sorted and distinct, e.g. \[1, 3\]",
        ),
        ("missing_model", r"cannot load target"),
        ("writer_threads", r"ProducerConfig.writer_threads=0: must be >= 1"),
        (
            "max_length",
            r"--max-length 10: below the 32 supervised tokens a sample needs \(2 x --block-size\): "
            "every row would be dropped",
        ),
    ],
)
def test_user_errors_are_one_line(tmp_path, target, demo_rows, capsys, case, pattern):
    import re
    import shutil

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": demo_rows[0]["messages"]}) + "\n")
    model = str(target)
    extra: list[str] = []
    if case == "missing_dataset":
        data = tmp_path / "nope.jsonl"
    elif case == "columns":
        data.write_text(json.dumps({"prompt": "x"}) + "\n")
    elif case == "no_template":
        model = str(tmp_path / "notemplate")
        shutil.copytree(target, model)
        os.remove(Path(model) / "chat_template.jinja")
    elif case == "layer_ids":
        extra = ["--layer-ids", "1,8"]
    elif case == "layer_ids_repeated":
        extra = ["--layer-ids", "3,1,1"]
    elif case == "missing_model":
        model = str(tmp_path / "no-model")
    elif case == "writer_threads":  # 0 is a bad value, not "the default"
        extra = ["--writer-threads", "0"]
    elif case == "max_length":  # no row can keep 2 x --block-size supervised tokens: refused up front
        extra = ["--max-length", "10"]
    gpus = "zero" if case == "bad_gpus" else "cpu:1"
    argv = [
        "--gpus",
        gpus,
        "--model",
        model,
        "--dataset",
        str(data),
        "--spool",
        str(tmp_path / "spool"),
        "--cache-dir",
        str(tmp_path / "hf"),
        *extra,
    ]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash-produce")]
    assert len(err) == 1 and re.search(pattern, err[0]), err
    assert err[0].startswith("dflash-produce: error: ")
    assert not (tmp_path / "spool").exists()  # refused before any side effect: no spool folder left


@pytest.mark.parametrize("before", ["none", "existing", "consumer"])
def test_a_launch_refused_after_tokenizing_removes_only_the_spool_it_made(
    tmp_path, target, demo_rows, capsys, monkeypatch, before
):
    """A launch refused as a user error once its workers tokenized (every row dropped: supervise's exit 2,
    stood in for here, so no worker starts) removes the spool it made, which would keep the refused plan and
    refuse the corrected command as another plan. A spool that was there before, or that a consumer
    heartbeats in, is left alone."""
    import dflash.producer.supervisor as supervisor

    monkeypatch.setattr(supervisor, "supervise", lambda prepared, launch: 2)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": demo_rows[0]["messages"]}) + "\n")
    spool = tmp_path / "spool"
    if before != "none":
        spool.mkdir()
    if before == "consumer":
        (spool / "state").mkdir()
        (spool / "state" / "consumer-r0-1.json").write_text("{}")
    argv = ["--gpus", "cpu:1", "--model", str(target), "--dataset", str(data), "--spool", str(spool)]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--cache-dir", str(tmp_path / "hf")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    if before == "none":
        assert (
            not spool.exists() and f"removed the spool {spool} this launch made (nothing was produced)" in err
        )
    else:
        assert (spool / "state" / "run.json").exists() and "removed the spool" not in err
