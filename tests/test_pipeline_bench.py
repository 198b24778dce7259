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
