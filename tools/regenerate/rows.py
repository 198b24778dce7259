"""The input side: each dataset row as the messages its assistant turns are regenerated from, read by the
producer's own loading and its one reading of a row (common/target/data.py ``read_row``), so whatever
dflash-produce reads, this reads the same way; and the output row that dflash-produce reads back as it is.

A row the producer would drop for its shape (unparseable, unknown role, tools not JSON, ...) is skipped here
with the same reason. Two differences, both where the producer has nothing to train: a row with no answer
yet (a prompt, the usual input of a regeneration) is a row to answer, and a row with no user turn is skipped
(nothing to answer).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dflash.common.target.conversation import prune_nulls
from dflash.common.target.data import (
    FORMAT_COLUMN,
    RAW_JSON_COLUMN,
    DataConfig,
    conversation_column,
    load_raw_dataset,
    read_row,
)

OUT_KEY = "dflash_regenerate"
"""The key of each output row that says which input row it is and how its turns ended (its last key)."""
_CONVERSATION_KEYS = frozenset({*FORMAT_COLUMN.values(), "tools", RAW_JSON_COLUMN, OUT_KEY})


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


def _source_row(index: int, row: dict[str, Any], column: str, fmt: str) -> SourceRow:
    """The row as the producer reads it (data.read_row), a prompt included; its other fields without
    arrow's None padding, since they are written back as the row's own."""
    read = read_row(row, column, fmt, prompts=True)
    record = read.record if column == RAW_JSON_COLUMN else prune_nulls(read.record)
    fields = {k: v for k, v in record.items() if k not in _CONVERSATION_KEYS}
    msgs, reason = read.messages, read.reason
    if msgs is not None and not any(m["role"] == "user" for m in msgs):
        msgs, reason = None, "no user turn"
    return SourceRow(index, msgs, read.tools if msgs is not None else None, fields, reason)


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
