"""Producer data: loading, format detection, loss masks from the real chat template, bad rows, splits."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from transformers import AutoTokenizer

from dflash.common.target.chat import (
    check_tokenizer,
    has_generation_tags,
    tokenize_conversations,
    tokenize_slice,
)
from dflash.common.target.data import (
    DataConfig,
    DataError,
    conversation_column,
    load_raw_dataset,
    slice_indices,
)
from dflash.tools.demo.assets import demo_dataset_path, tiny_target_dir


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_target_dir())


@pytest.fixture(scope="module")
def plain_tok():
    """The same tokenizer with a template lacking {% generation %}: exercises the prefix-render fallback."""
    t = AutoTokenizer.from_pretrained(tiny_target_dir())
    t.chat_template = t.chat_template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    assert "generation %}" not in t.chat_template and not has_generation_tags(t)
    return t


@pytest.fixture(scope="module")
def rows():
    with open(demo_dataset_path(), encoding="utf-8") as f:
        return [json.loads(line) for line in f][:60]


def _write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def _sharegpt(msgs):
    role = {"user": "human", "assistant": "gpt", "system": "system"}
    return [{"from": role[m["role"]], "value": m["content"]} for m in msgs]


def _marked_text(tokenizer, ids, mask):
    return tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])


@pytest.mark.parametrize("which", ["generation", "fallback"])
def test_loss_mask_is_exactly_assistant_content(tok, plain_tok, rows, which):
    t = tok if which == "generation" else plain_tok
    assert has_generation_tags(tok)
    multi = [r["messages"] for r in rows if sum(m["role"] == "assistant" for m in r["messages"]) > 1]
    assert multi, "the demo data has multi-turn conversations"
    convs = [r["messages"] for r in rows[:20]] + multi[:5]
    for msgs, [(ids, mask)] in zip(convs, tokenize_conversations(t, convs), strict=True):
        expected = "".join(m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant")
        assert _marked_text(t, ids, mask) == expected
        # Everything outside the marks is the prompt side: system/user turns and role headers.
        unmarked = t.decode([i for i, m in zip(ids, mask, strict=True) if not m])
        assert all(m["content"] in unmarked for m in msgs if m["role"] != "assistant")


def test_fallback_equals_generation_masks(tok, plain_tok, rows):
    convs = [r["messages"] for r in rows]
    assert tokenize_conversations(tok, convs) == tokenize_conversations(plain_tok, convs)


def test_openai_and_sharegpt_give_identical_samples(tmp_path, tok, rows):
    a = _write_jsonl(tmp_path / "openai.jsonl", [{"messages": r["messages"]} for r in rows[:12]])
    b = _write_jsonl(
        tmp_path / "sharegpt.jsonl", [{"conversations": _sharegpt(r["messages"])} for r in rows[:12]]
    )
    outs = []
    for path in (a, b):
        cfg = DataConfig(dataset=str(path), cache_dir=str(tmp_path / "cache"), min_loss_tokens=1)
        ds = load_raw_dataset(cfg)
        outs.append(tokenize_slice(ds, tok, cfg, slice_indices(len(ds), rank=0, world=1)))
    assert outs[0]["input_ids"] == outs[1]["input_ids"] and outs[0]["loss_mask"] == outs[1]["loss_mask"]
    assert outs[0]["sample_index"] == list(range(12))


def test_bad_rows_are_counted_not_fatal(tmp_path, tok, rows):
    good = {"messages": rows[0]["messages"]}
    data = [
        good,
        {"messages": [{"role": "user", "content": "hi"}]},  # no assistant turn
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},  # empty
        {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x" * 50}]},
        {"messages": "not a list"},  # mixed types: the file is read as raw JSON rows
        {"messages": None},
        {
            "messages": [{"role": "user", "content": "What?"}, {"role": "assistant", "content": "Yes."}]
        },  # short
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Parts?"}]},
                rows[1]["messages"][-1],
            ]
        },
        good,
    ]
    path = _write_jsonl(tmp_path / "bad.jsonl", data)
    cfg = DataConfig(dataset=str(path), cache_dir=str(tmp_path / "cache"), min_loss_tokens=32)
    ds = load_raw_dataset(cfg)
    assert len(ds) == len(data)
    out = tokenize_slice(ds, tok, cfg, slice_indices(len(ds), rank=0, world=1))
    status = out["status"]
    assert status[0] == status[7] == status[8] == "ok"
    assert status[1] == "bad:no assistant turn"
    assert status[2] == "bad:only empty assistant turns"  # an empty assistant turn drops that turn
    assert status[3] == "bad:unknown role"
    assert status[4] == "bad:not a list"
    assert status[5].startswith("bad:")
    assert status[6] == "short"
    assert Counter(s.split(":")[0] for s in status) == {"ok": 3, "bad": 5, "short": 1}
    assert out["sample_index"] == list(range(len(data)))


def test_truncation_and_min_loss_tokens(tmp_path, tok, rows):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"messages": r["messages"]} for r in rows[:20]])
    cfg = DataConfig(dataset=str(path), cache_dir=str(tmp_path / "cache"), max_length=64, min_loss_tokens=32)
    ds = load_raw_dataset(cfg)
    out = tokenize_slice(ds, tok, cfg, slice_indices(len(ds), rank=0, world=1))
    for ids, mask, n, st in zip(
        out["input_ids"], out["loss_mask"], out["num_loss_tokens"], out["status"], strict=True
    ):
        assert len(ids) == len(mask) <= 64 and sum(mask) == n
        # too few supervised tokens: "short"; enough, but --max-length cut them: "bad:over-long" (no tokens)
        assert st == "ok" if n >= 32 else st in ("short", "bad:over-long")
    assert "bad:over-long" in out["status"] and "ok" in out["status"]


def test_split_is_disjoint_and_covers_everything():
    world = 6  # 3 producers x 2 nodes
    parts = [slice_indices(101, rank=r, world=world) for r in range(world)]
    allidx = np.concatenate(parts)
    assert len(allidx) == 101 and set(allidx.tolist()) == set(range(101))
    assert all((p % world == r).all() for r, p in enumerate(parts))
    skipped = slice_indices(101, rank=1, world=world, skip=[1, 7, 8, 50])
    assert skipped.tolist() == [i for i in range(1, 101, world) if i not in (1, 7)]
    with pytest.raises(ValueError, match="rank"):
        slice_indices(10, rank=2, world=2)


def test_slice_tokenization_keeps_global_indices(tmp_path, tok, rows):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"messages": r["messages"]} for r in rows[:15]])
    cfg = DataConfig(dataset=str(path), cache_dir=str(tmp_path / "cache"))
    ds = load_raw_dataset(cfg)
    idx = slice_indices(len(ds), rank=1, world=3, skip=[4])
    out = tokenize_slice(ds, tok, cfg, idx)
    assert out["sample_index"] == [1, 7, 10, 13]
    ref = tok.apply_chat_template(rows[7]["messages"], tokenize=True, return_dict=True)["input_ids"]
    assert out[1]["input_ids"] == ref[: cfg.max_length]


def test_parquet_and_save_to_disk(tmp_path, rows):
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_list([{"conversations": _sharegpt(r["messages"])} for r in rows[:5]])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved"))
    for spec in (tmp_path / "d.parquet", tmp_path / "saved"):
        loaded = load_raw_dataset(DataConfig(dataset=str(spec), cache_dir=str(tmp_path / "cache")))
        assert len(loaded) == 5 and conversation_column(loaded, "auto") == "conversations"


def test_user_errors_are_one_line(tmp_path, tok):
    with pytest.raises(DataError, match="does not exist"):
        load_raw_dataset(DataConfig(dataset=str(tmp_path / "missing.jsonl")))
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(DataError, match="unsupported"):
        load_raw_dataset(DataConfig(dataset=str(tmp_path / "x.txt")))
    path = _write_jsonl(tmp_path / "cols.jsonl", [{"prompt": "a", "answer": "b"}])
    ds = load_raw_dataset(DataConfig(dataset=str(path), cache_dir=str(tmp_path / "cache")))
    with pytest.raises(
        DataError, match=r"no 'messages' or 'conversations' column \(columns: prompt, answer\)"
    ):
        conversation_column(ds, "auto")
    with pytest.raises(DataError, match="no 'conversations' column"):
        conversation_column(ds, "sharegpt")
    t = AutoTokenizer.from_pretrained(tiny_target_dir())
    t.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        check_tokenizer(t, "tiny")
    with pytest.raises(ValueError, match="format"):
        DataConfig(dataset="x", format="alpaca")
    for err in (DataError("a"), ValueError("b")):
        assert "\n" not in str(err)
