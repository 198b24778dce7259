"""Chat datasets for one producer: loading (hub, local json/jsonl/parquet/arrow, save_to_disk), validation,
the dataset's fingerprint, each producer's disjoint slice, and each row read as a conversation (read_row,
the one reading dflash-regenerate shares).

Why it looks like this: a producer must (1) see exactly its own disjoint slice of the dataset so that all
producers together cover it once, (2) keep each row's global index as the data cursor that checkpoints
record, and (3) never crash on a bad row of a million-row dataset: bad rows are counted and skipped
(tokenization and the loss mask: chat.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

from dflash.common.cli.exits import error_line
from dflash.common.cli.flags import check_choices, flag
from dflash.common.target.conversation import (
    FORMAT_NAME,
    BadRow,
    normalize_conversation,
    normalize_tools,
    prune_nulls,
)

log = logging.getLogger(__name__)

ChatFormat = Literal["auto", "openai", "sharegpt"]
FORMAT_COLUMN = {"openai": "messages", "sharegpt": "conversations"}
RAW_JSON_COLUMN = (
    "_raw_json"  # column holding a row's JSON text when the file has mixed types (see _load_json_rows)
)
_SUFFIX_BUILDER = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}


class DataError(ValueError):
    """A user-facing problem with the dataset or tokenizer (one line, no traceback)."""


@dataclass(kw_only=True)
class DataConfig:
    """What a producer reads and how it is tokenized (each field is also a ``dflash-produce`` flag)."""

    dataset: str
    """hub name, .json/.jsonl/.parquet/.arrow file or folder of them (sub-folders included, read in path
    order), or save_to_disk folder"""
    split: str = "train"
    """dataset split (hub datasets and save_to_disk DatasetDicts)"""
    format: ChatFormat = "auto"
    """conversation format: openai (messages [{role, content}]), sharegpt (conversations [{from, value}]),
    or auto (each row read as the format it has: a file may mix both); a row of the other format is dropped
    and counted"""
    max_length: int = 4096
    """truncate samples to this many tokens"""
    train_reasoning: bool = field(
        default=True,
        metadata=flag(
            negate=True,
            help="render each row as if the target had answered without thinking: reasoning_content / "
            "reasoning fields and <think> blocks written in the content removed, and no <think> token trained "
            "(not even the empty block a Qwen3-family template adds): fewer tokens, with such a template fewer "
            "samples (docs/producer.md). Without it the reasoning of assistant turns is trained as the "
            "target's template renders it",
        ),
    )
    """train the reasoning of assistant turns (``reasoning_content`` or ``reasoning``, rendered by the target's
    template as it generated it); off: rows are rendered as if the target had answered without thinking
    (those fields and the <think> blocks written in the content removed) and no <think> token is trained,
    not even the empty block a Qwen3-family template adds: fewer tokens, with such a template fewer samples
    (the tests' chat shapes with tool calls: 5 samples / 1,345 tokens instead of 9 / 2,360; docs/producer.md)"""
    min_loss_tokens: int = field(default=32, metadata=flag(cli=False))
    """samples with fewer supervised tokens (after truncation) are dropped; the CLI sets 2 x --block-size"""
    limit: int | None = None
    """use only the first N rows of the dataset, before splitting among producers (default: all rows)"""
    num_proc: int | None = None
    """tokenization processes per producer (default: one)"""
    cache_dir: str | None = None
    """datasets cache directory (default: the datasets library's)"""

    def __post_init__(self) -> None:
        if not self.dataset:
            raise ValueError("DataConfig.dataset: must not be empty")
        check_choices(self)
        if self.max_length < 2:
            raise ValueError(f"DataConfig.max_length={self.max_length}: must be >= 2")
        if self.min_loss_tokens < 1:
            raise ValueError(f"DataConfig.min_loss_tokens={self.min_loss_tokens}: must be >= 1")
        if self.max_length < self.min_loss_tokens:  # no row could ever be kept: say so before any work
            raise ValueError(
                f"--max-length {self.max_length}: below the {self.min_loss_tokens} supervised tokens a sample "
                "needs (2 x --block-size): every row would be dropped"
            )
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"DataConfig.limit={self.limit}: must be >= 1")
        if self.num_proc is not None and self.num_proc < 1:
            raise ValueError(f"DataConfig.num_proc={self.num_proc}: must be >= 1")


# ---- loading ---------------------------------------------------------------------------------------


def _local_files(path: Path) -> tuple[str, list[str]]:
    """(datasets builder, files) of a local file or folder.

    A folder is read whole, sub-folders included (hidden files and folders skipped, as the datasets library
    does), in path order: the row order, and so every sample's id, depends on the files alone, never on
    how the filesystem lists them or on how a user grouped them into folders. A folder holds one kind of
    file: reading one kind and ignoring another would drop rows without a word.
    """
    if path.is_file():
        builder = _SUFFIX_BUILDER.get(path.suffix)
        if builder is None:
            raise DataError(f"dataset file {path}: unsupported type (use .json, .jsonl, .parquet or .arrow)")
        return builder, [str(path)]
    found: dict[str, list[str]] = {}
    for f in sorted(path.rglob("*"), key=lambda f: f.relative_to(path).parts):
        hidden = any(part.startswith(".") for part in f.relative_to(path).parts)
        if not hidden and f.suffix in _SUFFIX_BUILDER and f.is_file():
            found.setdefault(_SUFFIX_BUILDER[f.suffix], []).append(str(f))
    if not found:
        raise DataError(
            f"dataset folder {path}: no .json/.jsonl/.parquet/.arrow files (sub-folders included)"
        )
    if len(found) > 1:
        kinds = " and ".join(
            f"{kind} ({len(files)} file{'s' if len(files) > 1 else ''})" for kind, files in found.items()
        )
        raise DataError(
            f"dataset folder {path}: holds {kinds}; point --dataset at a folder (or a file) of one kind"
        )
    [(builder, files)] = found.items()
    return builder, files


def _load_json_rows(files: list[str]):
    """Rows of JSON files as raw JSON text, for files whose rows mix types (arrow cannot infer a schema).

    Row i is the i-th non-blank line of a .jsonl file (the same order the json builder uses) or the i-th
    element of a .json array; files are concatenated in the order _local_files gives.
    """
    from datasets import Dataset  # here, not at the top: the producer's CLI imports DataConfig before parsing

    rows: list[str] = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            if f.endswith(".jsonl"):
                rows.extend(line for line in (raw.strip() for raw in fh) if line)
            else:
                data = json.load(fh)
                if not isinstance(data, list):
                    raise DataError(f"dataset file {f}: expected a JSON array of rows")
                rows.extend(json.dumps(r) for r in data)
    return Dataset.from_dict({RAW_JSON_COLUMN: rows})


def _is_blank_file(f: str) -> bool:
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 16):
            if chunk.strip():
                return False
    return True


class _quiet_datasets:
    """Silence the datasets library's logger (its ERROR lines about a failed JSON load) for a block."""

    def __enter__(self):
        import datasets

        self._level = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity(logging.CRITICAL)
        return self

    def __exit__(self, *exc):
        import datasets

        datasets.logging.set_verbosity(self._level)
        return False


def _bad_json_lines(files: list[str], limit: int = 1) -> tuple[int, int, list[str]]:
    """(non-blank lines, lines that are not JSON, the first ``limit`` of those as 'file:line: error')
    over the .jsonl files; a .json file counts as one line (its whole text)."""
    total = bad = 0
    examples: list[str] = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            lines = enumerate(fh, 1) if f.endswith(".jsonl") else [(1, fh.read())]
            for no, raw in lines:
                if not raw.strip():
                    continue
                total += 1
                try:
                    json.loads(raw)
                except json.JSONDecodeError as err:
                    bad += 1
                    if len(examples) < limit:
                        examples.append(f"{f}:{no}: {err.msg} (column {err.colno}): {raw.strip()[:40]!r}")
    return total, bad, examples


def _load_json_fallback(spec: str, files: list[str], err: BaseException, *, quiet: bool = False):
    """The json builder failed: say why in one line. No line is JSON: a DataError. Some lines are not
    JSON, or rows mix types (arrow cannot infer one schema): rows are read one by one as raw JSON text,
    and the lines that do not parse are dropped later as "unparseable", each counted."""
    total, bad, examples = _bad_json_lines(files)
    if total and bad == total:
        raise DataError(f"dataset {spec}: no line is valid JSON ({bad} lines; first: {examples[0]})") from err
    if bad and not quiet:
        log.warning(
            "dataset %s: %d of %d lines are not valid JSON (first: %s); they are dropped as unparseable",
            spec,
            bad,
            total,
            examples[0],
        )
    elif not quiet:
        log.info("dataset %s: rows have mixed types (%s); reading rows one by one", spec, error_line(err))
    try:
        return _load_json_rows(files)
    except json.JSONDecodeError as jerr:
        raise DataError(f"dataset {spec}: invalid JSON ({jerr})") from jerr


def dataset_fingerprint(cfg: DataConfig, ds=None) -> dict:
    """What identifies a dataset for the spool's run record: local files by name, size and the sha256 of
    their first and last MiB (cheap on a 100 GB file; an edit in the middle that keeps the size goes
    unseen), a hub dataset by name, split and its datasets fingerprint."""
    h = hashlib.sha256()
    path = Path(cfg.dataset).expanduser()
    if path.exists():
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            size = f.stat().st_size
            h.update(f"{f.relative_to(path) if f != path else f.name}\0{size}\0".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
                if size > 2 << 20:
                    fh.seek(size - (1 << 20))
                    h.update(fh.read())
        spec = str(path.resolve())
    else:
        h.update(f"{cfg.dataset}\0{cfg.split}\0{getattr(ds, '_fingerprint', '')}".encode())
        spec = cfg.dataset
    return {"spec": spec, "split": cfg.split, "fingerprint": h.hexdigest()[:32]}


def load_raw_dataset(cfg: DataConfig, *, quiet: bool = False):
    """The dataset as a `datasets.Dataset` (row order = global sample index). Raises DataError.
    ``quiet``: no warning about unparseable lines (the dflash-produce parent said it once already)."""
    import datasets

    spec = cfg.dataset
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if cfg.split not in ds:
                    raise DataError(f"dataset {spec}: no split {cfg.split!r} (splits: {', '.join(ds)})")
                ds = ds[cfg.split]
            return ds
        builder, files = _local_files(path)
        empty = [f for f in files if _is_blank_file(f)]
        if len(empty) == len(files):
            raise DataError(
                f"dataset {spec}: {'file is' if len(files) == 1 else 'files are'} empty (no rows)"
            )
        try:
            with _quiet_datasets():  # its own ERROR lines (printed by every process) say less than ours
                return datasets.load_dataset(
                    builder, data_files=files, split="train", cache_dir=cfg.cache_dir
                )
        except Exception as err:  # noqa: BLE001 - arrow raises several types for schema conflicts
            if builder != "json":
                raise DataError(f"cannot read dataset {spec}: {error_line(err)}") from err
            return _load_json_fallback(spec, files, err, quiet=quiet)
    if spec.startswith(("/", ".", "~")) or Path(spec).suffix in _SUFFIX_BUILDER:
        raise DataError(f"dataset path {spec} does not exist")
    try:
        return datasets.load_dataset(spec, split=cfg.split, cache_dir=cfg.cache_dir)
    except Exception as err:  # noqa: BLE001 - hub errors come in many types; the user needs one line
        raise DataError(
            f"cannot load dataset {spec!r} (not a local path; hub load failed: {error_line(err)})"
        ) from err


def conversation_column(ds, fmt: str) -> str:
    """The column holding conversations, by `fmt` or detected; DataError naming the columns otherwise."""
    cols = list(ds.column_names)
    if RAW_JSON_COLUMN in cols:
        return RAW_JSON_COLUMN
    wanted = [FORMAT_COLUMN[fmt]] if fmt != "auto" else [FORMAT_COLUMN["openai"], FORMAT_COLUMN["sharegpt"]]
    for col in wanted:
        if col in cols:
            return col
    raise DataError(
        f"dataset has no {' or '.join(repr(c) for c in wanted)} column (columns: {', '.join(cols)})"
    )


def row_turns(row: Mapping[str, Any], fmt: str) -> tuple[Any, str | None]:
    """(the row's turns, None), or (None, the reason it is not read): each row is read as the format it has,
    so a file holding OpenAI and ShareGPT rows (arrow gives every row both columns, one of them None) trains
    as the same rows split into two files do. An explicit ``fmt`` names a row of the other format instead:
    the user said what the file is. ``row``: the row's columns (an arrow row) or its JSON object."""
    own = FORMAT_COLUMN.get(fmt)
    for col in [own] if own else FORMAT_COLUMN.values():
        if row.get(col) is not None:
            return row[col], None
    for other in (c for c in FORMAT_COLUMN.values() if own and c != own):
        if isinstance(row.get(other), list):
            return None, f"{FORMAT_NAME[other]} row in {FORMAT_NAME[own]}-format file"
    return row.get(own or FORMAT_COLUMN["openai"]), None  # missing or null: normalize says "not a list"


# ---- splitting -------------------------------------------------------------------------------------


def slice_indices(
    num_rows: int, *, rank: int, world: int, skip: Iterable[int] | np.ndarray | None = None
) -> np.ndarray:
    """Global sample indices of producer `rank` of `world`: i % world == rank, minus `skip`.

    The union over ranks is range(num_rows), pairwise disjoint. With several nodes, rank = node * P + p
    and world = P * num_nodes.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank}: must be in [0, world={world})")
    idx = np.arange(rank, num_rows, world, dtype=np.int64)
    if skip is not None:
        skip_arr = np.asarray(skip if isinstance(skip, np.ndarray) else list(skip), dtype=np.int64)
        if skip_arr.size:
            idx = idx[~np.isin(idx, skip_arr)]
    return idx


# ---- conversations ---------------------------------------------------------------------------------


_NO_ANSWER = ("no assistant turn", "only empty assistant turns")


class RowRead(NamedTuple):
    """One dataset row as a conversation (read_row)."""

    messages: list[dict[str, Any]] | None
    """HF chat-template messages, or None: the row is not read (``reason`` says why)."""
    tools: list[dict] | None
    reason: str
    """"ok", or the reason the producer counts the row as dropped under (chat.py's module docstring)."""
    record: Mapping[str, Any]
    """The row as a mapping: its JSON object (empty for a bare turn list or an unparseable line), or the
    columns given; its other fields are the caller's (dflash-regenerate writes them back)."""


def read_row(
    row: Mapping[str, Any], column: str, fmt: str, *, train_reasoning: bool = True, prompts: bool = False
) -> RowRead:
    """One row (its columns; under ``RAW_JSON_COLUMN`` its JSON text) as its messages and tools: the one
    reading of a row that dflash-produce trains from and dflash-regenerate answers from, so the two can
    never disagree on what a row is. A raw JSON row is an object holding the turns, or a bare list of turns
    (no tools); an arrow row's None fields are arrow's padding (the union of all rows' fields), not the
    row's, and are dropped from its turns and tools. ``prompts``: a row with no answer yet reads as the
    prompt it is, its turns up to where the answer goes (dflash-regenerate answers it; the producer drops
    it: nothing to train)."""
    from_arrow = column != RAW_JSON_COLUMN
    record: Any = row
    if not from_arrow:
        try:
            record = json.loads(row[RAW_JSON_COLUMN])
        except (TypeError, json.JSONDecodeError):
            return RowRead(None, None, "unparseable", {})
    if isinstance(record, Mapping):
        turns, wrong_format = row_turns(record, fmt)
        if wrong_format is not None:
            return RowRead(None, None, wrong_format, record)
        raw_tools = prune_nulls(record.get("tools")) if from_arrow else record.get("tools")
    else:  # a raw JSON row that is a bare turn list (or no conversation at all: normalize says which)
        turns, raw_tools, record = record, None, {}
    msgs, reason = normalize_conversation(turns, train_reasoning=train_reasoning, null_fields=from_arrow)
    if msgs is None and prompts and reason in _NO_ANSWER and isinstance(turns, list):
        # read with a stand-in answer slot at its end (the parser refuses a row with nothing to train)
        slotted = [*turns, {"role": "assistant", "content": "-"}]
        msgs, reason = normalize_conversation(
            slotted, train_reasoning=train_reasoning, null_fields=from_arrow
        )
        msgs = msgs[:-1] if msgs is not None else None
    try:
        tools = normalize_tools(raw_tools)
    except BadRow as err:
        return RowRead(None, None, str(err), record)
    return RowRead(msgs, tools, reason, record) if msgs is not None else RowRead(None, None, reason, record)
