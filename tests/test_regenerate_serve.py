"""dflash-regenerate on the real tiny target, greedy: the local engine (transformers generate, batched) and
the endpoint engine through ``transformers serve`` started on 127.0.0.1 (a real server: FastAPI, uvicorn, its
own model loading and decoding) write the same text, and that text is the target's own greedy continuation
of each turn, decoded. And a run killed with SIGKILL mid-way, re-run, holds every row exactly once.

Why ``transformers serve`` and not vLLM or SGLang: it is the OpenAI-compatible server that runs on this
CPU-only box from a package; the client speaks to all three alike (/v1/models, /v1/completions)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from pipeline_helpers import BIN, REPO, cpu_env
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash.tools.demo.assets import demo_dataset_path, materialize_tiny_target
from dflash.tools.regenerate.cli import main

pytestmark = pytest.mark.pipeline

ROWS = (0, 1, 2, 3, 13, 14)  # single-turn rows (one with a system prompt) and two multi-turn rows
MAX_NEW = 24


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return materialize_tiny_target(tmp_path_factory.mktemp("regen") / "target")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    lines = demo_dataset_path().read_text().splitlines()
    path = tmp_path_factory.mktemp("regen-data") / "chats.jsonl"
    path.write_text("".join(lines[i] + "\n" for i in ROWS))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(target, tmp_path_factory):
    """``transformers serve TARGET`` on 127.0.0.1 (no other interface), stopped at the end (SIGTERM, then
    SIGKILL after 20 s); its log is shown when it does not come up within 180 s."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [str(BIN / "transformers"), "serve", str(target), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**cpu_env(), "HF_HUB_OFFLINE": "1"}
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"transformers serve did not come up (exit {proc.poll()}):\n{log.read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def _rows(path: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    by_row = {r["dflash_regenerate"]["row"]: r for r in rows}
    assert len(by_row) == len(rows), "a row written twice"
    return by_row


def test_local_and_served_greedy_answers_are_the_targets_own(target, dataset, served, tmp_path, capsys):
    common = ["--dataset", str(dataset), "--max-new-tokens", str(MAX_NEW)]
    assert (
        main(["--model", str(target), "--batch-size", "3", "--out", str(tmp_path / "local.jsonl"), *common])
        == 0
    )
    assert (
        main(["--endpoint", served, "--concurrency", "2", "--out", str(tmp_path / "served.jsonl"), *common])
        == 0
    )
    assert (
        capsys.readouterr().out.strip().splitlines()[-1]
        == f"regenerated {len(ROWS)}, failed 0, skipped 0 = input {len(ROWS)}"
    )
    local, served_rows = _rows(tmp_path / "local.jsonl"), _rows(tmp_path / "served.jsonl")
    assert sorted(local) == sorted(served_rows) == list(range(len(ROWS)))
    for i in local:
        assert local[i]["messages"] == served_rows[i]["messages"], (
            f"row {i}: the engines wrote different text"
        )

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    turns = 0
    for row in local.values():  # each turn: the target's greedy continuation of the turns before it, alone
        msgs = row["messages"]
        for k in (k for k, m in enumerate(msgs) if m["role"] == "assistant"):
            prompt = tok.apply_chat_template(msgs[:k], add_generation_prompt=True, tokenize=False)
            ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)[0, ids.shape[1] :].tolist()
            out = out[: out.index(eos)] if eos in out else out
            assert msgs[k]["content"] == tok.decode(out, skip_special_tokens=True), f"turn {k} of {row['id']}"
            turns += 1
    assert turns > len(ROWS), "the multi-turn rows were answered turn by turn"


def test_a_run_killed_mid_way_and_run_again_holds_every_row_once(target, tmp_path):
    rows = demo_dataset_path().read_text().splitlines()[:24]
    data, out = tmp_path / "chats.jsonl", tmp_path / "out.jsonl"
    data.write_text("".join(line + "\n" for line in rows))
    cmd = [str(BIN / "dflash-regenerate"), "--model", str(target), "--dataset", str(data), "--out", str(out)]
    cmd += ["--max-new-tokens", "8", "--batch-size", "2"]  # 8 rows at once: the kill finds rows still out
    proc = subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not (out.exists() and out.read_bytes().count(b"\n") >= 1):
        assert proc.poll() is None, (
            f"exited before any row was written: {proc.stderr.read().decode()[-2000:]}"
        )
        assert time.monotonic() < deadline, "no row written in 240 s"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    first = out.read_bytes().count(b"\n")
    assert 1 <= first < len(rows), f"the kill came after the run ended ({first} rows)"
    with open(out, "ab") as f:  # and a row half-written when the kill came
        f.write(b'{"id": "stdlib-0099", "messages": [{"role": "user", "con')

    assert main(cmd[1:]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == len(rows) and all(json.loads(line) for line in lines)
    assert sorted(_rows(out)) == list(range(len(rows))), "every input row exactly once"
