"""Chat conversations to tokens with the target's own chat template, the loss mask (assistant turns only),
and the accounting of dropped rows.

Why the target's template, and at generation time: what the drafter learns to predict must be exactly
what the target generates, in the context the target had when it generated it (its reasoning, its tool
calls, the tool results, the tools listed by the template). Templates that render history unlike
generation (the Qwen3 family strips earlier reasoning) make a row several samples (which renderings, and
the characters each trains: renderings.py). Result columns of ``tokenize_slice`` (one row per sample of
each dataset row of the slice, one per bad row so they can be counted): ``sample_index`` int64 (the
dataset row), ``segment`` int32 (which sample of its row), ``input_ids`` int32[], ``loss_mask`` bool[],
``num_loss_tokens`` int32, ``status`` ("ok" | "short" | "bad:<reason>"). Reasons (``drops.drop_reason``
turns a status into the phrase the producer prints; conversation.py decides the row's shape):
unparseable (a line that is not JSON), the conversation's shape (not a list, empty, turn not an object,
unknown role, content not text, a tool call without a function name, tools not JSON, a row of the other
format under an explicit format), no assistant turn / only empty assistant turns, template error (the
chat template raised), over-long (enough supervised tokens, but --max-length cuts them below the
minimum); "short" is too few supervised tokens. docs/producer.md says how each chat shape becomes tokens.
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Any

import numpy as np
from datasets import Features, Sequence, Value

from dflash.common.target.conversation import BadRow
from dflash.common.target.data import (
    FORMAT_COLUMN,
    DataConfig,
    DataError,
    conversation_column,
    read_row,
)
from dflash.common.target.renderings import empty_think_blocks, generation_renderings, render

log = logging.getLogger(__name__)


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


_TOKENIZE_VERSION = 4  # bump when tokenize output changes, to invalidate datasets' map cache


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


Sample = tuple[list[int], list[bool]]


def tokenize_conversations(
    tokenizer,
    convs: list[list[dict[str, Any]]],
    tools: list[list[dict] | None] | None = None,
    *,
    train_reasoning: bool = True,
) -> list[list[Sample] | str]:
    """The samples (input_ids, loss_mask) of each conversation, or an error reason for conversations the
    template rejects. A template with {% generation %} marks: one sample, its marks are the mask (the
    template's author says what is generated). Otherwise generation_renderings: usually one sample,
    several where the template renders history unlike generation. ``train_reasoning`` off (the rows carry
    no reasoning: normalize_conversation removed it): no empty ``<think>`` block a template adds is
    trained either, whichever way the mask is made."""
    if not convs:
        return []
    tools = tools if tools is not None else [None] * len(convs)
    if has_generation_tags(tokenizer):
        results = _tokenize_by_generation_tags(tokenizer, convs, tools)
        if train_reasoning:
            return results
        return [
            _unmark_empty_think(tokenizer, c, t, r) for c, t, r in zip(convs, tools, results, strict=True)
        ]
    results: list[list[Sample] | str] = []
    for msgs, row_tools in zip(convs, tools, strict=True):
        try:
            groups = generation_renderings(tokenizer, msgs, row_tools, train_reasoning=train_reasoning)
        except BadRow as err:
            results.append(f"bad:{err}")
            continue
        samples = []
        for text, spans in groups:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            samples.append((list(enc["input_ids"]), _mask_from_spans(enc["offset_mapping"], spans)))
        results.append(samples)
    return results


def _tokenize_by_generation_tags(
    tokenizer, convs: list[list[dict[str, Any]]], tools: list[list[dict] | None]
) -> list[list[Sample] | str]:
    """One sample per conversation, masked by the template's {% generation %} marks: one batched call
    where no row lists tools (``tools=`` is one list per call), a call per row otherwise or when a row
    makes the template raise (that row alone is a "template error")."""
    if len(convs) > 1 and any(t is not None for t in tools):  # tools= is one list for the whole batch
        return [
            r
            for c, t in zip(convs, tools, strict=True)
            for r in _tokenize_by_generation_tags(tokenizer, [c], [t])
        ]
    try:
        out = tokenizer.apply_chat_template(
            convs, tools=tools[0], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return [
            [(list(ids), [bool(x) for x in m])]
            for ids, m in zip(out["input_ids"], out["assistant_masks"], strict=True)
        ]
    except Exception:  # noqa: BLE001 - a template may raise for one conversation; isolate it below
        if len(convs) > 1:
            return [r for c in convs for r in _tokenize_by_generation_tags(tokenizer, [c], [None])]
        return ["bad:template error"]


def _unmark_empty_think(
    tokenizer, msgs: list[dict[str, Any]], tools: list[dict] | None, samples: list[Sample] | str
) -> list[Sample] | str:
    """A {% generation %}-marked sample with its empty ``<think>`` blocks unmarked: located in the rendered
    text, whose tokens are the sample's (transformers tokenizes the same text, no special tokens added)."""
    if isinstance(samples, str):
        return samples
    try:
        text = render(tokenizer, msgs, tools)
    except BadRow as err:
        return f"bad:{err}"
    blocks = empty_think_blocks(text)
    [(ids, mask)] = samples
    if not blocks:
        return samples
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != ids:  # never seen: transformers tokenizes this very text
        return "bad:template renders unlike its tokens"
    inside = _mask_from_spans(enc["offset_mapping"], blocks)
    return [(ids, [m and not b for m, b in zip(mask, inside, strict=True)])]


class _Tokenize:
    """The datasets.map function (a class so it pickles for num_proc). One input row gives one output row
    per sample (``segment`` 0, 1, ...), or one row of status "bad:<reason>" (segment 0)."""

    def __init__(
        self,
        tokenizer,
        column: str,
        max_length: int,
        min_loss_tokens: int,
        indices: np.ndarray,
        *,
        train_reasoning: bool = True,
        fmt: str = "auto",
    ):
        self.tokenizer, self.column = tokenizer, column
        self.max_length, self.min_loss_tokens = max_length, min_loss_tokens
        self.indices = indices  # position in the slice -> global sample index
        self.train_reasoning, self.fmt = train_reasoning, fmt

    def __call__(self, batch: dict[str, list], positions: list[int]) -> dict[str, list]:
        read = [  # each row as dflash-regenerate reads it too (one reading: data.read_row)
            read_row(
                {c: batch[c][i] for c in batch}, self.column, self.fmt, train_reasoning=self.train_reasoning
            )
            for i in range(len(positions))
        ]
        good = [i for i, r in enumerate(read) if r.messages is not None]
        toks = tokenize_conversations(
            self.tokenizer,
            [read[i].messages for i in good],
            [read[i].tools for i in good],
            train_reasoning=self.train_reasoning,
        )
        by_row: dict[int, Any] = dict(zip(good, toks, strict=True))
        columns = ("sample_index", "segment", "input_ids", "loss_mask", "num_loss_tokens", "status")
        out: dict[str, list] = {k: [] for k in columns}

        def emit(p: int, seg: int, ids: list[int], mask: list[bool], status: str) -> None:
            out["sample_index"].append(int(self.indices[p]))
            out["segment"].append(seg)
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["num_loss_tokens"].append(int(sum(mask)))
            out["status"].append(status)

        for i, p in enumerate(positions):
            res = by_row.get(i, f"bad:{read[i].reason}")
            if isinstance(res, str):
                emit(p, 0, [], [], res)
                continue
            for seg, (full_ids, full_mask) in enumerate(res):
                ids, mask = full_ids[: self.max_length], full_mask[: self.max_length]
                if sum(mask) >= self.min_loss_tokens:
                    status = "ok"
                elif sum(full_mask) >= self.min_loss_tokens:
                    status, ids, mask = "bad:over-long", [], []  # --max-length cut its supervision
                else:
                    status = "short"
                emit(p, seg, ids, mask, status)
        return out


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
    # the row's tools, and the other format's column (to name a row of that format in this file)
    columns = [column] + [
        c for c in ("tools", *FORMAT_COLUMN.values()) if c != column and c in ds.column_names
    ]
    sub = ds.select_columns(columns)
    if not np.array_equal(indices, np.arange(len(ds))):
        sub = sub.select(indices)  # an indices mapping: no copy of the rows
    features = Features(
        {
            "sample_index": Value("int64"),
            "segment": Value("int32"),
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
        columns,
        cfg.format,
        cfg.max_length,
        cfg.min_loss_tokens,
        cfg.train_reasoning,
    )
    fn = _Tokenize(
        tokenizer,
        column,
        cfg.max_length,
        cfg.min_loss_tokens,
        indices,
        train_reasoning=cfg.train_reasoning,
        fmt=cfg.format,
    )
    num_proc = cfg.num_proc if cfg.num_proc and cfg.num_proc > 1 and len(sub) >= 2 * cfg.num_proc else None
    return sub.map(
        fn,
        batched=True,
        with_indices=True,
        batch_size=256,
        remove_columns=columns,
        features=features,
        num_proc=num_proc,
        new_fingerprint=fingerprint,
        desc="tokenize",
    )
