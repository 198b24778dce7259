"""Chat conversations to tokens with the target's own chat template, the loss mask (assistant turns only),
and the accounting of dropped rows.

Why the target's template: what the drafter learns to predict must be exactly what the target generates.
Result columns of ``tokenize_slice`` (one row per dataset row of the slice, bad rows included so they can
be counted): ``sample_index`` int64, ``input_ids`` int32[], ``loss_mask`` bool[], ``num_loss_tokens``
int32, ``status`` ("ok" | "short" | "bad:<reason>"). Reasons (``drop_reason`` turns a status into the
phrase the producer prints): unparseable (a line that is not JSON), not a list / empty / turn not an object
/ unknown role / empty content (the conversation's shape), no assistant turn, template error (the chat
template raised), over-long (enough supervised tokens, but --max-length cuts them below the minimum);
"short" is too few supervised tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Features, Sequence, Value

from dflash.common.target.data import _RAW, DataConfig, DataError, conversation_column

log = logging.getLogger(__name__)


_ROLE = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
}


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


_TOKENIZE_VERSION = 2  # bump when tokenize output changes, to invalidate datasets' map cache


def _text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep text parts only
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        if parts and all(isinstance(p, str) for p in parts):
            return "".join(parts)
    return None


def normalize_conversation(raw: Any) -> tuple[list[dict[str, str]] | None, str]:
    """[{role, content}] from an OpenAI or ShareGPT turn list, or (None, reason) for a bad row."""
    if isinstance(raw, dict):  # raw-JSON rows: the whole row
        raw = raw.get("messages", raw.get("conversations"))
    if not isinstance(raw, list) or not raw:
        return None, "not a list" if not isinstance(raw, list) else "empty"
    msgs: list[dict[str, str]] = []
    for turn in raw:
        if not isinstance(turn, dict):
            return None, "turn not an object"
        role = turn.get("role", turn.get("from"))
        content = _text(turn.get("content", turn.get("value")))
        if not isinstance(role, str) or role not in _ROLE:  # a list/dict role is unhashable: not a crash
            return None, "unknown role"
        if content is None or not content.strip():
            return None, "empty content"
        msgs.append({"role": _ROLE[role], "content": content})
    if not any(m["role"] == "assistant" for m in msgs):
        return None, "no assistant turn"
    return msgs, "ok"


def drop_reason(status: str, min_loss_tokens: int | None = None) -> str:
    """The phrase a producer prints for a dropped row's status ("short" -> "too short (< 32 supervised
    tokens)", "bad:no assistant turn" -> "no assistant turn")."""
    if status == "short":
        return "too short" + (f" (< {min_loss_tokens} supervised tokens)" if min_loss_tokens else "")
    return status.partition(":")[2] or status


def has_generation_tags(tokenizer) -> bool:
    return bool(_GENERATION_TAG.search(tokenizer.chat_template or ""))


def check_tokenizer(tokenizer, name: str = "") -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"tokenizer {name} has no chat template")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"tokenizer {name} is not a fast tokenizer (offsets are needed for the loss mask)")


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Tokens overlapping any char span (the rule transformers uses for {% generation %} masks)."""
    mask = [False] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = True
    return mask


def assistant_spans_by_prefix(tokenizer, msgs: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Render prefix by prefix: assistant turn i spans from the end of render(msgs[:i], generation prompt)
    to the end of render(msgs[:i+1]) minus trailing whitespace. Needs a prefix-stable template."""
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        head = (
            tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True) if i else ""
        )
        upto = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False)
        if not (upto.startswith(head) and full.startswith(upto)):
            raise ValueError("chat template renders differently as history (not prefix-stable)")
        spans.append((len(head), len(upto.rstrip())))
    return full, spans


def tokenize_conversations(
    tokenizer, convs: list[list[dict[str, str]]]
) -> list[tuple[list[int], list[bool]] | str]:
    """(input_ids, loss_mask) per conversation, or an error reason string for conversations the template
    rejects. Uses {% generation %} masks when the template has them, prefix rendering otherwise."""
    if not convs:
        return []
    if has_generation_tags(tokenizer):
        try:
            out = tokenizer.apply_chat_template(
                convs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return [
                (list(ids), [bool(x) for x in m])
                for ids, m in zip(out["input_ids"], out["assistant_masks"], strict=True)
            ]
        except Exception:  # noqa: BLE001 - a template may raise for one conversation; isolate it below
            if len(convs) > 1:
                return [r for c in convs for r in tokenize_conversations(tokenizer, [c])]
            return ["bad:template error"]
    results: list[tuple[list[int], list[bool]] | str] = []
    for msgs in convs:
        try:
            text, spans = assistant_spans_by_prefix(tokenizer, msgs)
        except Exception:  # noqa: BLE001 - template errors and unstable templates are per-row problems
            results.append("bad:template error")
            continue
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        results.append((list(enc["input_ids"]), _mask_from_spans(enc["offset_mapping"], spans)))
    return results


class _Tokenize:
    """The datasets.map function (a class so it pickles for num_proc)."""
    def __init__(self, tokenizer, column: str, max_length: int, min_loss_tokens: int, indices: np.ndarray):
        self.tokenizer, self.column = tokenizer, column
        self.max_length, self.min_loss_tokens = max_length, min_loss_tokens
        self.indices = indices  # position in the slice -> global sample index

    def __call__(self, batch: dict[str, list], positions: list[int]) -> dict[str, list]:
        raws = batch[self.column]
        if self.column == _RAW:
            raws = [_parse_raw(r) for r in raws]
        normalized = [(None, "unparseable") if r is _UNPARSEABLE else normalize_conversation(r) for r in raws]
        good = [i for i, (m, _) in enumerate(normalized) if m is not None]
        toks = tokenize_conversations(self.tokenizer, [normalized[i][0] for i in good])
        by_row: dict[int, Any] = dict(zip(good, toks, strict=True))
        out: dict[str, list] = {
            "sample_index": [int(self.indices[p]) for p in positions],
            "input_ids": [],
            "loss_mask": [],
            "num_loss_tokens": [],
            "status": [],
        }
        for i, (_, reason) in enumerate(normalized):
            res = by_row.get(i, f"bad:{reason}")
            if isinstance(res, str):
                ids, mask, status = [], [], res
            else:
                ids, mask = res[0][: self.max_length], res[1][: self.max_length]
                if sum(mask) >= self.min_loss_tokens:
                    status = "ok"
                elif sum(res[1]) >= self.min_loss_tokens:
                    status, ids, mask = "bad:over-long", [], []  # --max-length cut its supervision
                else:
                    status = "short"
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["num_loss_tokens"].append(int(sum(mask)))
            out["status"].append(status)
        return out


_UNPARSEABLE = object()


def _parse_raw(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, json.JSONDecodeError):
        return _UNPARSEABLE


def _fingerprint(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _tokenizer_digest(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


def tokenize_slice(ds, tokenizer, cfg: DataConfig, indices: np.ndarray):
    """Tokenize the rows `indices` of `ds` (cached by datasets; see module docstring for the columns)."""
    column = conversation_column(ds, cfg.format)
    indices = np.asarray(indices, dtype=np.int64)
    sub = ds.select_columns([column])
    if not np.array_equal(indices, np.arange(len(ds))):
        sub = sub.select(indices)  # an indices mapping: no copy of the rows
    features = Features(
        {
            "sample_index": Value("int64"),
            "input_ids": Sequence(Value("int32")),
            "loss_mask": Sequence(Value("bool")),
            "num_loss_tokens": Value("int32"),
            "status": Value("string"),
        }
    )
    fingerprint = _fingerprint(
        _TOKENIZE_VERSION,
        getattr(ds, "_fingerprint", None),
        hashlib.sha256(indices.tobytes()).hexdigest(),
        tokenizer.chat_template,
        tokenizer.name_or_path,
        len(tokenizer),
        _tokenizer_digest(tokenizer),
        column,
        cfg.max_length,
        cfg.min_loss_tokens,
    )
    fn = _Tokenize(tokenizer, column, cfg.max_length, cfg.min_loss_tokens, indices)
    num_proc = cfg.num_proc if cfg.num_proc and cfg.num_proc > 1 and len(sub) >= 2 * cfg.num_proc else None
    return sub.map(
        fn,
        batched=True,
        with_indices=True,
        batch_size=256,
        remove_columns=[column],
        features=features,
        num_proc=num_proc,
        new_fingerprint=fingerprint,
        desc="tokenize",
    )


def drop_summary(
    tok_ds, raw_ds=None, column: str | None = None, *, min_loss_tokens: int | None = None
) -> dict:
    """What tokenization kept and dropped: ``{"rows", "ok", "dropped", "reasons": {phrase: count},
    "first": {phrase: "row <global index>: <first 60 chars of the raw row>"}}`` (counted with pyarrow,
    no Python loop over rows)."""
    if len(tok_ds) == 0 or "status" not in tok_ds.column_names:
        return {"rows": 0, "ok": 0, "dropped": 0, "reasons": {}, "first": {}}
    status = tok_ds.with_format("arrow")["status"]
    index = tok_ds.with_format("arrow")["sample_index"]
    counts = {str(v["values"]): int(v["counts"]) for v in pc.value_counts(status).to_pylist()}
    reasons: dict[str, int] = {}
    first: dict[str, str] = {}
    for st, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        if st == "ok":
            continue
        phrase = drop_reason(st, min_loss_tokens)
        reasons[phrase] = reasons.get(phrase, 0) + n
        if phrase not in first:
            row = int(index[pc.index(status, st).as_py()].as_py())
            snippet = ""
            if raw_ds is not None and column is not None:
                try:
                    snippet = ": " + repr(str(raw_ds[row][column]))[:60]
                except (IndexError, KeyError, TypeError):
                    snippet = ""
            first[phrase] = f"row {row}{snippet}"
    ok = counts.get("ok", 0)
    return {"rows": len(tok_ds), "ok": ok, "dropped": len(tok_ds) - ok, "reasons": reasons, "first": first}


def campaign_counts(tok_ds, exclude: np.ndarray | None = None) -> dict:
    """What one epoch of the tokenized slice gives: ``{"samples", "tokens", "loss_tokens"}`` of its kept
    rows, minus the positions ``exclude`` (held out); counted with pyarrow (dflash.common.contract.epochs.Campaign)."""
    if len(tok_ds) == 0 or "status" not in tok_ds.column_names:
        return {"samples": 0, "tokens": 0, "loss_tokens": 0}
    table = tok_ds.with_format("arrow")[:]
    ok = pc.equal(table["status"], "ok")
    if exclude is not None and len(exclude):
        keep = np.ones(len(tok_ds), dtype=bool)
        keep[np.asarray(exclude, dtype=np.int64)] = False
        ok = pc.and_(ok, pa.array(keep))
    lengths = pc.filter(pc.list_value_length(table["input_ids"]), ok)
    loss = pc.filter(table["num_loss_tokens"], ok)
    return {
        "samples": int(pc.sum(ok.cast("int64")).as_py() or 0),
        "tokens": int(pc.sum(lengths).as_py() or 0),
        "loss_tokens": int(pc.sum(loss).as_py() or 0),
    }


def format_drops(summary: dict) -> str:
    """``dropped 3 of 80 rows: unparseable 2 (first: row 5: '{oops'), no assistant turn 1 (first: row 3)``."""
    if not summary.get("dropped"):
        return f"dropped 0 of {summary.get('rows', 0)} rows"
    parts = [f"{r} {n} (first: {summary['first'].get(r, '?')})" for r, n in summary["reasons"].items()]
    return f"dropped {summary['dropped']} of {summary['rows']} rows: " + ", ".join(parts)
