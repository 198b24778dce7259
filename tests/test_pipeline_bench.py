"""ops/bench/pipeline_bench.py: its --small CPU mode runs the real CLIs through all three phases and checks
its own accounting (every produced sample trained exactly once, from the consumers' ledgers); the audit
itself catches a sample trained twice and one never trained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_helpers import cpu_env

BENCH = Path(__file__).resolve().parents[1] / "ops" / "bench"
sys.path.insert(0, str(BENCH))
import pipeline_bench  # noqa: E402


def _ledger(d: Path, steps: list[list[int]]) -> Path:
    (d / "metrics").mkdir(parents=True)
    lines = [json.dumps({"step": i + 1, "pid": 1, "samples": s}) for i, s in enumerate(steps)]
    (d / "metrics" / "ledger-r0.jsonl").write_text("\n".join(lines) + "\n")
    return d / "metrics"


def test_ledger_audit_catches_twice_and_missing(tmp_path):
    ok = _ledger(tmp_path / "ok", [[0, 1], [2]])
    assert pipeline_bench.ledger_audit(ok, {0, 1, 2})["trained_samples"] == 3
    with pytest.raises(pipeline_bench.Audit, match="1 trained twice"):
        pipeline_bench.ledger_audit(_ledger(tmp_path / "twice", [[0, 1], [1, 2]]), {0, 1, 2})
    with pytest.raises(pipeline_bench.Audit, match="1 never trained"):
        pipeline_bench.ledger_audit(_ledger(tmp_path / "lost", [[0, 1]]), {0, 1, 2})


@pytest.mark.slow
def test_small_mode_runs_every_phase_and_checks_its_accounting(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "pipeline_bench.py"),
            "--small",
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
        ],
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((out / "pipeline_bench_small.json").read_text())
    ph = res["phases"]
    assert set(ph) == {"producer", "consumer", "together"}
    produced = ph["producer"]["samples"]
    assert produced > 0 and ph["together"]["producer"]["samples"] == produced
    for name in ("consumer", "together"):  # every produced sample trained exactly once, in both runs
        assert ph[name]["ledger"] == {
            "trained_samples": produced,
            "eligible": produced,
            "twice": 0,
            "missing": 0,
        }
    assert ph["producer"]["tok_s"] > 0 and ph["consumer"]["tok_s"] > 0 and 0 < ph["consumer"]["fill"] <= 1
    together = ph["together"]
    # the CPU run's producer and consumer work side by side on their own cores: the bound is min(P, C)
    assert together["trained_tok_s"] > 0 and together["ideal_tok_s"] > 0 and together["rule"] == "min(P, C)"
    # this run's folders are its own (a second run in the same --out audits only its own ledgers)
    (run_root,) = out.glob("run-*")
    assert {p.name for p in run_root.iterdir()} == {"run-producer", "run-consumer", "run-together"}
    assert together["consumer"]["checkpoint_stall_s"] is not None  # it saved while training
    assert any(r.get("ready") for r in ph["producer"]["series"])  # the spool was sampled filling up
    assert all("producer_gb" in r for r in ph["producer"]["series"])
    checks = {c["check"]: c for c in res["acceptance"]}
    assert checks["trained together >= 0.9 x min(P, C)"]["threshold"] == 0.9
    assert res["figures"][0]["producer_tok_s"] == ph["producer"]["tok_s_per_gpu"]
    assert (out / "pipeline_bench_small.png").stat().st_size > 0


def _series(producer, consumer, t0: float = 1000.0) -> list[dict]:
    """A Sampler series (every 1 s) from two functions of the second: each process's GB."""
    return [
        {
            "t": float(s),
            "time": t0 + s,
            "spool_gb": 1.0,
            "producer_gb": producer(s),
            "consumer0_gb": consumer(s),
        }
        for s in range(200)
    ]


def test_memory_is_judged_over_each_processs_steady_work_not_its_load_and_compile():
    """The together phase as a shared GPU sees it: the producer loads its target (0.5 -> 16 GB over 30 s)
    then produces from t=40; the consumer waits at its CUDA context's 0.6 GB, compiles, and logs its first
    interval at t=90, then holds 40 GB. Both are flat from their own start (judged from t=0 both read as
    growing); a consumer that still grows 0.1 GB/s after its start is not flat."""
    from pipeline_bench import _flat, steady_memory

    def producer(s):
        return 0.5 + min(s, 30) / 30 * 15.5

    def consumer(s):
        return 0.6 if s < 60 else 40.0

    series = _series(producer, consumer)
    starts = {"producer": 1040.0, "consumer": 1090.0}
    assert not _flat(series, "producer_gb")["flat"] and not _flat(series, "consumer0_gb")["flat"]
    got = steady_memory(series, starts)
    assert set(got) == {"producer_gb", "consumer0_gb"}
    assert got["producer_gb"]["flat"] and got["consumer0_gb"]["flat"]
    assert got["consumer0_gb"]["steady_from_s"] == 90.0 and got["consumer0_gb"]["before_gb"] < 40
    growing = steady_memory(_series(producer, lambda s: 40.0 + 0.1 * max(0, s - 90)), starts)
    assert not growing["consumer0_gb"]["flat"] and growing["producer_gb"]["flat"]
