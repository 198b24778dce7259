"""Bad data is an error with reasons, and what is lost is said.

- A dataset of malformed JSON lines, one whose rows have no assistant turn, and an empty file: dflash-produce
  exits 2 with one line (no traceback, no datasets ERROR lines, no misleading "mixed types" message).
- A dataset with some rows of each kind of badness: the run goes on; the dropped rows are counted by reason
  with the first example of each.
- Shards quarantined as corrupt: their samples are counted in the consumer's final line, the metrics and
  dflash-status, and the next launch of the run (the same command) produces and trains them.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from ledger_audit import eligible_samples, read_jsonl
from pipeline_helpers import BIN, REPO, consume_cmd, cpu_env, produce_cmd

from dflash.tools.demo.assets import demo_dataset_path

MAX_LENGTH = 512


def _env(tmp_path: Path) -> dict:
    return cpu_env(HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false")


def _demo_rows(n: int) -> list[dict]:
    with open(demo_dataset_path(), encoding="utf-8") as f:
        return [{"messages": json.loads(line)["messages"]} for _, line in zip(range(n), f, strict=False)]


def _produce(tmp_path: Path, target: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = produce_cmd(tmp_path / "spool", target, data, "--cache-dir", str(tmp_path / "hf"), *extra)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(tmp_path))


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower()]


@pytest.mark.parametrize(
    "case, pattern",
    [
        (
            "malformed",
            r"^dflash-produce: error: dataset \S+: no line is valid JSON \(3 lines; first: \S+:1: ",
        ),
        ("empty", r"^dflash-produce: error: dataset \S+: file is empty \(no rows\)$"),
    ],
)
def test_a_dataset_with_no_rows_is_one_line_and_exit_2(tmp_path, tiny_target, capfd, case, pattern):
    """dflash-produce's main() in this process: the dataset is read before any worker starts, so the
    error comes before a child process would (the unit tier's guard fails the test if one starts). The
    datasets library's own ERROR lines go to the real stderr (its handler's), so capfd reads fd 2."""
    from dflash.producer import cli as produce_cli

    data = tmp_path / "data.jsonl"
    if case == "malformed":
        data.write_text('{"messages": [oops\nnot json at all\n{"messages": \n')
    else:
        data.write_text("\n\n")
    argv = produce_cmd(tmp_path / "spool", tiny_target, data, "--cache-dir", str(tmp_path / "hf"))[1:]
    with pytest.raises(SystemExit) as exit_info:
        produce_cli.main(argv)
    assert exit_info.value.code == 2
    stderr = capfd.readouterr().err
    assert "Traceback" not in stderr and "mixed types" not in stderr, stderr[-3000:]
    errors = _error_lines(stderr)
    assert len(errors) == 1 and re.search(pattern, errors[0]), stderr[-3000:]
    # no DONE marker, and no spool left: refused before the spool is made
    assert not (tmp_path / "spool").exists(), sorted(p.name for p in (tmp_path / "spool").rglob("*"))


@pytest.mark.pipeline
def test_a_dataset_without_an_assistant_turn_is_one_line_and_exit_2(tmp_path, tiny_target):
    """Rows that parse but hold nothing to train: the workers tokenize their slices and the parent decides
    (producer/supervisor.py), so this one is a launch with its worker processes. The spool the launch made
    (bound to the refused plan) is removed."""
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]}) + "\n" for i in range(4))
    )
    pattern = (
        r"^dflash-produce: error: no trainable sample in dataset \S+: dropped 4 of 4 rows: "
        r"no assistant turn 4 \(first: row 0: "
    )
    res = _produce(tmp_path, tiny_target, data)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "mixed types" not in res.stderr, res.stderr[-3000:]
    errors = _error_lines(res.stderr)
    assert len(errors) == 1 and re.search(pattern, errors[0]), res.stderr[-3000:]
    # no DONE marker, and no spool left: the one this launch made, bound to the refused plan, is removed
    assert not (tmp_path / "spool").exists(), sorted(p.name for p in (tmp_path / "spool").rglob("*"))


@pytest.mark.pipeline
def test_dropped_rows_are_counted_by_reason_with_the_first_example(tmp_path, tiny_target):
    good = _demo_rows(6)
    long_user = " ".join(["word"] * 700)  # the prompt alone passes --max-length: the answer is cut off
    bad_lines = {
        1: "{this is not json",
        3: json.dumps({"messages": [{"role": "user", "content": "no answer here"}]}),
        4: json.dumps(
            {"messages": [{"role": "user", "content": "Ok?"}, {"role": "assistant", "content": "Yes."}]}
        ),
        6: json.dumps({"messages": []}),
        8: json.dumps(
            {
                "messages": [
                    {"role": "user", "content": long_user},
                    {"role": "assistant", "content": good[0]["messages"][-1]["content"]},
                ]
            }
        ),
    }
    lines = [json.dumps(r) for r in good]
    for pos, line in sorted(bad_lines.items()):
        lines.insert(pos, line)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    res = _produce(tmp_path, tiny_target, data, "--max-length", str(MAX_LENGTH))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    summary = [line for line in res.stderr.splitlines() if "trainable rows; dropped" in line]
    assert len(summary) == 1, res.stderr[-3000:]
    line = summary[0]
    assert line.startswith(f"dflash-produce: {len(good)} trainable rows; dropped 5 of {len(lines)} rows: "), (
        line
    )
    assert "unparseable 1 (first: row 1: " in line
    assert "no assistant turn 1 (first: row 3: " in line
    assert "too short (< 32 supervised tokens) 1 (first: row 4: " in line
    assert "empty 1 (first: row 6: " in line
    assert "over-long 1 (first: row 8: " in line
    assert "1 of " in res.stderr and "not valid JSON" in res.stderr  # said once, by the parent
    assert res.stderr.count("not valid JSON") == 1, res.stderr[-3000:]


def test_template_failures_are_a_reason_of_their_own(tiny_tokenizer):
    """A chat template that raises for a row: that row is dropped as "template error", the others pass."""
    import datasets

    from dflash.common.target.chat import _Tokenize
    from dflash.common.target.drops import drop_summary

    class Fussy:  # the real tokenizer, but its template refuses one conversation
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def apply_chat_template(self, convs, **kw):
            flat = convs if isinstance(convs[0], dict) else [m for c in convs for m in c]
            if any("BOOM" in m["content"] for m in flat):
                raise ValueError("template says no")
            return self._tok.apply_chat_template(convs, **kw)

        def __call__(self, *a, **kw):
            return self._tok(*a, **kw)

    rows = _demo_rows(3)
    rows[1] = {"messages": [{"role": "user", "content": "BOOM"}, {"role": "assistant", "content": "x " * 40}]}
    fn = _Tokenize(Fussy(tiny_tokenizer), "messages", 512, 8, list(range(3)))
    out = fn({"messages": [r["messages"] for r in rows]}, [0, 1, 2])
    assert out["status"] == ["ok", "bad:template error", "ok"]
    s = drop_summary(datasets.Dataset.from_dict(out), min_loss_tokens=8)
    assert (s["ok"], s["dropped"], s["reasons"], s["first"]) == (
        2,
        1,
        {"template error": 1},
        {"template error": "row 1"},
    )


@pytest.fixture
def tiny_tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


@pytest.mark.slow
def test_quarantined_samples_are_said_and_the_next_launch_trains_them(tmp_path, tiny_target):
    """Two shards corrupted in the spool: dflash-consume trains the rest, exits 0 and says in its final line
    (and the metrics, and dflash-status) how many samples were lost; the next launch of the run
    (ops/run_all.sh, the same spool and checkpoint) produces exactly those and trains them."""
    from dflash.common.checkpoints.load import load_checkpoint
    from dflash.common.contract.shard_reader import read_sample_index
    from dflash.tools.status.cli import collect
    from dflash.tools.status.render import render

    rows = _demo_rows(16)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spool, ckpt, run_dir = tmp_path / "spool", tmp_path / "ckpt", tmp_path / "run"
    res = _produce(
        tmp_path, tiny_target, data, "--run", "q", "--max-length", str(MAX_LENGTH), "--batch-tokens", "1024"
    )
    assert res.returncode == 0, res.stderr[-3000:]
    shards = sorted((spool / "ready").iterdir())
    assert len(shards) >= 4
    lost: set[int] = set()
    for shard in shards[1:3]:  # corrupt the hidden states' chunks; the metadata still says how many samples
        lost |= set(read_sample_index(shard).tolist())
        for chunk in (shard / "hidden" / "c").rglob("*"):
            if chunk.is_file():
                chunk.write_bytes(b"\x00garbage" * 8)
    run_dir.mkdir()
    res = subprocess.run(
        consume_cmd(
            spool,
            tiny_target,
            "--checkpoint",
            str(ckpt),
            "--run-dir",
            str(run_dir),
            "--compile-backend",
            "eager",
            "--save-every",
            "1000",
        ),
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(tmp_path),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert re.search(rf"{len(lost)} samples of 2 quarantined shards were not trained", last), last
    assert "the next launch of this run (the same command) produces and trains them" in last
    end = [r for r in read_jsonl(run_dir / "metrics" / "consumer-0.jsonl") if r.get("event") == "end"]
    assert end and end[-1]["samples_quarantined"] == len(lost) and end[-1]["shards_quarantined"] == 2
    screen = render(collect(run_dir, spool_dir=spool))
    assert f"quarantined: 2 shards ({len(lost)} samples lost to this launch)" in screen, screen
    first = load_checkpoint(str(ckpt), "q")
    eligible = eligible_samples(data, tiny_target, tmp_path / "hf-audit", max_length=MAX_LENGTH)
    assert set(first.trained.indices().tolist()) == eligible - lost

    # the next launch: the same run on the same spool and checkpoint store
    cmd = [
        "bash",
        str(REPO / "ops" / "run_all.sh"),
        "--keep-spool",
        "--producers",
        "cpu:1",
        "--consumers",
        "cpu:1",
        "--model",
        str(tiny_target),
        "--dataset",
        str(data),
        "--run",
        "q",
        "--run-dir",
        str(run_dir),
        "--spool",
        str(spool),
        "--checkpoint",
        str(ckpt),
        "--producer-args",
        f"--max-length {MAX_LENGTH} --batch-tokens 1024",
        "--consumer-args",
        "--context-tokens 512 --num-anchors 32 --max-anchors-per-doc 8 --compile-backend eager",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(tmp_path))
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert "run 'q' continues" in res.stdout
    # the producer's own report of its dataset reaches the terminal, not only producer.log
    assert re.search(r"^dflash-produce: \d+ trainable rows; ", res.stderr, re.M), res.stderr[-3000:]
    produced = (run_dir / "logs" / "producer.log").read_text()
    assert f"samples={len(lost)} " in produced, produced[-2000:]  # exactly the lost ones were produced again
    final = load_checkpoint(str(ckpt), "q")
    assert set(final.trained.indices().tolist()) == eligible
    assert not list((spool / "quarantine").glob("*.zarr")), "the next launch kept the corrupt shards"
    assert len(list((spool / "quarantine").glob("*.why"))) == 2, "the reasons are kept"
    assert Path(BIN / "dflash-consume").exists()


@pytest.mark.slow
def test_run_all_does_not_restart_after_a_user_error(tmp_path, tiny_target):
    """A dataset with nothing to train under ``--restarts 3``: dflash-produce exits 2, and run_all.sh exits 2
    at once instead of restarting a launch that cannot succeed."""
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"}]}) + "\n" for i in range(4))
    )
    cmd = [
        "bash",
        str(REPO / "ops" / "run_all.sh"),
        "--keep-spool",
        "--producers",
        "cpu:1",
        "--consumers",
        "cpu:1",
        "--model",
        str(tiny_target),
        "--dataset",
        str(data),
        "--run",
        "nodata",
        "--run-dir",
        str(tmp_path / "run"),
        "--spool",
        str(tmp_path / "spool"),
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--restarts",
        "3",
        "--consumer-args",
        "--context-tokens 512 --num-anchors 32 --max-anchors-per-doc 8 --compile-backend eager",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(tmp_path))
    assert res.returncode == 2, res.stderr[-3000:]
    assert "producer (pid" in res.stderr and "failed with exit code 2" in res.stderr, res.stderr[-3000:]
    assert "no trainable sample in dataset" in res.stderr
    assert "not restarting" in res.stderr and "restart 1 of 3" not in res.stderr, res.stderr[-3000:]
