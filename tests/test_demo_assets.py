"""The shipped demo assets: tokenizer + chat template, tiny target config, real-text chat dataset."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dflash.tools.demo.assets import (
    MASK_TOKEN,
    build_tiny_target,
    demo_dataset_path,
    distilled_dataset_path,
    materialize_tiny_target,
    tiny_target_dir,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_target_dir())


@pytest.fixture(scope="module")
def rows():
    with open(demo_dataset_path(), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_tokenizer_specials_and_template(tok):
    cfg = AutoConfig.from_pretrained(tiny_target_dir())
    assert cfg.model_type == "qwen3" and not cfg.tie_word_embeddings
    assert cfg.vocab_size == len(tok)
    ids = {
        t: tok.convert_tokens_to_ids(t) for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]
    }
    assert len(set(ids.values())) == 4 and tok.unk_token_id not in ids.values()
    assert tok.pad_token_id == ids["<|endoftext|>"] and tok.eos_token_id == ids["<|im_end|>"]
    assert tok.mask_token_id == ids[MASK_TOKEN] == cfg.mask_token_id
    assert "{% generation %}" in tok.chat_template.replace("{%- generation %}", "{% generation %}")
    # The mask token is one token and never produced by ordinary text.
    assert tok.encode(MASK_TOKEN, add_special_tokens=False) == [ids[MASK_TOKEN]]
    text = "What does `json.dumps` do?\n\n  Serialize obj.  "
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_layer_ids_distinct_for_tiny_target():
    cfg = AutoConfig.from_pretrained(tiny_target_dir())
    assert cfg.num_hidden_layers - 3 >= 5  # K=5 ids from 1 to L-3 are distinct integers


def test_dataset_is_real_openai_chat(rows):
    assert 200 <= len(rows) <= 1000
    assert demo_dataset_path().stat().st_size < 600_000
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids)
    for r in rows:
        msgs = r["messages"]
        assert isinstance(msgs, list) and msgs
        assert all(set(m) == {"role", "content"} and m["content"].strip() for m in msgs)
        assert {m["role"] for m in msgs} <= {"system", "user", "assistant"}
        assert msgs[-1]["role"] == "assistant"
    # Real prose, not generated noise: a known docstring is in there somewhere.
    answers = " ".join(m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant")
    assert len(re.findall(r"\b(the|a|of|is|to)\b", answers)) > 3000


def test_assistant_mask_marks_content_and_end_of_turn(tok, rows):
    msgs = rows[0]["messages"]
    out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    marked = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    expected = "".join(m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant")
    assert marked == expected


def test_build_tiny_target_deterministic_and_rng_neutral():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = build_tiny_target(seed=0, weights="random")
    assert torch.equal(torch.random.get_rng_state(), before)
    b = build_tiny_target(seed=0, weights="random")
    c = build_tiny_target(seed=1, weights="random")
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(
        sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"]
    )
    bf = build_tiny_target(dtype=torch.bfloat16, seed=0, weights="random")
    assert bf.dtype == torch.bfloat16
    assert torch.equal(bf.state_dict()["lm_head.weight"], sa["lm_head.weight"].bfloat16())


def test_the_default_target_is_the_shipped_trained_one():
    trained = build_tiny_target().state_dict()
    random = build_tiny_target(weights="random").state_dict()
    assert trained.keys() == random.keys()
    assert not torch.equal(trained["lm_head.weight"], random["lm_head.weight"])
    # stored in bf16: fp32 holds the weights exactly, so every dtype is a rounding of the same numbers
    assert all(torch.equal(v, v.bfloat16().float()) for v in trained.values())
    assert (tiny_target_dir() / "model.safetensors").stat().st_size < 16_000_000
    with pytest.raises(ValueError, match="weights must be"):
        build_tiny_target(weights="pretrained")


def test_shipped_greedy_answers_are_text_not_loops(tok, rows):
    """The trained target's answers (what the demo trains on) to the bundled prompts: prose, not the
    junk loops of a random target ("ventventvent...")."""
    with open(distilled_dataset_path(), encoding="utf-8") as f:
        distilled = [json.loads(line) for line in f]
    prompts = {r["id"]: [m for m in r["messages"][: _first_answer(r)]] for r in rows}
    assert len(distilled) >= 0.8 * len(rows)  # answers with a clean prefix of >= 40 tokens
    distinct = []
    for r in distilled:
        i = _first_answer(r)
        assert r["messages"][:i] == prompts[r["id"]] and r["messages"][i:][0]["role"] == "assistant"
        ids = tok.encode(r["messages"][i]["content"], add_special_tokens=False)
        distinct.append(len(set(ids)) / len(ids))
    assert sum(distinct) / len(distinct) > 0.4, sorted(distinct)[:10]
    words = " ".join(r["messages"][-1]["content"] for r in distilled)
    assert len(re.findall(r"\b(the|a|of|is|to)\b", words)) > 1000


def _first_answer(row: dict) -> int:
    return next(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")


def test_materialize_roundtrip(tmp_path):
    path = materialize_tiny_target(tmp_path / "target")
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(path)
    ref = build_tiny_target(seed=0).state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in loaded.state_dict().items())
    assert (
        AutoTokenizer.from_pretrained(path).chat_template
        == AutoTokenizer.from_pretrained(tiny_target_dir()).chat_template
    )
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert materialize_tiny_target(path) == path and (path / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.pipeline
def test_assets_rebuild_identically():
    recorded = re.search(r"Python (\d+\.\d+\.\d+)", (tiny_target_dir().parent / "README.md").read_text())
    if recorded is None or recorded.group(1) != sys.version.split()[0]:
        pytest.skip("docstrings depend on the Python version the assets were built with")
    res = subprocess.run(
        [sys.executable, str(ROOT / "ops" / "make_demo_assets.py"), "--check"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr + res.stdout
