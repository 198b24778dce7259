import json
import struct

import pytest

from dflash.tools.plots import write_plots
from dflash.tools.status import cli as status

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _jsonl(path, recs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _consumer(rank, n=20, t0=1000.0):
    recs = []
    for i in range(n):
        recs.append(
            {
                "time": t0 + 10 * i,
                "step": 10 * i,
                "loss": 5.0 - 0.1 * i - 0.01 * rank,
                "acc": [0.9 - 0.05 * k for k in range(15)],
                "tau": 1.0 + 0.1 * i,
                "lr": 6e-4,
                "tok_s": 20_000.0 + rank,
            }
        )
        if i == 10:
            recs.append({"event": "checkpoint", "step": 100, "url": "/ckpt/step-100", "time": t0 + 10 * i})
    return recs


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24]), len(data)


def _check(paths, names):
    assert sorted(p.name for p in paths) == sorted(names)
    for p in paths:
        (w, h), nbytes = _png_size(p)
        assert w >= 400 and h >= 300 and nbytes > 5_000, (p, w, h, nbytes)


def test_all_plots(tmp_path):
    _jsonl(tmp_path / "metrics" / "consumer-0.jsonl", _consumer(0))
    _jsonl(tmp_path / "metrics" / "consumer-1.jsonl", _consumer(1))
    for pid in ("0", "1"):
        _jsonl(
            tmp_path / "metrics" / f"producer-{pid}.jsonl",
            [
                {"time": 995.0 + 7 * i, "samples": 10 * i, "tokens": 9000 * i, "tok_s": 9000.0}
                for i in range(30)
            ],
        )
    paths = write_plots(tmp_path)
    _check(paths, ["loss.png", "tau.png", "throughput.png", "acc_by_position.png"])
    assert all(p.parent == tmp_path / "plots" for p in paths)
    assert not list((tmp_path / "plots").glob(".*"))  # no temp files left behind


def test_without_producer_metrics(tmp_path):
    _jsonl(tmp_path / "metrics" / "consumer-0.jsonl", _consumer(0))
    _check(write_plots(tmp_path), ["loss.png", "tau.png", "throughput.png", "acc_by_position.png"])


def test_acc_per_pos_from_trainer(tmp_path):
    recs = [{"time": 1.0, "step": 1, "loss": 2.0, "acc": 0.4, "acc_per_pos": [0.0, 0.8, 0.5], "tok_s": 1.0}]
    _jsonl(tmp_path / "metrics" / "consumer-0.jsonl", recs)
    assert "acc_by_position.png" in [p.name for p in write_plots(tmp_path)]


def test_no_metrics_writes_nothing(tmp_path):
    assert write_plots(tmp_path) == []


def test_summed_rate_holds_each_process_between_its_records():
    from dflash.tools.plots import _summed_rate

    a = [{"time": 0.0, "tok_s": 1.0}, {"time": 10.0, "tok_s": 3.0}]
    b = [{"time": 5.0, "tok_s": 10.0}, {"time": 20.0, "tok_s": 20.0}, {"event": "x", "time": 30.0}]
    assert _summed_rate([a, b]) == ([0.0, 5.0, 10.0, 20.0], [1.0, 11.0, 13.0, 20.0])


def test_status_cli_plots(tmp_path, capsys):
    _jsonl(tmp_path / "metrics" / "consumer-0.jsonl", _consumer(0))
    status.main([str(tmp_path), "--plots"])
    out = capsys.readouterr().out.split()
    assert sorted(out) == sorted(
        str(tmp_path / "plots" / n) for n in ("loss.png", "tau.png", "throughput.png", "acc_by_position.png")
    )


def test_status_cli_plots_bad_run_dir(tmp_path):
    with pytest.raises(SystemExit) as e:
        status.main([str(tmp_path / "missing"), "--plots"])
    assert e.value.code == 2
