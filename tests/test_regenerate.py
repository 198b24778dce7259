"""dflash-regenerate without a model: the answer parser, the turn-by-turn walk, the output's accounting
and resumability, and the endpoint engine against a real HTTP server on 127.0.0.1 (tests/regenerate_helpers.py)
that scripts the target's answers (thinking, tool calls) or fails chosen rows. The output is then read by
the producer's own tokenization, which decides what dflash-produce trains and drops.

The local engine and ``transformers serve`` (a real target, greedy) are tests/test_regenerate_serve.py."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import cpu_env, produce_cmd
from regenerate_helpers import CUT_SHORT, CutShort, scripted_server
from transformers import AutoTokenizer

from dflash.common.target.chat import tokenize_conversations, tokenize_slice
from dflash.common.target.data import RAW_JSON_COLUMN, DataConfig, load_raw_dataset
from dflash.tools.demo.assets import tiny_target_dir
from dflash.tools.regenerate import ledger as regenerate_ledger
from dflash.tools.regenerate import run as regenerate_run
from dflash.tools.regenerate.cli import main
from dflash.tools.regenerate.config import SETTINGS, RegenerateConfig
from dflash.tools.regenerate.dialogue import Dialogue
from dflash.tools.regenerate.endpoint_engine import base_url
from dflash.tools.regenerate.engine import BatchEngine
from dflash.tools.regenerate.ledger import Ledger, LedgerError
from dflash.tools.regenerate.reply import Reply, Request, assistant_message
from dflash.tools.regenerate.rows import SourceRow, read_rows
from dflash.tools.regenerate.run import Tally, _details, regenerate

TEMPLATE = (Path(__file__).parent / "data" / "qwen3_rules.jinja").read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
LONG = "The answer is explained with care and a short example, point by point, for the reader."


def _jsonl(path: Path, rows: list[dict | list]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _out_rows(path: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    by_row = {r["dflash_regenerate"]["row"]: r for r in rows}
    assert len(by_row) == len(rows), "a row written twice"
    return by_row


# ---- the answer's text as a message ------------------------------------------------------------------


def test_reasoning_and_tool_calls_are_split_the_way_the_template_renders_them():
    think = assistant_message("<think>\nLook it up.\n</think>\n\nSure.", opened_think=False, tools=False)
    assert think == {"role": "assistant", "reasoning_content": "Look it up.", "content": "Sure."}
    opened = assistant_message("Look it up.\n</think>\n\nSure.", opened_think=True, tools=False)
    assert opened == think, "a template that opens <think> itself (Qwen3.5/3.6 thinking on)"
    cut = assistant_message("Still thinking about", opened_think=True, tools=False)
    assert cut == {"role": "assistant", "reasoning_content": "Still thinking about", "content": ""}
    hermes = assistant_message(
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        opened_think=False,
        tools=True,
    )
    assert hermes["content"] == "Checking."
    assert hermes["tool_calls"] == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]
    xml = assistant_message(
        "<tool_call>\n<function=search>\n<parameter=query>\nzip files\n</parameter>\n<parameter=limit>\n2\n"
        "</parameter>\n</function>\n</tool_call>",
        opened_think=False,
        tools=True,
    )
    assert xml["tool_calls"][0]["function"] == {
        "name": "search",
        "arguments": {"query": "zip files", "limit": 2},
    }
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert assistant_message(broken, opened_think=False, tools=True) == {
        "role": "assistant",
        "content": broken,
    }
    assert "tool_calls" not in assistant_message(
        hermes["content"] + "\n<tool_call>", opened_think=False, tools=True
    )
    no_tools = assistant_message('<tool_call>\n{"name": "x"}\n</tool_call>', opened_think=False, tools=False)
    assert "tool_calls" not in no_tools, "a row without tools: the text stays the target's words"


def test_each_turn_sees_the_targets_earlier_answers_and_tool_results_stay_where_they_fit():
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    source = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "old answer"},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "old reply"},
    ]
    d = Dialogue(source, [WEATHER])
    first = d.next_request()
    assert [m["role"] for m in first.messages] == ["system", "user"] and first.tools == [WEATHER]
    new_call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    d.accept({"role": "assistant", "content": "", "tool_calls": [new_call]}, "stop")
    second = d.next_request()
    assert second.messages[-1] == source[3] and second.messages[-2]["tool_calls"][0]["id"] == "c1"
    d.accept({"role": "assistant", "content": "It is sunny."}, "stop")
    third = d.next_request()
    assert [m.get("content") for m in third.messages[-3:]] == ["sunny", "It is sunny.", "Thanks!"]
    d.accept({"role": "assistant", "content": "You are welcome."}, "length")
    assert d.next_request() is None
    assert "old" not in json.dumps(d.out) and d.record() == {
        "turns": 3,
        "finish": ["stop", "stop", "length"],
        "truncated": False,
    }

    answered = Dialogue(source, [WEATHER])  # the target answers where the source called the tool
    answered.next_request()
    answered.accept({"role": "assistant", "content": "I cannot check."}, "stop")
    assert answered.next_request() is None and answered.truncated
    assert [m["role"] for m in answered.out] == ["system", "user", "assistant"]

    prompt_only = Dialogue([{"role": "user", "content": "Hi"}], None)  # a prompt: answered once
    assert prompt_only.next_request().messages == [{"role": "user", "content": "Hi"}]
    prompt_only.accept({"role": "assistant", "content": "Hello"}, "stop")
    assert prompt_only.next_request() is None


def test_a_row_the_target_ends_on_a_tool_call_is_truncated_kept_and_counted(tmp_path):
    """The source ends asking (a user or a tool turn) and the target calls a tool: no result exists for that
    call, so the row ends on it, truncated as where the source answered, and is kept and counted as such."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    called = {"role": "assistant", "content": "", "tool_calls": [call]}
    old_call = {**called, "tool_calls": [{**call, "id": "c1"}]}
    ends_on_user = [{"role": "user", "content": "Weather in Oslo?"}]
    ends_on_tool = [*ends_on_user, old_call, {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    for source in (ends_on_user, ends_on_tool):
        d = Dialogue(source, [WEATHER])
        while (request := d.next_request()) is not None:
            d.accept(json.loads(json.dumps(called)), "stop")
            assert request.messages[-1]["role"] in ("user", "tool")
        assert d.out[-1]["tool_calls"] and d.record()["truncated"] is True, [m["role"] for m in d.out]
    answered = Dialogue(ends_on_user, [WEATHER])  # an answer, not a call: the row is whole
    answered.next_request()
    answered.accept({"role": "assistant", "content": "Rain."}, "stop")
    assert answered.next_request() is None and not answered.truncated

    class _CallsATool(BatchEngine):
        window = 4

        def complete(self, requests: list[Request]) -> list[Reply]:
            return [Reply(message=json.loads(json.dumps(called))) for _ in requests]

    out = tmp_path / "out.jsonl"
    cfg = RegenerateConfig(endpoint="http://unused", dataset="unused", out=str(out))
    ledger = Ledger(out, cfg.settings(), SETTINGS)
    tally = Tally(total=1, before=0, progress_s=60.0)
    row = SourceRow(0, ends_on_user, [WEATHER], {"id": "r0"})
    regenerate(cfg, _CallsATool(), iter([row]), ledger, tally)
    ledger.close()
    written = _out_rows(out)[0]
    assert written["dflash_regenerate"]["truncated"] is True and written["messages"][-1]["tool_calls"]
    assert (tally.regenerated, tally.truncated) == (1, 1)
    assert "1 ended early" in _details(tally, ledger)


# ---- the output file ---------------------------------------------------------------------------------


def test_a_file_of_openai_and_sharegpt_rows_is_read_row_by_row_as_the_producer_reads_it(tmp_path):
    """Each row as the format it has (common/target/data.py row_turns): no ShareGPT row of a mixed file is
    skipped for the OpenAI column its neighbours brought in."""
    data = tmp_path / "mixed.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "A."}]},
        {"conversations": [{"from": "human", "value": "b?"}, {"from": "gpt", "value": "B."}]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    total, read = read_rows(str(data), split="train", fmt="auto", limit=None)
    got = list(read)
    assert total == 2 and [r.reason for r in got] == ["ok", "ok"]
    assert [r.messages[0]["content"] for r in got] == ["a?", "b?"]


def _rules_tokenizer(tmp_path: Path) -> Path:
    """The tiny target's tokenizer with a Qwen3-style template (thinking, tools): a folder in tmp_path."""
    tok_dir = tmp_path / "qwen3-rules-tokenizer"
    shutil.copytree(tiny_target_dir(), tok_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.jinja"))
    (tok_dir / "chat_template.jinja").write_text(TEMPLATE)
    return tok_dir


def test_every_row_reads_as_the_producer_trains_it_bare_turn_lists_and_arrow_nulls_included(tmp_path):
    """What regenerate reads of each row is what dflash-produce trains of it: the producer's own
    tokenization of the file (tokenize_slice) equals the same tokenization of the messages and tools read
    here. A raw-JSON file (a bare turn list beside an object: the producer trains the list as turns) and a
    typed one (arrow pads each row with the other rows' fields as None: in turns, metadata and tools)."""
    tok = AutoTokenizer.from_pretrained(_rules_tokenizer(tmp_path))

    def qa(q: str, a: str) -> list[dict]:
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]

    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
    }
    called = {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [call]}
    raw = _jsonl(
        tmp_path / "raw.jsonl", [qa("A bare list?", "Read as turns."), {"messages": qa("And?", "Yes.")}]
    )
    typed = _jsonl(
        tmp_path / "typed.jsonl",
        [
            {
                "id": "a",
                "meta": {"source": "x"},
                "tools": [WEATHER],
                "messages": [
                    {"role": "user", "content": "Weather in Oslo?"},
                    called,
                    {"role": "tool", "tool_call_id": "c1", "content": "rain"},
                    {"role": "assistant", "content": "Rain."},
                ],
            },
            {"id": "b", "meta": {"lang": "en"}, "messages": qa("Hi?", "Hello.")},
        ],
    )
    for path, raw_json in ((raw, True), (typed, False)):
        cfg = DataConfig(dataset=str(path), min_loss_tokens=1)
        ds = load_raw_dataset(cfg)
        assert (RAW_JSON_COLUMN in ds.column_names) == raw_json, ds.column_names
        samples = tokenize_slice(ds, tok, cfg, np.arange(len(ds)))
        assert set(samples["status"]) == {"ok"}, samples["status"]
        by_row: dict[int, list] = {}
        for i, seg, ids, mask in zip(
            samples["sample_index"],
            samples["segment"],
            samples["input_ids"],
            samples["loss_mask"],
            strict=True,
        ):
            by_row.setdefault(i, []).append((seg, ids, mask))
        _, rows = read_rows(str(path), split="train", fmt="auto", limit=None)
        for row in rows:
            assert row.reason == "ok", (path.name, row.index, row.reason)
            [ours] = tokenize_conversations(tok, [row.messages], [row.tools])
            theirs = [(ids, mask) for _, ids, mask in sorted(by_row[row.index])]
            assert ours == theirs, f"{path.name} row {row.index} reads unlike the producer trains it"
            if not raw_json:
                assert row.fields == {
                    "id": "ab"[row.index],
                    "meta": [{"source": "x"}, {"lang": "en"}][row.index],
                }


def test_a_torn_last_line_is_cut_and_settings_or_a_second_run_are_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    settings = {"dataset": "d", "temperature": 0.0}
    ledger = Ledger(out, settings, ("dataset", "temperature"))
    ledger.write_row({"messages": [], "dflash_regenerate": {"row": 0}})
    with pytest.raises(LedgerError, match="another dflash-regenerate"):
        Ledger(out, settings, ("dataset", "temperature"))
    ledger.close()
    with open(out, "a") as f:
        f.write('{"messages": [], "dflash_regenerate": {"ro')  # a kill while writing row 1
    ledger = Ledger(out, settings, ("dataset", "temperature"))
    assert ledger.written == {0} and out.read_text().count("\n") == 1 and out.read_text().endswith("}\n")
    ledger.close()
    with pytest.raises(LedgerError, match="temperature=0.0.*not temperature=0.7"):
        Ledger(out, {**settings, "temperature": 0.7}, ("dataset", "temperature"))
    assert _lock_is_free(out), "a refused run let the output go"
    Path(f"{out}.settings.json").write_text('{"dataset": "d", "temp')  # a hand edit, a full disk
    with pytest.raises(LedgerError, match=r"out\.jsonl\.settings\.json.* not JSON"):
        Ledger(out, settings, ("dataset", "temperature"))
    assert _lock_is_free(out)


def _lock_is_free(out: Path) -> bool:
    """No open file of this process or another holds ``OUT.lock`` (flock: a second open file conflicts)."""
    fd = os.open(f"{out}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


# ---- the command, against a scripted server ----------------------------------------------------------


def _fails(prompt: str) -> str | int | float:
    if "FAIL" in prompt:
        return 500
    if "SLOW" in prompt:
        return 3.0  # silent past the client's --timeout-s
    if "REFUSE" in prompt:
        return 400
    return LONG


def test_failed_rows_are_counted_listed_and_only_they_are_retried(tmp_path, capsys):
    questions = ["q0", "q1 FAIL", "q2", "q3 SLOW", "q4", "q5 REFUSE", "q6"]
    rows = [
        {"id": f"r{i}", "conversations": [{"from": "human", "value": q}]} for i, q in enumerate(questions)
    ]
    rows.insert(3, {"id": "bad", "conversations": [{"from": "wizard", "value": "?"}]})  # row 3: skipped
    data, out = _jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    args = ["--dataset", str(data), "--out", str(out), "--tokenizer", str(tiny_target_dir())]
    args += ["--retries", "1", "--retry-wait-s", "0.05", "--timeout-s", "1", "--concurrency", "4"]
    failing = {"on": True}
    with scripted_server(lambda p: _fails(p) if failing["on"] else LONG) as server:
        assert main(["--endpoint", server.url, *args]) == 1
        lines = capsys.readouterr().out.strip().splitlines()
        assert lines[-1] == "regenerated 4, failed 3, skipped 1 = input 8", lines
        errors = {e["row"]: e for e in map(json.loads, Path(f"{out}.errors.jsonl").read_text().splitlines())}
        assert sorted(errors) == [1, 4, 6] and errors[1]["id"] == "r1"
        assert errors[1]["error"].startswith("HTTP 500") and "(2 tries)" in errors[1]["error"]
        assert "no answer within 1 s" in errors[4]["error"]
        assert errors[6]["error"].startswith("HTTP 400"), "a 4xx other than 429 is not retried"
        tries = {p.split("user\n")[1].split("<|im_end|>")[0]: n for p, n in server.requests.items()}
        assert tries == {"q0": 1, "q1 FAIL": 2, "q2": 1, "q3 SLOW": 2, "q4": 1, "q5 REFUSE": 1, "q6": 1}
        assert set(_out_rows(out)) == {0, 2, 5, 7}

        failing["on"] = False
        server.requests.clear()
        assert main(["--endpoint", server.url, *args]) == 0
        assert (
            capsys.readouterr().out.strip().splitlines()[-1] == "regenerated 7, failed 0, skipped 1 = input 8"
        )
        assert sorted(server.requests.values()) == [1, 1, 1], "only the failed rows were asked again"
        written = _out_rows(out)
        assert set(written) == {0, 1, 2, 4, 5, 6, 7} and written[1]["id"] == "r1"
        assert written[1]["messages"][-1] == {"role": "assistant", "content": LONG}
        assert Path(f"{out}.errors.jsonl").read_text() == ""
        assert main(["--endpoint", server.url, *args]) == 0, "a finished output: nothing left to do"
        assert sum(server.requests.values()) == 3, "a finished output asks nothing"


def test_a_reply_cut_short_is_retried_and_then_only_its_row_fails(tmp_path, capsys):
    """A body shorter than its headers promise (http.client.IncompleteRead from the read) is a failure of
    the connection, retried as one; once the retries are spent the row is a failed row, the run goes on."""
    questions = ["q0", "q1 ONCE", "q2 ALWAYS"]
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": q}]} for i, q in enumerate(questions)]
    data, out = _jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    asked: Counter = Counter()

    def cut(prompt: str) -> str | CutShort:
        asked[prompt] += 1
        return CUT_SHORT if "ALWAYS" in prompt or ("ONCE" in prompt and asked[prompt] == 1) else LONG

    with scripted_server(cut) as server:
        code = main(
            ["--endpoint", server.url, "--dataset", str(data), "--out", str(out)]
            + ["--tokenizer", str(tiny_target_dir()), "--retries", "1", "--retry-wait-s", "0.05"]
        )
    said = capsys.readouterr()
    lines = said.out.strip().splitlines()
    assert code == 1 and lines[-1:] == ["regenerated 2, failed 1, skipped 0 = input 3"], said.err[-500:]
    errors = [json.loads(line) for line in Path(f"{out}.errors.jsonl").read_text().splitlines()]
    assert [e["row"] for e in errors] == [2] and errors[0]["error"].startswith("IncompleteRead"), errors
    assert "(2 tries)" in errors[0]["error"] and sorted(asked.values()) == [1, 2, 2]
    assert set(_out_rows(out)) == {0, 1}


def _prompts(n: int, tmp_path: Path) -> tuple[Path, Path]:
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(n)]
    return _jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"


def _question(prompt: str) -> str:
    return prompt.split("user\n")[-1].split("<|im_end|>")[0]


@pytest.mark.parametrize("how", ["dead", "hanging"])
def test_a_server_gone_mid_run_stops_it_naming_the_endpoint_and_the_same_command_finishes(
    tmp_path, capsys, how
):
    """The server dies (connections refused) or hangs (takes requests, never answers) after 5 answers:
    the run stops after --max-connection-failures tries in a row without an answer, with one line naming
    the endpoint, exit 1, instead of failing the other rows one by one (each after its tries); the same
    command against a live server asks only for the rows not written, each once."""
    data, out = _prompts(40, tmp_path)
    args = ["--dataset", str(data), "--out", str(out), "--tokenizer", str(tiny_target_dir())]
    args += ["--concurrency", "2", "--retries", "3", "--retry-wait-s", "0.01", "--timeout-s", "0.5"]
    args += ["--max-connection-failures", "4"]
    answered: list[str] = []
    lock, dead = threading.Lock(), threading.Event()

    def dies(prompt: str) -> str | float:
        with lock:
            if len(answered) < 5:
                answered.append(_question(prompt))
                return LONG
            if how == "dead" and not dead.is_set():
                dead.set()
                server.die()
        return 5.0  # hanging: silent past --timeout-s (dead: only the requests accepted before it died)

    with scripted_server(dies) as server:
        url = server.url
        code = main(["--endpoint", url, *args])
    said = capsys.readouterr()
    err = said.err.strip().splitlines()
    assert code == 1, said.out[-2000:]
    assert err[-1].startswith(f"dflash-regenerate: error: endpoint {url} stopped answering: 4 tries in a row")
    assert "the same command continues" in err[-1] and not any("Traceback" in line for line in err)
    assert how == "dead" or "no answer within 0.5 s" in err[-1], err[-1]
    assert set(_out_rows(out)) == {int(q[1:]) for q in answered} and len(answered) == 5
    failed = Path(f"{out}.errors.jsonl").read_text().splitlines()
    assert len(failed) <= 2, f"rows failed one by one after the server went: {len(failed)}"

    with scripted_server(lambda _p: LONG) as server:
        assert main(["--endpoint", server.url, *args]) == 0
        assert (
            capsys.readouterr().out.strip().splitlines()[-1]
            == "regenerated 40, failed 0, skipped 0 = input 40"
        )
        asked = Counter(_question(p) for p in server.requests.elements())
    assert set(asked) == {f"q{i}" for i in range(40)} - set(answered) and set(asked.values()) == {1}
    assert set(_out_rows(out)) == set(range(40))


class _Lines(logging.Handler):
    """Counts the progress lines of dflash.tools.regenerate.run, waking whoever waits for the next."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.count = 0
        self.changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        if " rows (this run: " in record.getMessage():
            with self.changed:
                self.count += 1
                self.changed.notify_all()


def test_progress_lines_keep_their_clock_while_a_turn_is_out(tmp_path, capsys, caplog):
    """Each answer is held by the server until two progress lines have come while it was out (a hang
    guard ends the wait if they never come): with --progress-s 0.05 every answer sees its two lines, so
    the lines come while turns are out, not only when a row or a round ends. The verdict is the order
    (lines before answers), not the time taken."""
    turns = [{"role": "user", "content": f"turn {i}"} for i in range(3)]
    convo = [m for t in turns for m in (t, {"role": "assistant", "content": "old"})][:-1]
    data, out = _jsonl(tmp_path / "in.jsonl", [{"messages": convo}]), tmp_path / "out.jsonl"
    lines = _Lines()
    logger = logging.getLogger(regenerate_run.__name__)
    caplog.set_level(logging.INFO, logger=logger.name)
    logger.addHandler(lines)
    late: list[str] = []

    def after_two_lines(prompt: str) -> str:
        with lines.changed:
            seen = lines.count
            if not lines.changed.wait_for(lambda: lines.count >= seen + 2, timeout=5.0):  # hang guard
                late.append(_question(prompt))
        return LONG

    try:
        with scripted_server(after_two_lines) as server:
            code = main(
                ["--endpoint", server.url, "--dataset", str(data), "--out", str(out), "--progress-s", "0.05"]
                + ["--tokenizer", str(tiny_target_dir()), "--concurrency", "1"]
            )
    finally:
        logger.removeHandler(lines)
    assert code == 0 and capsys.readouterr().out.strip().endswith("= input 1")
    assert late == [], f"no progress line while these turns were out: {late}"
    assert sum(server.requests.values()) == 3 and lines.count >= 6


def test_a_row_is_written_when_its_last_turn_is_in_not_when_its_round_ends(tmp_path, capsys):
    """Row 0 is answered at once, row 1's answer is held by the server until row 0 is a line of OUT (a
    hang guard ends the wait): the finished row is in OUT while another row's turn is still out, so a
    kill then keeps it."""
    data, out = _prompts(2, tmp_path)
    seen: list[bool] = []

    def row_1_waits_for_row_0(prompt: str) -> str:
        if _question(prompt) == "q1":
            written = threading.Event()
            for _ in range(500):  # hang guard: 5 s
                if out.exists() and '"row": 0,' in out.read_text():
                    written.set()
                    break
                written.wait(0.01)
            seen.append(written.is_set())
        return LONG

    with scripted_server(row_1_waits_for_row_0) as server:
        code = main(
            ["--endpoint", server.url, "--dataset", str(data), "--out", str(out), "--concurrency", "2"]
            + ["--tokenizer", str(tiny_target_dir())]
        )
    assert code == 0 and capsys.readouterr().out.strip().endswith("= input 2")
    assert seen == [True], "row 0 was not in OUT while row 1's turn was out"
    assert set(_out_rows(out)) == {0, 1}


def test_an_endpoint_with_a_path_is_used_as_given_and_a_bare_address_gets_v1(tmp_path, capsys):
    assert base_url("http://h:8000") == base_url("http://h:8000/") == "http://h:8000/v1"
    assert base_url("http://h:8000/v1/") == "http://h:8000/v1"
    assert base_url("https://gw/openai/v2") == "https://gw/openai/v2"
    data, out = _prompts(2, tmp_path)
    with scripted_server(lambda _p: LONG, prefix="/v2") as server:
        code = main(
            ["--endpoint", server.url, "--dataset", str(data), "--out", str(out)]
            + ["--tokenizer", str(tiny_target_dir())]
        )
    said = capsys.readouterr()
    assert code == 0, said.err[-1000:]
    assert set(server.paths) == {"/v2/models", "/v2/completions"} and set(_out_rows(out)) == {0, 1}


def _target_answers(prompt: str) -> str:
    """What a thinking, tool-calling target writes at each point of the rows below."""
    last = prompt.rsplit("<|im_start|>", 2)[-2]
    if "Weather in Paris" in last:
        return (
            '<think>\nThe weather tool answers this.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>'
        )
    if "<tool_response>" in last:
        return f"<think>\nThe tool says 12 C and cloudy.\n</think>\n\nParis: 12 C and cloudy. {LONG}"
    if "Thanks" in last:
        return f"<think>\nA polite close.\n</think>\n\nYou are welcome. {LONG}"
    return f"<think>\nSlicing reverses a copy; reverse() works in place.\n</think>\n\nUse reversed(). {LONG}"


def _regenerate_tool_and_thinking_rows(tmp_path: Path, capsys) -> tuple[Path, Path, dict]:
    """A multi-turn row with tool calls and a ``tools`` list, and a prompt, answered by a thinking,
    tool-calling target (scripted) through the endpoint engine: (output, tokenizer folder, requests)."""
    tok_dir = _rules_tokenizer(tmp_path)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    }
    rows = [
        {
            "tools": [WEATHER],
            "messages": [
                {"role": "system", "content": "Answer with the tools when needed."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 12, "sky": "cloudy"}'},
                {"role": "assistant", "content": "An answer of another model."},
                {"role": "user", "content": "Thanks!"},
                {"role": "assistant", "content": "Another model's reply."},
            ],
        },
        {"messages": [{"role": "user", "content": "How do I reverse a list?"}]},  # a prompt: answered once
    ]
    data, out = _jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    with scripted_server(_target_answers) as server:
        code = main(
            [
                "--endpoint",
                server.url,
                "--tokenizer",
                str(tok_dir),
                "--dataset",
                str(data),
                "--out",
                str(out),
                "--thinking",
                "on",
            ]
        )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 0 and last == "regenerated 2, failed 0, skipped 0 = input 2", last
    return out, tok_dir, dict(server.requests)


def test_thinking_and_tool_call_rows_come_out_as_the_producer_trains_them(tmp_path, capsys):
    out, tok_dir, requests = _regenerate_tool_and_thinking_rows(tmp_path, capsys)
    written = _out_rows(out)
    tool_row, think_row = written[0], written[1]
    assert tool_row["tools"] == [WEATHER]
    msgs = tool_row["messages"]
    roles = "system user assistant tool assistant user assistant".split()
    assert [m["role"] for m in msgs] == roles
    assert msgs[2]["reasoning_content"] == "The weather tool answers this." and msgs[2]["content"] == ""
    assert msgs[2]["tool_calls"] == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "id": "c1"}
    ]
    assert msgs[4]["content"].startswith("Paris: 12 C") and msgs[6]["reasoning_content"] == "A polite close."
    assert think_row["messages"][1]["reasoning_content"].startswith("Slicing reverses")

    tok = AutoTokenizer.from_pretrained(tok_dir)
    asked = 0
    # each turn was asked in the context the producer renders it in, and renders back as written
    for row in written.values():
        msgs, tools = row["messages"], row.get("tools")
        for i in (i for i, m in enumerate(msgs) if m["role"] == "assistant"):
            prompt = tok.apply_chat_template(
                msgs[:i], tools=tools, tokenize=False, add_generation_prompt=True
            )
            assert requests[prompt] == 1, f"turn {i} was not asked in the context it is trained in"
            turn = tok.apply_chat_template(msgs[: i + 1], tools=tools, tokenize=False)
            assert turn.startswith(prompt + _target_answers(prompt)), (
                f"turn {i} renders unlike it was written"
            )
            asked += 1
    assert asked == len(requests) == 4

    cfg = DataConfig(dataset=str(out), min_loss_tokens=8)
    ds = load_raw_dataset(cfg)
    samples = tokenize_slice(ds, tok, cfg, np.arange(len(ds)))
    assert set(samples["status"]) == {"ok"}, samples["status"]
    trained = "".join(
        tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        for ids, mask in zip(samples["input_ids"], samples["loss_mask"], strict=True)
    )
    for part in (
        "The weather tool answers this.",
        '"city": "Paris"',
        "Paris: 12 C",
        "A polite close.",
        "Slicing reverses",
    ):
        assert part in trained, f"{part!r} is not trained"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "give exactly one of --model PATH or --endpoint URL"),
        (["--model", "/nonexistent/target", "--endpoint", "http://127.0.0.1:1"], "give exactly one of"),
        (["--endpoint", "ENDPOINT"], "unreachable"),
        (["--model", "/nonexistent/target"], "no such folder"),
        (["--model", "/nonexistent/target", "--dataset", "/nonexistent.jsonl"], "does not exist"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys, extra, message):
    data = _jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    extra = [e.replace("ENDPOINT", f"http://127.0.0.1:{_closed_port()}") for e in extra]
    args = ["--dataset", str(data), "--out", str(tmp_path / "out.jsonl"), *extra]
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()  # after the datasets library's progress lines
    assert exc.value.code == 2 and err[-1].startswith("dflash-regenerate: error: "), err
    assert message in err[-1] and not any("Traceback" in line for line in err)


@pytest.mark.parametrize("case", ["under a file", "a folder", "settings not JSON"])
def test_an_output_that_cannot_be_opened_is_one_line_exit_2_and_lets_the_lock_go(tmp_path, capsys, case):
    data = _jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    out, named = tmp_path / "out.jsonl", str(tmp_path / "out.jsonl")
    if case == "under a file":
        (tmp_path / "file").write_text("")
        out, named = tmp_path / "file" / "out.jsonl", str(tmp_path / "file")
    elif case == "a folder":
        out.mkdir()
    else:
        Path(f"{out}.settings.json").write_text("{not json")
        named = f"{out}.settings.json"
    with pytest.raises(SystemExit) as exc:
        main(["--model", "/nonexistent/target", "--dataset", str(data), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err[-1].startswith("dflash-regenerate: error: "), err
    assert named in err[-1] and not any("Traceback" in line for line in err), err[-1]
    assert case == "under a file" or _lock_is_free(out), "the failed start-up still holds OUT.lock"


@pytest.mark.parametrize("where", ["read_rows", "_repair"])
def test_ctrl_c_while_starting_is_one_line_exit_130_and_lets_the_lock_go(
    tmp_path, capsys, monkeypatch, where
):
    """Ctrl-C (or SIGTERM, which the command turns into one) while the dataset loads or the output opens."""
    data = _jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    out = tmp_path / "out.jsonl"

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    module = regenerate_run if where == "read_rows" else regenerate_ledger
    monkeypatch.setattr(module, where, interrupted)
    cfg = RegenerateConfig(model="/nonexistent/target", dataset=str(data), out=str(out))
    try:
        code = regenerate_run.run(cfg)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while starting escaped run() (a traceback)")
    said = capsys.readouterr()
    assert code == 130 and said.out.strip().startswith("stopped") and len(said.out.splitlines()) == 1
    assert "Traceback" not in said.err and _lock_is_free(out)


@pytest.mark.pipeline
def test_dflash_produce_trains_the_regenerated_rows_without_drops(tmp_path, tiny_target, capsys):
    out, _, _ = _regenerate_tool_and_thinking_rows(tmp_path, capsys)
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    (target / "chat_template.jinja").write_text(TEMPLATE)  # the target whose answers these are
    cmd = produce_cmd(
        tmp_path / "spool", target, out, "--block-size", "4", "--cache-dir", str(tmp_path / "hf")
    )
    env = cpu_env(HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    said = [line for line in (res.stdout + res.stderr).splitlines() if "trainable" in line]
    assert len(said) == 1 and re.search(
        r"dflash-produce: \d+ trainable samples; dropped 0 of \d+ samples \(2 rows\)$", said[0]
    ), said
