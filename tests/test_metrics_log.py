import json
import math

import numpy as np
import pytest

from dflash.common.metrics import (
    MetricsLog,
    format_bytes,
    format_console_line,
    format_duration,
    format_rate,
    read_metrics,
    read_run_metrics,
)


def test_write_read_roundtrip(tmp_path):
    path = tmp_path / "metrics" / "consumer-0.jsonl"  # parent is created
    with MetricsLog(path) as m:
        rec = m.write({"step": 1, "loss": 2.5}, acc=np.array([0.5, 0.25]), tok_s=np.float32(10.0))
        m.event("checkpoint", step=1, url="s3://b/run/step-1")
        m.write(step=2, loss=float("nan"), time=123.0)
    assert isinstance(rec["time"], float)
    recs = read_metrics(path)
    assert [r.get("step") for r in recs] == [1, 1, 2]
    assert recs[0]["acc"] == [0.5, 0.25] and recs[0]["tok_s"] == 10.0
    assert recs[1] == {"event": "checkpoint", "step": 1, "url": "s3://b/run/step-1", "time": recs[1]["time"]}
    assert math.isnan(recs[2]["loss"]) and recs[2]["time"] == 123.0
    # every line is one complete JSON object, already on disk before close
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_lines_are_on_disk_before_close(tmp_path):
    m = MetricsLog(tmp_path / "p.jsonl")
    m.write(step=7)
    assert read_metrics(tmp_path / "p.jsonl")[0]["step"] == 7  # no close(): a crash here loses nothing
    m.close()
    with pytest.raises(ValueError, match="closed"):
        m.write(step=8)


def test_truncated_last_line_and_resume(tmp_path):
    path = tmp_path / "consumer-0.jsonl"
    path.write_text('{"step": 1, "time": 1.0}\n{"step": 2, "ti')  # crash mid-line
    assert [r["step"] for r in read_metrics(path)] == [1]
    # a resumed process appends: the torn fragment must not swallow the new record
    with MetricsLog(path) as m:
        m.write(step=3)
    assert [r["step"] for r in read_metrics(path)] == [1, 3]


def test_non_dict_and_garbage_lines_skipped(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('[1, 2]\n\nnot json\n{"step": 5}\n')
    assert read_metrics(path) == [{"step": 5}]


def test_read_dir(tmp_path):
    for name, step in (("producer-a", 1), ("consumer-0", 2)):
        with MetricsLog(tmp_path / f"{name}.jsonl") as m:
            m.write(step=step)
    (tmp_path / "notes.txt").write_text("ignored")
    recs = read_metrics(tmp_path)
    assert [(r["_file"], r["step"]) for r in recs] == [("consumer-0", 2), ("producer-a", 1)]
    assert set(read_run_metrics(tmp_path)) == {"consumer-0", "producer-a"}
    assert read_run_metrics(tmp_path / "missing") == {}
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    "x,want",
    [(950, "950"), (41234.5, "41.2K"), (1.34e6, "1.3M"), (2.5e9, "2.5G"), (None, "?"), (float("nan"), "?")],
)
def test_format_rate(x, want):
    assert format_rate(x) == want


@pytest.mark.parametrize(
    "n,want", [(512, "512 B"), (12_300, "12.3 KB"), (5.12e8, "512.0 MB"), (3.1e9, "3.1 GB")]
)
def test_format_bytes(n, want):
    assert format_bytes(n) == want


@pytest.mark.parametrize(
    "s,want",
    [(0, "0s"), (45, "45s"), (845, "14m"), (4320, "1h12m"), (93600, "1d02h"), (-1, "?"), (None, "?")],
)
def test_format_duration(s, want):
    assert format_duration(s) == want


def test_console_line_full():
    rec = {
        "time": 0.0,
        "step": 1200,
        "loss": 2.314,
        "acc": [0.7, 0.52],
        "tau": 3.421,
        "lr": 5.8e-4,
        "tok_s": 38_900.0,
        "prod_tok_s": 41_200.0,
        "spool_shards": 12,
        "spool_bytes": 3.1e9,
        "grad_norm": 0.9,
    }
    assert format_console_line(rec, elapsed_s=845, eta_s=4320) == (
        "[14m] step=1200 loss=2.31 acc=0.61 τ=3.42 lr=5.8e-04 | prod=41.2K tok/s cons=38.9K tok/s"
        " | spool=12 shards/3.1 GB | ETA 1h12m"
    )


def test_console_line_partial_and_nan():
    line = format_console_line({"step": 3, "loss": float("nan"), "tok_s": 900}, elapsed_s=5)
    assert line == "[5s] step=3 loss=nan | cons=900 tok/s"
