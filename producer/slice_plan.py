"""What one producer makes of its dataset slice: the slice tokenized, then which of its samples to produce,
in which order, and which it holds out for evaluation.

Why its own module: the plan is pure bookkeeping over the tokenized slice (rows, segments, epochs, the
trained set), testable without a target or a spool; the worker only runs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.compute as pc

from dflash.common.contract.epochs import Epochs
from dflash.common.contract.sample_set import SampleSet
from dflash.common.target.chat import tokenize_slice
from dflash.common.target.data import DataConfig, conversation_column, load_raw_dataset, slice_indices
from dflash.common.target.drops import campaign_counts, drop_summary
from dflash.producer.buckets import Sample
from dflash.producer.config import ProducerConfig, Worker


@dataclass
class SlicePlan:
    """This producer's slice, tokenized, and what is left to produce of it."""

    ds: Any
    """The raw dataset (the drop summary reads its conversations)."""
    tok_ds: Any
    """The tokenized slice: one row per sample (a dataset row may give several)."""
    epochs: Epochs
    positions: np.ndarray
    """Positions into ``tok_ds`` to produce, in campaign order."""
    ids: np.ndarray
    """Their sample ids (``epoch x rows + row`` and segment)."""
    counts: dict
    """dropped / short / bad / skipped sample counts."""
    held_pos: np.ndarray
    """Positions of the held-out samples not yet in the spool's eval/."""
    held_ids: np.ndarray


def plan_slice(cfg: ProducerConfig, worker: Worker, tokenizer, spooled_eval_ids: np.ndarray) -> SlicePlan:
    """Load and tokenize this worker's slice (cached across launches) and plan it: the campaign's samples
    minus those trained (``worker.skip``), and the held-out ones not spooled yet (``spooled_eval_ids``)."""
    ds = load_raw_dataset(cfg.data, quiet=True)
    num_rows = min(len(ds), cfg.data.limit) if cfg.data.limit else len(ds)
    mine = slice_indices(num_rows, rank=worker.rank, world=worker.world)
    tok_ds = tokenize_slice(ds, tokenizer, cfg.data, mine)
    epochs = Epochs(rows=num_rows, epochs=cfg.epochs, seed=cfg.shuffle_seed, eval_samples=cfg.eval_samples)
    skip = SampleSet.from_bytes(worker.skip) if worker.skip else None
    positions, ids, counts = plan_epochs(tok_ds, mine, epochs, skip)
    held_pos, held_ids = held_out_plan(tok_ds, mine, epochs)
    if len(held_ids):  # spooled once per campaign: what an earlier launch wrote stays in eval/
        keep = ~np.isin(held_ids, spooled_eval_ids)
        held_pos, held_ids = held_pos[keep], held_ids[keep]
    return SlicePlan(
        ds=ds,
        tok_ds=tok_ds,
        epochs=epochs,
        positions=positions,
        ids=ids,
        counts=counts,
        held_pos=held_pos,
        held_ids=held_ids,
    )


def tokenized_summary(plan: SlicePlan, data: DataConfig) -> dict:
    """What the slice gives (data.drop_summary, plus skipped, remaining and the campaign's counts): the
    launch decides from it whether the dataset has anything to train."""
    summary = drop_summary(
        plan.tok_ds, plan.ds, conversation_column(plan.ds, data.format), min_loss_tokens=data.min_loss_tokens
    )
    summary["skipped"] = plan.counts["skipped"]
    summary["remaining"] = len(plan.ids)
    summary["campaign"] = campaign_counts(plan.tok_ds, exclude=held_out_positions(plan.tok_ds, plan.epochs))
    return summary


def samples_at(tok_ds, positions: np.ndarray, ids: np.ndarray) -> Iterator[Sample]:
    """The rows ``positions`` of the tokenized slice, in that order, as Samples with sample ids ``ids``."""
    for start in range(0, len(positions), 512):
        pos, sid = positions[start : start + 512], ids[start : start + 512]
        rows = tok_ds.select(pos).with_format("numpy")[:]
        for i in range(len(pos)):
            yield Sample(
                sample_index=int(sid[i]),
                input_ids=np.asarray(rows["input_ids"][i], dtype=np.int32),
                loss_mask=np.asarray(rows["loss_mask"][i], dtype=bool),
            )


def _rows_and_segments(tok_ds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dataset row, which sample of its row, status) of each position of the tokenized slice."""
    table = tok_ds.with_format("arrow")[:]
    rows = np.asarray(table["sample_index"].to_numpy(zero_copy_only=False), dtype=np.int64)
    segs = (
        np.asarray(table["segment"].to_numpy(zero_copy_only=False), dtype=np.int64)
        if "segment" in table.column_names
        else np.zeros(len(rows), dtype=np.int64)
    )
    return rows, segs, np.asarray(table["status"].to_numpy(zero_copy_only=False))


def plan_epochs(
    tok_ds, mine: np.ndarray, epochs: Epochs, skip: SampleSet | None
) -> tuple[np.ndarray, np.ndarray, dict]:
    """What this producer still has to produce, in order: (positions into ``tok_ds``, sample ids, counts).

    Epoch by epoch, the slice's rows in the epoch's order (a row's samples one after the other), minus the
    samples tokenization dropped (counted once, not per epoch), the held-out rows (``held_out_plan``) and
    the ids already trained (``skip``, from the checkpoint). ``mine``: this producer's rows (the positions'
    rows are read from ``tok_ds``, where a row may give several samples).
    """
    rows, segs, status = _rows_and_segments(tok_ds)
    ok = status == "ok"
    train = ok & ~np.isin(rows, epochs.held_out())
    positions, ids, skipped = [], [], 0
    for epoch in range(epochs.epochs):
        pos = epochs.slice_order(epoch, rows)
        pos = pos[train[pos]]
        sid = epochs.ids(epoch, rows[pos], segs[pos])
        if skip is not None and len(sid):
            trained = skip.contains_mask(sid).numpy()
            skipped += int(trained.sum())
            pos, sid = pos[~trained], sid[~trained]
        positions.append(pos)
        ids.append(sid)
    counts = {"dropped": int((~ok).sum()), "short": int((status == "short").sum()), "skipped": skipped}
    counts["bad"] = counts["dropped"] - counts["short"]
    return np.concatenate(positions), np.concatenate(ids), counts


def held_out_plan(tok_ds, mine: np.ndarray, epochs: Epochs) -> tuple[np.ndarray, np.ndarray]:
    """(positions into ``tok_ds``, sample ids) of this slice's kept held-out samples (epoch 0's ids)."""
    rows, segs, status = _rows_and_segments(tok_ds)
    pos = np.flatnonzero(np.isin(rows, epochs.held_out()) & (status == "ok"))
    return pos, epochs.ids(0, rows[pos], segs[pos])


def held_out_positions(tok_ds, epochs: Epochs) -> np.ndarray:
    """Positions into ``tok_ds`` of the held-out rows' samples (kept or not)."""
    rows, _, _ = _rows_and_segments(tok_ds)
    return np.flatnonzero(np.isin(rows, epochs.held_out()))


def lengths_at(tok_ds, positions: np.ndarray) -> np.ndarray:
    """Token counts of the tokenized rows ``positions``, each once (what the batch shapes are made of):
    from the arrow column's offsets, never its values (a million long chats are gigabytes of ids)."""
    lengths = pc.list_value_length(tok_ds.data.column("input_ids")).to_numpy(zero_copy_only=False)
    if getattr(tok_ds, "_indices", None) is not None:  # a selection over the underlying table
        lengths = lengths[tok_ds._indices.column(0).to_numpy()]
    return np.asarray(lengths, dtype=np.int64)[np.unique(positions)]
