"""The accounting of what a tokenized slice gives: why rows were dropped (as the producer prints it), and
the campaign's samples and tokens.

Why apart from tokenizing (chat.py): the launch and the producers read these counts to decide whether a
dataset has anything to train and to plan the consumers' schedule; they need the statuses, not the
templates.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def drop_reason(status: str, min_loss_tokens: int | None = None) -> str:
    """The phrase a producer prints for a dropped row's status ("short" -> "too short (< 32 supervised
    tokens)", "bad:no assistant turn" -> "no assistant turn")."""
    if status == "short":
        return "too short" + (f" (< {min_loss_tokens} supervised tokens)" if min_loss_tokens else "")
    return status.partition(":")[2] or status


def drop_summary(
    tok_ds, raw_ds=None, column: str | None = None, *, min_loss_tokens: int | None = None
) -> dict:
    """What tokenization kept and dropped: ``{"rows", "samples", "ok", "dropped", "reasons": {phrase:
    count}, "first": {phrase: "row <global index>: <first 60 chars of the raw row>"}}`` (counted with
    pyarrow, no Python loop over rows). ``samples`` >= ``rows`` (a row may give several samples, a bad row
    counts as one); ``ok`` and ``dropped`` count samples."""
    if len(tok_ds) == 0 or "status" not in tok_ds.column_names:
        return {"rows": 0, "samples": 0, "ok": 0, "dropped": 0, "reasons": {}, "first": {}}
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
            first[phrase] = f"row {row}{_snippet(raw_ds, column, row)}"
    ok = counts.get("ok", 0)
    rows = int(pc.count_distinct(index).as_py())
    dropped = len(tok_ds) - ok
    return {
        "rows": rows,
        "samples": len(tok_ds),
        "ok": ok,
        "dropped": dropped,
        "reasons": reasons,
        "first": first,
    }


def _snippet(raw_ds, column: str | None, row: int) -> str:
    """``: '<the row's start>'``: its conversation column, or, where that is empty (a row of the other
    format in a file that mixes them), the fields the row has; "" when the raw dataset is not at hand."""
    if raw_ds is None or column is None:
        return ""
    try:
        values = raw_ds[row]
    except (IndexError, KeyError, TypeError):
        return ""
    value = values.get(column)
    if value is None:
        value = {k: v for k, v in values.items() if v is not None} or None
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return ": " + repr(text)[:60]


def campaign_counts(tok_ds, exclude: np.ndarray | None = None) -> dict:
    """What one epoch of the tokenized slice gives: ``{"samples", "tokens", "loss_tokens"}`` of its kept
    samples, minus the positions ``exclude`` (held out); counted with pyarrow
    (dflash.common.contract.epochs.Campaign)."""
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
    """``dropped 3 of 80 rows: unparseable 2 (first: row 5: '{oops'), no assistant turn 1 (first: row 3)``;
    ``... of 95 samples (80 rows): ...`` when rows gave several samples."""
    rows = summary.get("rows", 0)
    samples = summary.get("samples", rows)
    unit = f"{rows} rows" if samples == rows else f"{samples} samples ({rows} rows)"
    if not summary.get("dropped"):
        return f"dropped 0 of {unit}"
    parts = [f"{r} {n} (first: {summary['first'].get(r, '?')})" for r, n in summary["reasons"].items()]
    return f"dropped {summary['dropped']} of {unit}: " + ", ".join(parts)
