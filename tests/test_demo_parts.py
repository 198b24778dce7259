"""The demo's parts that are cheap to test alone: progress lines and run averages from metrics files,
the held-out split, and the untrained drafter being exactly the consumer's initialization."""

from __future__ import annotations

import json

import torch

from dflash.common.metrics import MetricsLog
from dflash.tools.demo.demo import write_dataset, write_split
from dflash.tools.demo.progress import consumer_avg_tok_s, format_progress, producer_avg_tok_s, snapshot


def _write(path, records):
    log = MetricsLog(path)
    for r in records:
        log.write(r)
    log.close()


def test_rates_are_run_averages_not_the_last_heartbeat():
    prod = [
        {"tokens": 6000, "samples": 30, "elapsed_s": 20.0, "tok_s": 0.0},  # the forced final heartbeat
        {"tokens": 3000, "samples": 10, "elapsed_s": 30.0, "tok_s": 500.0},
    ]
    assert producer_avg_tok_s(prod) == 9000 / 30.0
    steps = [
        {"interval_tokens": 500, "interval_s": 9.0},  # start-up: the wait for the first shard, compiling
        {"interval_tokens": 500, "interval_s": 1.0},
        {"interval_tokens": 400, "interval_s": 3.0},
    ]
    assert consumer_avg_tok_s(steps) == 900 / 4.0
    assert consumer_avg_tok_s(steps[:1]) == 500 / 9.0
    assert producer_avg_tok_s([]) is None and consumer_avg_tok_s([]) is None


def test_progress_line_says_what_the_metrics_say(tmp_path):
    assert "starting" in format_progress(snapshot(tmp_path), 3.0)
    metrics = tmp_path / "metrics"
    _write(
        metrics / "producer-0.jsonl",
        [{"tokens": 31200, "samples": 96, "elapsed_s": 26.0, "spool_bytes": 12e6}],
    )
    line = format_progress(snapshot(tmp_path), 42.0)
    assert "96 samples" in line and "31.2K tok" in line and "1.2K tok/s" in line and "waiting" in line
    # what the consumer said it does before its first step (a compile must not look like a hang)
    _write(metrics / "consumer-0.jsonl", [{"event": "phase", "phase": "compiling", "step": 0}])
    assert "consumer compiling its kernels" in format_progress(snapshot(tmp_path), 42.0)
    (metrics / "consumer-0.jsonl").unlink()
    _write(
        metrics / "consumer-0.jsonl",
        [{"step": 14, "samples": 40, "loss": 5.214, "tau": 2.31, "spool_shards": 3, "spool_bytes": 12e6}],
    )
    line = format_progress(snapshot(tmp_path), 42.0)
    assert line.startswith("[demo 42s] ")
    assert "step 14: 40 samples trained, loss 5.21, τ 2.31" in line and "spool 3 shards, 12.0 MB" in line


def test_the_split_files_hold_the_spooled_held_out_rows_and_the_rest(tmp_path):
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(10)))
    data = write_dataset(src, tmp_path / "out", rows=6)
    ids = lambda p: [json.loads(line)["id"] for line in p.read_text().splitlines()]  # noqa: E731
    assert ids(data) == list(range(6))
    train, held = write_split(data, [1, 4])
    assert ids(train) == [0, 2, 3, 5] and ids(held) == [1, 4]
    assert ids(write_dataset(src, tmp_path / "all", rows=None)) == list(range(10))


def test_untrained_drafter_is_the_consumers_initialization(tmp_path, tiny_target):
    """The demo's "τ before" drafter has the very weights a fresh dflash-consume starts from."""
    from dflash.common.target.attach import load_exported_drafter
    from dflash.consumer.config import TrainConfig
    from dflash.consumer.trainer import Trainer
    from dflash.tools.demo.evaluation import export_initial_drafter

    torch.manual_seed(123)
    rng = torch.random.get_rng_state()
    out = export_initial_drafter(tiny_target, tmp_path / "untrained")
    assert torch.equal(torch.random.get_rng_state(), rng)  # the caller's RNG is left alone
    exported = load_exported_drafter(out, str(tiny_target), dtype=torch.float32).state_dict()
    spool = tmp_path / "spool"
    spool.mkdir()
    # A Trainer seeds the global RNG and, on CPU, flushes denormals to zero: both are put back for the
    # tests that share this process (hypothesis refuses subnormal floats under flush-denormal).
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        trainer = Trainer(TrainConfig.from_flat(spool=str(spool), target=str(tiny_target), compile=False))
    try:
        fresh = trainer.model.state_dict()
    finally:
        trainer.inputs.close()
        trainer.feed.close()
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    assert exported and all(torch.equal(v, fresh[k]) for k, v in exported.items())


def test_progress_printer_always_closes_with_a_line(tmp_path):
    """However short the run (no periodic line came), stop() prints where it ended."""
    import io

    from dflash.tools.demo.progress import ProgressPrinter

    _write(tmp_path / "metrics" / "consumer-0.jsonl", [{"step": 3, "samples": 5, "loss": 6.0, "tau": 1.1}])
    out = io.StringIO()
    ProgressPrinter(tmp_path, every_s=3600, out=out).start().stop()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "step 3: 5 samples trained, loss 6.00" in lines[0], lines
