"""One error convention for every CLI (README "Errors and exit codes"): a user or input error is
one line ``<prog>: error: ...`` and exit status 2, never a traceback. Here: dflash-produce and
dflash-consume on the errors users actually hit (a GPU that does not exist, no S3 credentials, an
unreachable endpoint, no usable checkpoint, a spool of another run or in use), and the consumer's
"waiting for producers" line on an empty spool.

The subprocess cases run concurrently (one fixture starts them all), so the slowest case (the S3 retries
against a closed port) bounds the time, not their sum.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

import pytest
from pipeline_helpers import BIN, consume_cmd, cpu_env, produce_cmd

from dflash.common.contract.spool import Spool
from dflash.tools.demo.assets import demo_dataset_path

NO_AWS = {
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _env(tmp: Path, **extra: str) -> dict:
    env = cpu_env(
        HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp / "hf"), TOKENIZERS_PARALLELISM="false", **extra
    )
    for name in (
        "AWS_PROFILE",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL",
    ):
        if name not in extra:
            env.pop(name, None)
    return env


def _corrupt_checkpoint(store: Path, run: str) -> None:
    step = store / run / "step-00000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{not json")
    (store / run / "latest").write_text("step-00000002\n")


# case -> (expected pattern in the one error line, builder returning (cmd, env))
CASES = {
    "produce_missing_gpu": "--gpus 0: no CUDA device 0: this machine has 0 visible CUDA device(s)",
    "produce_foreign_spool": "belongs to run 'other'",
    "produce_busy_spool": "is in use by a live launch",
    "consume_missing_gpu": "--gpu 0: no CUDA device is visible",
    "consume_missing_spool": "no such directory",
    "consume_foreign_spool": "belongs to run 'other'; this consumer is run 'mine'",
    "consume_busy_spool": "is in use by a live launch",
    "consume_no_credentials": "no usable AWS credentials",
    "consume_unreachable_endpoint": "cannot reach the S3 endpoint",
    "consume_no_usable_checkpoint": "start over with --resume none",
    # errors that now say what is wrong and what to do
    "produce_missing_model": "--model /nonexistent/models/target: no such folder (give a model folder, or a hub id",
    "produce_config_only": "is incomplete: no tokenizer (tokenizer.json, tokenizer_config.json); no weights (model.safetensors",
    "consume_missing_target": "--target /nonexistent/models/target: no such folder",
    "produce_plan_clash": "the same run name with another plan: --max-length 512 recorded, 1024 given",
    "eval_other_target": "its weights are not those the drafter was trained with",
}


def _drafter_for_another_target(tmp: Path, target: Path) -> tuple[Path, Path]:
    """(an exported drafter trained for ``target``, a copy of ``target`` with other weights of the same
    shape): the drafter records ``target``'s head fingerprint; the copy's embedding rows are perturbed."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from dflash.common.drafter.config import DrafterConfig
    from dflash.common.drafter.hf_format import export_drafter
    from dflash.common.drafter.model import DFlashDrafter
    from dflash.common.target.head import target_fingerprint

    cfg = DrafterConfig.from_target_config(
        AutoConfig.from_pretrained(target), num_layers=1, block_size=4, mask_token_id=0
    )
    cfg.target_fingerprint = target_fingerprint(target)
    torch.manual_seed(0)
    drafter = export_drafter(DFlashDrafter(cfg).state_dict(), cfg, tmp / "drafter", dtype=torch.float32)
    other = tmp / "other-target"
    shutil.copytree(target, other)
    weights = load_file(str(other / "model.safetensors"))
    key = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[key] = weights[key] + 0.01
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    assert target_fingerprint(other) != cfg.target_fingerprint
    return drafter, other


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, tiny_target):
    tmp = tmp_path_factory.mktemp("cli-errors")
    data = tmp / "data.jsonl"
    with open(demo_dataset_path(), encoding="utf-8") as f:
        data.write_text(
            "".join(
                json.dumps({"messages": json.loads(line)["messages"]}) + "\n"
                for _, line in zip(range(4), f, strict=False)
            )
        )
    foreign = Spool(tmp / "foreign")
    foreign.bind_run({"run": "other"})
    busy = Spool(tmp / "busy")
    locks = [
        busy.acquire_lock("producer-n0", "a test holding it"),
        busy.acquire_lock("consumer-r0", "a test holding it"),
    ]
    store = tmp / "store"
    _corrupt_checkpoint(store, "mine")
    config_only = tmp / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((Path(tiny_target) / "config.json").read_text())
    planned = Spool(tmp / "planned")
    planned.bind_run({"run": "mine", "plan": {"max_length": 512}})
    drafter, other = _drafter_for_another_target(tmp, tiny_target)

    def empty(name: str) -> Path:  # one spool per case: they run at once, each takes the rank-0 lock
        return Spool(tmp / f"empty-{name}").root

    no_gpu = {"CUDA_VISIBLE_DEVICES": ""}
    fake = {
        "AWS_ACCESS_KEY_ID": "AKIAFAKE0TEST0KEY000",
        "AWS_SECRET_ACCESS_KEY": "fake/secret+Key0123456789abcdefGHIJKLMN",
    }
    closed_port = "http://127.0.0.1:9"  # discard port: nothing listens
    cmds = {
        "produce_missing_gpu": (
            produce_cmd(tmp / "never", tiny_target, data, "--gpus", "0"),
            _env(tmp, **no_gpu),
        ),
        "produce_foreign_spool": (produce_cmd(foreign.root, tiny_target, data, "--run", "mine"), _env(tmp)),
        "produce_busy_spool": (produce_cmd(busy.root, tiny_target, data, "--run", "mine"), _env(tmp)),
        "consume_missing_gpu": (consume_cmd(empty("gpu"), tiny_target, "--gpu", "0"), _env(tmp, **no_gpu)),
        "consume_missing_spool": (consume_cmd(tmp / "nope", tiny_target, "--spool-wait-s", "0"), _env(tmp)),
        "consume_foreign_spool": (consume_cmd(foreign.root, tiny_target, "--run", "mine"), _env(tmp)),
        "consume_busy_spool": (consume_cmd(busy.root, tiny_target, "--run", "mine"), _env(tmp)),
        "consume_no_credentials": (
            consume_cmd(
                empty("cred"), tiny_target, "--run", "mine", "--checkpoint", "s3://dflash-nobucket/ckpt"
            ),
            _env(tmp, **NO_AWS),
        ),
        "consume_unreachable_endpoint": (
            consume_cmd(
                empty("endpoint"), tiny_target, "--run", "mine", "--checkpoint", "s3://dflash-nobucket/ckpt"
            ),
            _env(tmp, **NO_AWS, **fake, AWS_ENDPOINT_URL=closed_port),
        ),
        "consume_no_usable_checkpoint": (
            consume_cmd(empty("ckpt"), tiny_target, "--run", "mine", "--checkpoint", str(store)),
            _env(tmp),
        ),
    }
    cmds |= {
        "produce_missing_model": (produce_cmd(tmp / "never2", "/nonexistent/models/target", data), _env(tmp)),
        "produce_config_only": (produce_cmd(tmp / "never3", config_only, data), _env(tmp)),
        "consume_missing_target": (consume_cmd(empty("target"), "/nonexistent/models/target"), _env(tmp)),
        "produce_plan_clash": (
            produce_cmd(planned.root, tiny_target, data, "--run", "mine", "--max-length", "1024"),
            _env(tmp),
        ),
        "eval_other_target": (
            [
                str(BIN / "dflash-eval"),
                "--target",
                str(other),
                "--drafter",
                str(drafter),
                "--dataset",
                str(data),
                "--num-prompts",
                "1",
                "--max-new-tokens",
                "4",
                "--device",
                "cpu",
            ],
            _env(tmp),
        ),
    }
    # consume_cmd puts "--gpu cpu" first; a later --gpu wins in argparse
    procs = {
        k: subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k, (c, e) in cmds.items()
    }
    out = {}
    try:
        for k, p in procs.items():
            _, err = p.communicate(timeout=300)  # a hang guard
            out[k] = (p.returncode, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for lock in locks:
            lock.release()
    out["_tmp"] = tmp
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_user_errors_are_one_line_and_exit_2(outcomes, case):
    code, err = outcomes[case]
    prog = {"produce": "dflash-produce", "consume": "dflash-consume", "eval": "dflash-eval"}[
        case.split("_")[0]
    ]
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(errors) == 1 and CASES[case] in errors[0], err[-3000:]
    assert code == 2, err[-3000:]
    if case == "produce_missing_gpu":  # caught before anything loads or is created
        assert not (outcomes["_tmp"] / "never").exists()
        assert "Loading" not in err and "tokenize" not in err
    if case in ("produce_missing_model", "produce_config_only"):  # before the spool is created
        assert not (outcomes["_tmp"] / ("never2" if case == "produce_missing_model" else "never3")).exists()


@pytest.mark.slow
def test_eval_of_another_target_runs_with_force_and_says_so(outcomes, tmp_path, tiny_target):
    """--force evaluates a target whose weights differ from the drafter's, with one warning line."""
    tmp = outcomes["_tmp"]
    cmd = [
        str(BIN / "dflash-eval"),
        "--target",
        str(tmp / "other-target"),
        "--drafter",
        str(tmp / "drafter"),
        "--dataset",
        str(demo_dataset_path()),
        "--num-prompts",
        "1",
        "--max-new-tokens",
        "4",
        "--device",
        "cpu",
        "--force",
    ]
    p = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    warnings = [line for line in p.stderr.splitlines() if "evaluating anyway (--force)" in line]
    assert len(warnings) == 1 and "not those the drafter was trained with" in warnings[0], p.stderr[-2000:]


def test_an_empty_spool_logs_waiting_for_producers(tmp_path, monkeypatch, caplog):
    """The line comes every WAITING_LOG_S (30 s) of an empty spool; the test shortens the interval."""
    from dflash.consumer import feed as feed_mod

    monkeypatch.setattr(feed_mod, "WAITING_LOG_S", 0.2)
    spool = Spool(tmp_path / "spool")
    caplog.set_level(logging.INFO, logger=feed_mod.__name__)
    feed = feed_mod.ShardFeed(spool, "r0-test", context_tokens=64, poll_s=0.01)
    try:
        deadline = time.monotonic() + 30  # a hang guard
        while not any("waiting for producers" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no 'waiting for producers' line"
            time.sleep(0.05)
        spool.register_producers(["n0p0.1"])
        n = sum("waiting for producers" in r.getMessage() for r in caplog.records)
        while sum("waiting for producers" in r.getMessage() for r in caplog.records) == n:
            assert time.monotonic() < deadline, "no second 'waiting for producers' line"
            time.sleep(0.05)
    finally:
        feed.close()
    lines = [r.getMessage() for r in caplog.records if "waiting for producers" in r.getMessage()]
    assert "none has registered on this spool yet" in lines[0]
    assert "0 of 1 registered producers done" in lines[-1]
