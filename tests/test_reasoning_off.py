"""``--no-train-reasoning`` (DataConfig.train_reasoning off) on every chat shape: no reasoning token is trained,
whether the reasoning came as ``reasoning_content``, as ``reasoning``, or written into the content as a
``<think>`` block (closed, or opened by the generation prompt as Qwen3.5/3.6 do), and not the empty ``<think>``
block a Qwen3-family template adds to the last turn either; every turn's answer is trained; a row never gives
more samples or tokens than with its reasoning. Templates: tests/data/qwen3_rules.jinja (the Qwen3 history
rule), the same with {% generation %} marks, and the demo's ChatML."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest
from test_chat_shapes import TEMPLATE, chats
from transformers import AutoTokenizer

from dflash.common.contract.epochs import Epochs
from dflash.common.target.chat import tokenize_conversations, tokenize_slice
from dflash.common.target.conversation import normalize_conversation, without_inline_reasoning
from dflash.common.target.data import DataConfig, load_raw_dataset, slice_indices
from dflash.common.target.drops import campaign_counts
from dflash.producer.slice_plan import plan_epochs
from dflash.tools.demo.assets import demo_dataset_path, tiny_target_dir

EMPTY_THINK = re.compile(r"^<think>\s*</think>\s*")
# the assistant part of a turn marked as generated: what a template author who trains the block would write
TAGGED = TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' }}\n        {%- set thought",
    "{{- '<|im_start|>assistant\\n' }}{%- generation %}\n        {%- set thought",
).replace(
    "{{- '<|im_end|>\\n' }}\n    {%- elif m.role == 'tool' %}",
    "{{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}\n    {%- elif m.role == 'tool' %}",
)


@pytest.fixture(scope="module")
def qtok():
    t = AutoTokenizer.from_pretrained(tiny_target_dir())
    t.chat_template = TEMPLATE
    return t


def _reasoning(m: dict) -> str | None:
    return m.get("reasoning_content")


def shapes() -> dict[str, list[dict]]:
    """The chat-shape rows (reasoning, multi-turn, tool-call loops, parallel calls, an empty turn) with their
    reasoning given each way a dataset gives it."""
    rows = chats()
    out = {"reasoning_content": rows}
    renamed = copy.deepcopy(rows)
    for m in (m for r in renamed for m in r["messages"] if _reasoning(m)):
        m["reasoning"] = m.pop("reasoning_content")
    out["reasoning"] = renamed
    for name, fmt in (
        ("inline", "<think>\n{r}\n</think>\n\n{c}"),
        ("opened by the prompt", "{r}\n</think>\n\n{c}"),
    ):
        inline = copy.deepcopy(rows)
        for m in (m for r in inline for m in r["messages"] if _reasoning(m)):
            m["content"] = fmt.format(r=m.pop("reasoning_content"), c=m.get("content") or "")
        out[name] = inline
    return out


def _answered_without_thinking(row: dict) -> dict:
    """The row as the target would have written it without thinking: no reasoning anywhere."""
    row = copy.deepcopy(row)
    for m in row["messages"]:
        m.pop("reasoning_content", None)
    return row


def expected_answers(tok, row: dict) -> list[str]:
    """Each assistant turn as the template renders it when the target generates it without thinking: its
    content, tool calls and end-of-turn token, without the empty <think> block the template adds (context)."""
    msgs, _ = normalize_conversation(_answered_without_thinking(row)["messages"])
    out = []
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and i > 0:
            head = tok.apply_chat_template(
                msgs[:i], tools=row.get("tools"), tokenize=False, add_generation_prompt=True
            )
            turn = tok.apply_chat_template(msgs[: i + 1], tools=row.get("tools"), tokenize=False)
            out.append(EMPTY_THINK.sub("", turn[len(head) :].rstrip()))
    return out


def trained_runs(tok, samples) -> list[str]:
    """The trained stretches of a row's samples, in order, as text."""
    runs = []
    for ids, mask in samples:
        cur: list[int] = []
        for t, m in [*zip(ids, mask, strict=True), (None, False)]:
            if m:
                cur.append(t)
            elif cur:
                runs.append(tok.decode(cur))
                cur = []
    return runs


def _tokenize(tok, rows: list[dict], *, train_reasoning: bool):
    convs = [normalize_conversation(r["messages"], train_reasoning=train_reasoning)[0] for r in rows]
    tools = [r.get("tools") for r in rows]
    return tokenize_conversations(tok, convs, tools, train_reasoning=train_reasoning)


@pytest.mark.parametrize("template", ["qwen3 rules", "qwen3 rules, generation marks"])
def test_no_reasoning_token_is_trained_and_every_answer_is(qtok, template):
    tok = qtok
    if template != "qwen3 rules":
        tok = AutoTokenizer.from_pretrained(tiny_target_dir())
        tok.chat_template = TAGGED
        assert TAGGED.count("generation %}") == 2
    base = chats()
    thoughts = [_reasoning(m) for r in base for m in r["messages"] if _reasoning(m)]
    assert len(thoughts) == 9
    results = {name: _tokenize(tok, rows, train_reasoning=False) for name, rows in shapes().items()}
    for name, res in results.items():
        assert res == results["reasoning_content"], f"{name}: trained unlike the same rows' other form"
        for row, samples in zip(base, res, strict=True):
            assert not isinstance(samples, str), samples
            runs = trained_runs(tok, samples)
            assert runs == expected_answers(qtok, row), name
            trained = "".join(runs)
            assert "<think>" not in trained and "</think>" not in trained
            assert not any(t in tok.decode(ids) for t in thoughts for ids, _ in samples)
    if (
        template == "qwen3 rules, generation marks"
    ):  # the marks trained the empty block before it was unmarked
        on = _tokenize(tok, [_answered_without_thinking(r) for r in base], train_reasoning=True)
        assert any("<think>" in run for res in on for run in trained_runs(tok, res))


def test_each_sample_is_the_rendering_its_last_turn_was_generated_in(qtok):
    """The last turn of each sample has its exact generation-time context (the empty block included, as
    context); the turns before it in that sample are rendered as history, as the target saw them then."""
    rows = chats()
    for row, samples in zip(rows, _tokenize(qtok, rows, train_reasoning=False), strict=True):
        msgs, _ = normalize_conversation(_answered_without_thinking(row)["messages"])
        renderings = {
            qtok.apply_chat_template(msgs[: i + 1], tools=row.get("tools"), tokenize=False)
            for i, m in enumerate(msgs)
            if m["role"] == "assistant"
        }
        assert len(samples) == 1  # no reasoning: nothing of the history changes but the empty blocks
        assert all(qtok.decode(ids) in renderings for ids, _ in samples)


def test_inline_reasoning_is_cut_from_the_content():
    cases = {
        "<think>\nplan\n</think>\n\nThe answer.": "The answer.",
        "plan, opened by the prompt\n</think>\n\nThe answer.": "The answer.",
        "<think>a</think>One. <think>b</think>Two.": "One. Two.",
        "The answer. <think>cut off mid-thought": "The answer.",
        "<think>only a thought</think>": "",
        "No tags at all.\n": "No tags at all.\n",
    }
    assert {c: without_inline_reasoning(c) for c in cases} == cases
    row = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>only a thought</think>"},
    ]
    assert normalize_conversation(row, train_reasoning=False) == (None, "only empty assistant turns")
    assert normalize_conversation(row)[0][1]["content"] == "<think>only a thought</think>"  # on: as given
    sharegpt = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "<think>\nhm\n</think>\n\nAnswer."}]
    assert normalize_conversation(sharegpt, train_reasoning=False)[0][1] == {
        "role": "assistant",
        "content": "Answer.",
    }


def _counts(tmp_path: Path, tok, data: Path, *, train_reasoning: bool):
    cfg = DataConfig(
        dataset=str(data),
        cache_dir=str(tmp_path / "cache"),
        min_loss_tokens=32,
        train_reasoning=train_reasoning,
    )
    ds = load_raw_dataset(cfg)
    out = tokenize_slice(ds, tok, cfg, slice_indices(len(ds), rank=0, world=1))
    return out, campaign_counts(out)


def test_the_measured_effect(tmp_path, qtok):
    """The figures docs/producer.md and the flag's help give ("--no-train-reasoning"): samples, tokens and
    supervised tokens of one epoch with and without, as dflash-produce counts them (--block-size 16:
    at least 32 supervised tokens, --max-length 4096). Never more with it off; sample ids stay unique."""
    chatml = AutoTokenizer.from_pretrained(tiny_target_dir())
    shape_files = {}
    for name, rows in shapes().items():
        shape_files[name] = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        shape_files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    measured = {}
    for name, data, tok in [
        ("chat shapes, reasoning_content", shape_files["reasoning_content"], qtok),
        ("chat shapes, <think> in content", shape_files["inline"], qtok),
        ("demo chats, qwen3 rules", demo_dataset_path(), qtok),
        ("demo chats, chatml", demo_dataset_path(), chatml),
    ]:
        on_ds, on = _counts(tmp_path, tok, data, train_reasoning=True)
        off_ds, off = _counts(tmp_path, tok, data, train_reasoning=False)
        measured[name] = tuple(c[k] for c in (on, off) for k in ("samples", "tokens", "loss_tokens"))
        assert all(off[k] <= on[k] for k in on), (name, on, off)
        rows = len(set(off_ds["sample_index"]))
        epochs = Epochs(rows=rows, epochs=2)
        _, ids, _ = plan_epochs(off_ds, np.arange(rows), epochs, None)
        assert len(ids) == len(set(ids.tolist())) == 2 * off["samples"]
    assert measured == {
        "chat shapes, reasoning_content": (9, 2360, 805, 5, 1345, 568),
        "chat shapes, <think> in content": (11, 3302, 941, 5, 1345, 568),
        "demo chats, qwen3 rules": (432, 88577, 59678, 320, 70529, 53568),
        "demo chats, chatml": (320, 65729, 53568, 320, 65729, 53568),
    }
