"""Chat rows as the target sees them: multi-turn, reasoning, tool calls and tool results rendered with a
template that follows the Qwen3-family rules (tests/data/qwen3_rules.jinja, written for these tests: reasoning
only on assistant turns after the last user query, tools in the system turn, tool calls as <tool_call> JSON,
tool results as <tool_response> inside a user turn). Every assistant turn is trained on the tokens the
template renders when the target generates it (the history with the generation prompt, then the turn)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from dflash.common.contract.epochs import Epochs
from dflash.common.contract.sample_set import SampleSet
from dflash.common.target.chat import _Tokenize, generation_renderings, tokenize_conversations, tokenize_slice
from dflash.common.target.conversation import normalize_conversation
from dflash.common.target.data import DataConfig, load_raw_dataset, slice_indices
from dflash.common.target.drops import drop_summary, format_drops
from dflash.producer.slice_plan import held_out_plan, plan_epochs
from dflash.tools.demo.assets import tiny_target_dir

TEMPLATE = (Path(__file__).parent / "data" / "qwen3_rules.jinja").read_text()

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the library documentation",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        },
    },
}


def _say(topic: str, n: int = 3) -> str:
    """An answer long enough to pass the producer's minimum of supervised tokens."""
    return " ".join(f"The {topic} point {k} is explained with care and a short example." for k in range(n))


def _call(name: str, args: dict, cid: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def chats() -> list[dict]:
    """One row per chat shape, in HF chat-template form (OpenAI messages + tools)."""
    return [
        {  # single turn with reasoning
            "messages": [
                {"role": "user", "content": "How do I reverse a list?"},
                {
                    "role": "assistant",
                    "content": _say("reversal"),
                    "reasoning_content": "Slicing or reverse().",
                },
            ]
        },
        {  # multi-turn, reasoning in every turn: one sample per user query
            "messages": [
                {"role": "system", "content": "You are a terse Python tutor."},
                {"role": "user", "content": "What is a dict?"},
                {"role": "assistant", "content": _say("dict"), "reasoning_content": "Mapping type; hashing."},
                {"role": "user", "content": "And a set?"},
                {"role": "assistant", "content": _say("set"), "reasoning_content": "Like dict keys only."},
                {"role": "user", "content": "Which is faster for lookups?"},
                {
                    "role": "assistant",
                    "content": _say("lookup"),
                    "reasoning_content": "Both O(1) on average.",
                },
            ]
        },
        {  # tool call (null content), tool result, answer; then a second query
            "tools": [WEATHER],
            "messages": [
                {"role": "system", "content": "Answer with the tools when needed."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "I need the weather tool for Paris.",
                    "tool_calls": [_call("get_weather", {"city": "Paris"}, "c1")],
                },
                {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 12, "sky": "cloudy"}'},
                {
                    "role": "assistant",
                    "content": _say("weather"),
                    "reasoning_content": "Report 12 C and clouds.",
                },
                {"role": "user", "content": "And in Rome?"},
                {
                    "role": "assistant",
                    "content": "Let me look that up.",
                    "reasoning_content": "Same tool, other city.",
                    "tool_calls": [_call("get_weather", {"city": "Rome"}, "c2")],
                },
                {"role": "tool", "tool_call_id": "c2", "content": '{"temp_c": 19, "sky": "sunny"}'},
                {"role": "assistant", "content": _say("sunshine"), "reasoning_content": "Report 19 C."},
            ],
        },
        {  # two parallel calls, two results in one user turn, no reasoning anywhere
            "tools": [WEATHER, SEARCH],
            "messages": [
                {"role": "user", "content": "Weather in Oslo and docs on zipfile?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        _call("get_weather", {"city": "Oslo"}, "a"),
                        _call("search_docs", {"query": "zipfile", "limit": 2}, "b"),
                    ],
                },
                {"role": "tool", "tool_call_id": "a", "content": '{"temp_c": -3}'},
                {"role": "tool", "tool_call_id": "b", "content": "zipfile: read and write ZIP archives."},
                {"role": "assistant", "content": _say("archive")},
            ],
        },
        {  # an empty assistant turn inside a good row: that turn is dropped, the row trains
            "messages": [
                {"role": "user", "content": "Say something about tuples."},
                {"role": "assistant", "content": "   "},
                {"role": "user", "content": "Please?"},
                {"role": "assistant", "content": _say("tuple"), "reasoning_content": "Immutable sequences."},
            ]
        },
    ]


@pytest.fixture(scope="module")
def qtok():
    t = AutoTokenizer.from_pretrained(tiny_target_dir())
    t.chat_template = TEMPLATE
    return t


def _render(tok, msgs, tools, generation=False) -> str:
    return tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=generation)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def generation_time_turns(tok, row: dict) -> list[tuple[list[int], list[int]]]:
    """Per non-empty assistant turn, straight from the template: (tokens of the history rendered with the
    generation prompt, tokens of that history followed by the turn as the template renders it last)."""
    msgs = [
        m
        for m in row["messages"]
        if m["role"] != "assistant"
        or (m.get("content") or "").strip()
        or m.get("reasoning_content")
        or m.get("tool_calls")
    ]
    out = []
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            head = _render(tok, msgs[:i], row.get("tools"), generation=True)
            turn = _render(tok, msgs[: i + 1], row.get("tools")).rstrip()
            assert turn.startswith(head)
            out.append((_ids(tok, head), _ids(tok, turn)))
    return out


def check_samples_against_template(tok, row: dict, samples: list[tuple[list[int], list[bool]]]) -> None:
    """Each assistant turn is trained in exactly one sample; that sample starts with the turn's
    generation-time tokens, and its mask is exactly the union of the tokens of the turns it trains."""
    turns = generation_time_turns(tok, row)
    trained_in = []
    for head, full in turns:
        assert full[: len(head)] == head  # the turn's tokens follow the generation prompt's
        hits = [
            k
            for k, (ids, mask) in enumerate(samples)
            if ids[: len(full)] == full and all(mask[len(head) : len(full)])
        ]
        assert len(hits) >= 1, f"turn not trained as generated: {tok.decode(full[len(head) :])!r}"
        trained_in.append(hits[-1])
    for k, (ids, mask) in enumerate(samples):
        expected = np.zeros(len(ids), dtype=bool)
        for (head, full), where in zip(turns, trained_in, strict=True):
            if where == k:
                expected[len(head) : len(full)] = True
        assert np.array_equal(np.asarray(mask, dtype=bool), expected)
    assert sorted(set(trained_in)) == list(range(len(samples)))  # no sample without a turn of its own


def test_generation_renderings_split_only_where_history_differs(qtok):
    rows = chats()
    groups = [
        generation_renderings(qtok, normalize_conversation(r["messages"])[0], r.get("tools")) for r in rows
    ]
    # one sample per user query whose turns carry reasoning; a tool loop within one query shares it. The
    # call without reasoning (row 3) renders an empty <think> block while it is the last turn, none once
    # history: the answer after it needs a sample of its own too.
    assert [len(g) for g in groups] == [1, 3, 2, 2, 1]
    assert [len(spans) for _, spans in groups[2]] == [2, 2]
    # every turn's reasoning is in the tokens it is trained on
    trained_text = "".join(t[a:b] for g in groups for t, spans in g for a, b in spans)
    for row in rows:
        for m in row["messages"]:
            if m.get("reasoning_content"):
                assert m["reasoning_content"] in trained_text
            for call in m.get("tool_calls", []):
                assert json.dumps(call["function"]["arguments"]) in trained_text


def test_tokens_and_mask_equal_the_templates_generation_time_rendering(qtok):
    rows = chats()
    convs = [normalize_conversation(r["messages"])[0] for r in rows]
    results = tokenize_conversations(qtok, convs, [r.get("tools") for r in rows])
    for row, samples in zip(rows, results, strict=True):
        assert not isinstance(samples, str), samples
        check_samples_against_template(qtok, row, samples)


def test_reasoning_off_renders_the_rows_without_it(qtok):
    rows = chats()
    for row in rows:
        msgs, _ = normalize_conversation(row["messages"], train_reasoning=False)
        assert not any("reasoning_content" in m for m in msgs)
        for text, _ in generation_renderings(qtok, msgs, row.get("tools")):
            assert not any(m.get("reasoning_content", "\0") in text for m in row["messages"])
    fn = _Tokenize(qtok, "messages", 4096, 1, np.arange(len(rows)), train_reasoning=False)
    out = fn(
        {"messages": [r["messages"] for r in rows], "tools": [r.get("tools") for r in rows]},
        list(range(len(rows))),
    )
    assert set(out["status"]) == {"ok"}
    assert all("I need the weather tool" not in qtok.decode(ids) for ids in out["input_ids"])


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_drop_reasons_name_what_happened(tmp_path, qtok):
    good = chats()
    bad = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": _say("x")}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]},
            ]
        },
        {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "boo"}]},
    ]
    path = _write_jsonl(tmp_path / "chats.jsonl", good + bad)
    # --format openai: the ShareGPT row is named (under auto it trains: test_data_layout.py)
    cfg = DataConfig(dataset=str(path), cache_dir=str(tmp_path / "cache"), min_loss_tokens=1, format="openai")
    ds = load_raw_dataset(cfg)
    out = tokenize_slice(ds, qtok, cfg, slice_indices(len(ds), rank=0, world=1))
    n = len(good)
    by_row = {}
    for row, st in zip(out["sample_index"], out["status"], strict=True):
        by_row.setdefault(row, []).append(st)
    assert all(set(by_row[r]) == {"ok"} for r in range(n))
    assert [by_row[n + k] for k in range(4)] == [
        ["bad:a ShareGPT row in an OpenAI-format file"],
        ["bad:only empty assistant turns"],
        ["bad:tool call without a function name"],
        ["bad:unknown role"],
    ]
    summary = drop_summary(out, ds, "messages", min_loss_tokens=1)
    assert (summary["rows"], summary["samples"], summary["dropped"]) == (n + 4, len(out), 4)
    line = format_drops(summary)
    assert line.startswith(f"dropped 4 of {len(out)} samples ({n + 4} rows): ")
    assert f'a ShareGPT row in an OpenAI-format file 1 (first: row {n}: \'{{"conversations": ' in line
    # the arrow-loaded rows trained exactly as the template renders them (no null keys from the struct union)
    for r in range(n):
        samples = [
            (ids, mask)
            for ids, mask, i in zip(out["input_ids"], out["loss_mask"], out["sample_index"], strict=True)
            if i == r
        ]
        check_samples_against_template(qtok, good[r], samples)


def test_raw_rows_with_mixed_types_and_sharegpt_tools(tmp_path, qtok):
    """Arguments stored as JSON text in one row and as an object in another render alike; ShareGPT's
    function_call / observation turns become a call and a result, its tools given as JSON text."""
    row = chats()[2]
    as_text = json.loads(json.dumps(row))
    as_text["messages"][2]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'
    sharegpt = {
        "tools": json.dumps([WEATHER]),
        "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {
                "from": "function_call",
                "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}),
            },
            {"from": "observation", "value": '{"temp_c": 12}'},
            {"from": "gpt", "value": _say("weather")},
        ],
    }
    outs = []
    for name, data in (("mixed.jsonl", [row, as_text]), ("sharegpt.jsonl", [sharegpt])):
        cfg = DataConfig(
            dataset=str(_write_jsonl(tmp_path / name, data)),
            cache_dir=str(tmp_path / "cache"),
            min_loss_tokens=1,
        )
        ds = load_raw_dataset(cfg)
        outs.append(tokenize_slice(ds, qtok, cfg, slice_indices(len(ds), rank=0, world=1)))
        assert set(outs[-1]["status"]) == {"ok"}
    out = outs[0]
    first = [ids for ids, i in zip(out["input_ids"], out["sample_index"], strict=True) if i == 0]
    second = [ids for ids, i in zip(out["input_ids"], out["sample_index"], strict=True) if i == 1]
    assert first == second  # '{"city": "Paris"}' as text renders like the object
    text = qtok.decode(outs[1]["input_ids"][-1])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert (
        '<tool_response>\n{"temp_c": 12}\n</tool_response>' in text
        and '"get_weather"' in text.split("<|im_start|>user")[0]
    )


def test_sample_ids_stay_unique_and_exactly_once_with_several_samples_per_row():
    epochs, world = Epochs(rows=13, epochs=2, seed=5, eval_samples=2), 3
    segments = {r: 1 + (r % 3) for r in range(13)}  # rows give 1, 2 or 3 samples
    produced, held = [], []
    import datasets

    for rank in range(world):
        mine = slice_indices(13, rank=rank, world=world)
        rows = [int(r) for r in mine for _ in range(segments[int(r)])]
        segs = [s for r in mine for s in range(segments[int(r)])]
        tok_ds = datasets.Dataset.from_dict(
            {
                "sample_index": rows,
                "segment": segs,
                "input_ids": [[1, 2]] * len(rows),
                "loss_mask": [[True, True]] * len(rows),
                "num_loss_tokens": [2] * len(rows),
                "status": ["ok"] * len(rows),
            }
        )
        pos, ids, _ = plan_epochs(tok_ds, mine, epochs, None)
        assert (np.asarray(rows)[pos] == epochs.row_of(ids)).all() and (
            np.asarray(segs)[pos] == epochs.segment_of(ids)
        ).all()
        for k in range(2):  # a row's samples follow each other, in segment order
            e = ids[epochs.epoch_of(ids) == k]
            assert (np.diff(epochs.segment_of(e))[np.diff(epochs.row_of(e)) == 0] == 1).all()
        produced += ids.tolist()
        held += held_out_plan(tok_ds, mine, epochs)[1].tolist()
        # resume: what a checkpoint trained is skipped, nothing else
        trained = SampleSet.from_indices(ids[: len(ids) // 2])
        assert plan_epochs(tok_ds, mine, epochs, trained)[1].tolist() == ids[len(ids) // 2 :].tolist()
    assert len(produced) == len(set(produced)) and not set(produced) & set(held)
    train_rows = [r for r in range(13) if r not in epochs.held_out()]
    assert len(produced) == 2 * sum(segments[r] for r in train_rows)
    assert sorted(epochs.row_of(held).tolist()) == sorted(
        r for r in epochs.held_out() for _ in range(segments[int(r)])
    )
    assert (epochs.ids(1, np.arange(13)) == np.arange(13) + 13).all()  # a row's first sample keeps its id


@pytest.mark.slow
def test_produced_shards_hold_the_generation_time_tokens(tmp_path, tiny_target):
    """dflash-produce over the chat shapes with the Qwen3-rules template; the shards read with plain zarr:
    every row trains, each assistant turn's tokens are the template's generation-time rendering."""
    import zarr
    from pipeline_helpers import produce_cmd, run

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    (target / "chat_template.jinja").write_text(TEMPLATE)
    rows = chats()
    data = _write_jsonl(tmp_path / "chats.jsonl", rows)
    spool = tmp_path / "spool"
    proc = run(produce_cmd(spool, target, data, "--run", "chat-shapes", "--max-length", "4096"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(
        rf"dflash-produce: 9 trainable samples; dropped 0 of 9 samples \({len(rows)} rows\)", proc.stderr
    ), proc.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(target)
    assert tok.chat_template == TEMPLATE
    by_row: dict[int, dict[int, tuple[list[int], list[bool]]]] = {}
    epochs = Epochs(rows=len(rows))
    for shard in sorted((spool / "ready").glob("*.zarr")):
        g = zarr.open_group(str(shard), mode="r")
        ids, mask, cu, sid = (g[a][:] for a in ("input_ids", "loss_mask", "cu_seqlens", "sample_index"))
        for k, s in enumerate(sid.tolist()):
            row, seg = int(epochs.row_of(s)), int(epochs.segment_of(s))
            by_row.setdefault(row, {})[seg] = (
                ids[cu[k] : cu[k + 1]].tolist(),
                mask[cu[k] : cu[k + 1]].astype(bool).tolist(),
            )
    assert sorted(by_row) == list(range(len(rows)))
    for r, row in enumerate(rows):
        samples = [by_row[r][s] for s in sorted(by_row[r])]
        assert sorted(by_row[r]) == list(range(len(samples)))
        check_samples_against_template(tok, row, samples)


def test_a_leading_assistant_turn_is_context_not_trained(qtok):
    """No generation prompt renders before the first message (transformers refuses an empty history), so an
    assistant turn that opens the row is context; a row that has nothing else is dropped, named."""
    greet = {"role": "assistant", "content": "Hello! Ask me about Python."}
    row = {
        "messages": [
            greet,
            {"role": "user", "content": "What is a list?"},
            {"role": "assistant", "content": _say("list")},
        ]
    }
    msgs, _ = normalize_conversation(row["messages"])
    [[(ids, mask)]] = tokenize_conversations(qtok, [msgs])
    trained = qtok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == "<think>\n\n</think>\n\n" + _say("list") + "<|im_end|>"  # the final turn's empty block
    assert "Hello! Ask me" in qtok.decode(ids)
    assert tokenize_conversations(qtok, [[greet]]) == ["bad:only a leading assistant turn"]


def test_raw_rows_name_the_other_format_when_the_format_is_given(qtok):
    """Rows read one by one (a file arrow cannot type) carry no file format; --format names the odd one."""
    from dflash.common.target.data import RAW_JSON_COLUMN

    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": _say("x")}]}
    openai = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _say("x")}]}
    batch = {RAW_JSON_COLUMN: [json.dumps(sharegpt), json.dumps(openai), "{oops"]}
    strict = _Tokenize(qtok, RAW_JSON_COLUMN, 4096, 1, np.arange(3), fmt="openai")(batch, [0, 1, 2])
    assert strict["status"] == ["bad:a ShareGPT row in an OpenAI-format file", "ok", "bad:unparseable"]
    assert _Tokenize(qtok, RAW_JSON_COLUMN, 4096, 1, np.arange(3))(batch, [0, 1, 2])["status"] == [
        "ok",
        "ok",
        "bad:unparseable",
    ]
