"""The same rows train the same whatever the files' layout: OpenAI and ShareGPT rows in one file, in two files
of a folder, or in sub-folders give the same samples with the same ids (each row read as the format it has);
an explicit --format drops the other format's rows, counted, with a real example; a folder is read whole, in
path order, and a folder of two kinds of file is refused in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash.common.target.chat import tokenize_slice
from dflash.common.target.data import (
    DataConfig,
    DataError,
    conversation_column,
    load_raw_dataset,
    slice_indices,
)
from dflash.common.target.drops import drop_summary, format_drops
from dflash.tools.demo.assets import demo_dataset_path, tiny_target_dir

OPENAI, SHAREGPT = 40, 39


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_target_dir())


def _rows() -> tuple[list[dict], list[dict]]:
    """40 OpenAI rows, then 39 ShareGPT rows (the next demo conversations, in ShareGPT's words)."""
    with open(demo_dataset_path(), encoding="utf-8") as f:
        demo = [json.loads(line)["messages"] for line in f][: OPENAI + SHAREGPT]
    role = {"user": "human", "assistant": "gpt", "system": "system"}
    openai = [{"messages": m} for m in demo[:OPENAI]]
    sharegpt = [
        {"conversations": [{"from": role[t["role"]], "value": t["content"]} for t in m]}
        for m in demo[OPENAI:]
    ]
    return openai, sharegpt


def _write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _write_array(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows), encoding="utf-8")
    return path


def _tokenized(tmp_path: Path, tok, spec: Path, fmt: str = "auto"):
    cfg = DataConfig(dataset=str(spec), cache_dir=str(tmp_path / "cache"), min_loss_tokens=32, format=fmt)
    ds = load_raw_dataset(cfg)
    out = tokenize_slice(ds, tok, cfg, slice_indices(len(ds), rank=0, world=1))
    return out, drop_summary(out, ds, conversation_column(ds, fmt), min_loss_tokens=32)


def layouts(tmp_path: Path) -> dict[str, Path]:
    openai, sharegpt = _rows()
    return {
        "one file": _write(tmp_path / "mixed" / "chats.jsonl", openai + sharegpt),
        "one .json array": _write_array(tmp_path / "array" / "chats.json", openai + sharegpt),
        "a folder of two files": (
            _write(tmp_path / "folder" / "a.jsonl", openai).parent,
            _write(tmp_path / "folder" / "b.jsonl", sharegpt),
        )[0],
        "sub-folders": (
            _write(tmp_path / "nested" / "2024" / "openai.jsonl", openai).parents[1],
            _write(tmp_path / "nested" / "sharegpt.jsonl", sharegpt),  # after 2024/: path order, not names
            _write(tmp_path / "nested" / ".cache" / "stale.jsonl", openai),  # hidden: skipped
        )[0],
    }


def test_the_same_rows_train_the_same_in_any_layout(tmp_path, tok):
    openai, sharegpt = _rows()
    reference, _ = _tokenized(
        tmp_path,
        tok,
        _write(
            tmp_path / "all-openai.jsonl",
            openai
            + [
                {
                    "messages": [
                        {
                            "role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]),
                            "content": t["value"],
                        }
                        for t in r["conversations"]
                    ]
                }
                for r in sharegpt
            ],
        ),
    )
    assert set(reference["status"]) == {"ok"} and len(reference) == OPENAI + SHAREGPT
    for name, spec in layouts(tmp_path).items():
        out, summary = _tokenized(tmp_path, tok, spec)
        assert (summary["ok"], summary["dropped"]) == (OPENAI + SHAREGPT, 0), (
            f"{name}: {format_drops(summary)}"
        )
        assert out["sample_index"] == list(range(OPENAI + SHAREGPT)), name
        assert out["input_ids"] == reference["input_ids"] and out["loss_mask"] == reference["loss_mask"], name


@pytest.mark.parametrize("fmt", ["openai", "sharegpt"])
def test_an_explicit_format_drops_the_other_formats_rows_with_a_real_example(tmp_path, tok, fmt):
    kept, dropped = (OPENAI, SHAREGPT) if fmt == "openai" else (SHAREGPT, OPENAI)
    first = OPENAI if fmt == "openai" else 0
    reason = {
        "openai": "a ShareGPT row in an OpenAI-format file",
        "sharegpt": "an OpenAI row in a ShareGPT-format file",
    }[fmt]
    opening = {"openai": '{"conversations": [{"', "sharegpt": '{"messages": [{"'}[fmt]
    for name, spec in layouts(tmp_path).items():
        out, summary = _tokenized(tmp_path, tok, spec, fmt)
        assert (summary["ok"], summary["dropped"], summary["reasons"]) == (
            kept,
            dropped,
            {reason: dropped},
        ), name
        example = summary["first"][reason]
        assert example.startswith(f"row {first}: ") and "None" not in example, (name, example)
        assert example.startswith(f"row {first}: '{opening}"), (
            name,
            example,
        )  # the row, not its empty column
        line = format_drops(summary)
        assert re.fullmatch(
            rf"dropped {dropped} of 79 rows: {reason} {dropped} \(first: row {first}: .+\)", line
        ), line


def test_a_folder_is_read_in_path_order_and_one_kind_of_file_at_a_time(tmp_path, tok):
    openai, sharegpt = _rows()
    folder = tmp_path / "data"
    _write(folder / "b" / "rows.jsonl", openai[:3])
    _write(folder / "a.jsonl", openai[3:5])
    _write(
        folder / "a" / "z.jsonl", openai[5:6]
    )  # a/z.jsonl sorts before a.jsonl: ("a", "z.jsonl") < ("a.jsonl",)
    out, summary = _tokenized(tmp_path, tok, folder)
    expected, _ = _tokenized(
        tmp_path, tok, _write(tmp_path / "flat.jsonl", openai[5:6] + openai[3:5] + openai[:3])
    )
    assert summary["ok"] == 6 and out["input_ids"] == expected["input_ids"]
    from datasets import Dataset

    Dataset.from_list(sharegpt[:2]).to_parquet(str(folder / "b" / "more.parquet"))
    with pytest.raises(DataError) as err:
        load_raw_dataset(DataConfig(dataset=str(folder), cache_dir=str(tmp_path / "cache")))
    assert str(err.value) == (
        f"dataset folder {folder}: holds json (3 files) and parquet (1 file); "
        "point --dataset at a folder (or a file) of one kind"
    )
    empty = tmp_path / "empty" / "sub"
    empty.mkdir(parents=True)
    with pytest.raises(
        DataError, match=r"no \.json/\.jsonl/\.parquet/\.arrow files \(sub-folders included\)$"
    ):
        load_raw_dataset(DataConfig(dataset=str(empty.parent)))


@pytest.mark.pipeline
def test_dflash_produce_trains_every_row_of_a_file_that_mixes_formats(tmp_path, tiny_target):
    """The whole producer: one file of 40 OpenAI and 39 ShareGPT rows, --format auto: 79 rows trained,
    each once, under its own row's id."""
    import subprocess

    import zarr
    from pipeline_helpers import cpu_env, produce_cmd

    openai, sharegpt = _rows()
    data = _write(tmp_path / "chats.jsonl", openai + sharegpt)
    spool = tmp_path / "spool"
    env = cpu_env(HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false")
    cmd = produce_cmd(spool, tiny_target, data, "--cache-dir", str(tmp_path / "hf"))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    said = [line for line in res.stderr.splitlines() if "trainable" in line]
    assert said == [f"dflash-produce: {OPENAI + SHAREGPT} trainable rows; dropped 0 of 79 rows"], res.stderr[
        -3000:
    ]
    ids = [
        i
        for s in (spool / "ready").glob("*.zarr")
        for i in zarr.open_group(str(s), mode="r")["sample_index"][:].tolist()
    ]
    assert sorted(ids) == list(range(OPENAI + SHAREGPT))
