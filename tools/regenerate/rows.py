"""The input side: each dataset row as the messages its assistant turns are regenerated from, read with the
producer's own loading and row parsing (common/target/data.py, conversation.py), so whatever dflash-produce
reads, this reads the same way; and the output row that dflash-produce reads back as it is.

A row the producer would drop for its shape (unparseable, unknown role, tools not JSON, ...) is skipped here
with the same reason. One difference: a row with no answer yet (a prompt, the usual input of a
regeneration) is a row to answer, where the producer has nothing to train.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dflash.common.target.conversation import (
    BadRow,
    normalize_conversation,
    normalize_tools,
    prune_nulls,
)
from dflash.common.target.data import (
    FORMAT_COLUMN,
    RAW_JSON_COLUMN,
    DataConfig,
    conversation_column,
    load_raw_dataset,
    row_turns,
)

OUT_KEY = "dflash_regenerate"
"""The key of each output row that says which input row it is and how its turns ended (its last key)."""
_CONVERSATION_KEYS = frozenset({*FORMAT_COLUMN.values(), "tools", RAW_JSON_COLUMN, OUT_KEY})
_NO_ANSWER = ("no assistant turn", "only empty assistant turns")


@dataclass
class SourceRow:
    """One input row: its messages in HF chat-template form (None when skipped, ``reason`` says why)."""

    index: int
    """The row's position in the dataset (after --limit): its identity in the output and on a re-run."""
    messages: list[dict[str, Any]] | None
    tools: list[dict] | None
    fields: dict[str, Any]
    """The row's other fields (an id, metadata), written back unchanged."""
    reason: str = "ok"


def _messages(turns: Any, *, from_arrow: bool) -> tuple[list[dict[str, Any]] | None, str]:
    """normalize_conversation, except that a row without an answer is a prompt to answer: it is read with
    a stand-in answer slot at its end (the producer's parser refuses such rows: nothing to train), which
    the conversation walk fills."""
    msgs, reason = normalize_conversation(turns, null_fields=from_arrow)
    if msgs is None and reason in _NO_ANSWER and isinstance(turns, list):
        msgs, reason = normalize_conversation(
            [*turns, {"role": "assistant", "content": "-"}], null_fields=from_arrow
        )
        if msgs is not None:
            msgs = msgs[:-1]
    return msgs, reason


def _source_row(index: int, row: dict[str, Any], column: str, fmt: str) -> SourceRow:
    if column == RAW_JSON_COLUMN:
        try:
            row = json.loads(row[RAW_JSON_COLUMN])
        except (TypeError, json.JSONDecodeError):
            return SourceRow(index, None, None, {}, "unparseable")
        if not isinstance(row, dict):
            return SourceRow(index, None, None, {}, "not an object")
        from_arrow = False
    else:
        row = prune_nulls(row)  # arrow's union schema: None where this row had no such field
        from_arrow = True
    turns, wrong_format = row_turns(row, fmt)  # each row as the format it has, as the producer reads it
    if wrong_format is not None:
        return SourceRow(index, None, None, {}, wrong_format)
    if turns is None:
        return SourceRow(index, None, None, {}, f"no {FORMAT_COLUMN.get(fmt, 'messages')!r} in this row")
    fields = {k: v for k, v in row.items() if k not in _CONVERSATION_KEYS}
    msgs, reason = _messages(turns, from_arrow=from_arrow)
    try:
        tools = normalize_tools(row.get("tools"))
    except BadRow as err:
        msgs, tools, reason = None, None, str(err)
    if msgs is not None and not any(m["role"] == "user" for m in msgs):
        msgs, reason = None, "no user turn"
    return SourceRow(index, msgs, tools, fields, reason if msgs is None else "ok")


def read_rows(dataset: str, *, split: str, fmt: str, limit: int | None) -> tuple[int, Iterator[SourceRow]]:
    """(number of input rows, the rows in order). Raises DataError (a user error) for a dataset that cannot
    be read at all."""
    ds = load_raw_dataset(DataConfig(dataset=dataset, split=split, format=fmt))
    column = conversation_column(ds, fmt)
    total = len(ds) if limit is None else min(limit, len(ds))

    def rows() -> Iterator[SourceRow]:
        for i, row in enumerate(ds.select(range(total)) if total < len(ds) else ds):
            yield _source_row(i, row, column, fmt)

    return total, rows()


def output_row(src: SourceRow, messages: list[dict[str, Any]], record: dict[str, Any]) -> dict[str, Any]:
    """The row as dflash-produce reads it: the input's other fields, the regenerated ``messages`` (OpenAI
    form, whatever the input's), its ``tools``, and ``record`` (row index, how each turn ended)."""
    out = {**src.fields, "messages": messages}
    if src.tools is not None:
        out["tools"] = src.tools
    out[OUT_KEY] = {"row": src.index, **record}
    return out
