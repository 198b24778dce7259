"""The user's path, not a harness: a second run pointed at a live run's spool, and the same run launched
twice at once, are refused, and the live run is unaffected. (A run stopped the ways a user stops it, Ctrl-C,
a crash of a consumer or of the producer, then run again with the same command: tests/test_chaos.py, whose
CI plan takes each of those ways back.) Every verdict comes from the consumers' sample ledgers and the
checkpoints (tests/ledger_audit.py: 0 samples trained twice along the final timeline or within a life, 0
eligible samples missing), never from how fast something ran; waits are on files and exit codes, with
timeouts only as hang guards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from ledger_audit import audit, eligible_samples, launches_from_output, read_jsonl
from pipeline_helpers import REPO, as_from_a_terminal, cpu_env

from dflash.tools.demo.assets import demo_dataset_path

ROWS = 24
MAX_LENGTH = 512
# --budget-gb: a spool of ~3 shards keeps the producer alive (blocked on backpressure) while the consumer
# trains, as a long run's producer is when another launch is pointed at its spool.
PRODUCER_ARGS = f"--max-length {MAX_LENGTH} --batch-tokens 2048 --budget-gb 0.002"
CONSUMER_ARGS = (
    "--context-tokens 512 --num-anchors 32 --max-anchors-per-doc 8 --save-every 2 --log-every 1 "
    "--compile-backend eager"
)
HANG_S = 240  # a hang guard, never a verdict


def _dataset(path: Path, rows: int = ROWS) -> Path:
    with open(demo_dataset_path(), encoding="utf-8") as f:
        lines = [json.loads(line) for _, line in zip(range(rows), f, strict=False)]
    path.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in lines))
    return path


def _cmd(tiny_target, data, run, run_dir, spool, ckpt, *extra):
    return [
        "bash",
        str(REPO / "ops" / "run_all.sh"),
        "--producers",
        "cpu:1",
        "--consumers",
        "cpu:1",
        "--model",
        str(tiny_target),
        "--dataset",
        str(data),
        "--run",
        run,
        "--run-dir",
        str(run_dir),
        "--spool",
        str(spool),
        "--checkpoint",
        str(ckpt),
        "--producer-args",
        PRODUCER_ARGS,
        "--consumer-args",
        CONSUMER_ARGS,
        "--keep-spool",
        *extra,
    ]


def _env(tmp_path: Path) -> dict:
    return cpu_env(HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false")


class Life:
    """One ``run_all.sh`` invocation in its own session (so a signal can go to its whole group, as
    Ctrl-C in a terminal does), its stdout/stderr in files."""

    def __init__(self, cmd, env, tmp_path: Path, n: int):
        self.out_path, self.err_path = tmp_path / f"life{n}.out", tmp_path / f"life{n}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                as_from_a_terminal(cmd), env=env, stdout=out, stderr=err, start_new_session=True
            )

    def launch(self) -> dict[str, int]:
        ls = launches_from_output(self.out_path.read_text())
        return ls[-1] if ls else {}

    def wait(self, timeout: float = HANG_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"run_all.sh hung; stderr: {self.err_path.read_text()[-3000:]}")

    def kill_all(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def text(self) -> str:
        return self.out_path.read_text() + self.err_path.read_text()


def _wait_for(pred, life: Life, what: str, timeout: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert life.proc.poll() is None, f"run_all.sh ended before {what}:\n{life.text()[-3000:]}"
        assert time.monotonic() < deadline, f"hang guard: no {what} within {timeout} s"
        time.sleep(0.1)


def _ledger_lines(run_dir: Path, pid: int) -> int:
    return sum(1 for r in read_jsonl(run_dir / "metrics" / "ledger-r0.jsonl") if r["pid"] == pid)


@pytest.mark.slow
def test_a_live_runs_spool_refuses_a_second_launch_and_another_run(tmp_path, tiny_target):
    """(5) the same command started twice at the same moment: exactly one runs, the other is refused with
    one line; (4) another run pointed at the live run's spool: refused with one line naming both runs;
    the live run is unaffected (its ledger: every eligible sample once). Afterwards (nothing live) the
    other run is still refused, by the spool's run record, until --fresh-spool."""
    from dflash.common.checkpoints.load import load_checkpoint

    data = _dataset(tmp_path / "data.jsonl", rows=12)
    run_dir, spool, ckpt = tmp_path / "run", tmp_path / "spool", tmp_path / "ckpt"
    cmd = _cmd(tiny_target, data, "alpha", run_dir, spool, ckpt)
    env = _env(tmp_path)
    twins = [Life(cmd, env, tmp_path, 1), Life(cmd, env, tmp_path, 2)]
    others: list[subprocess.CompletedProcess] = []
    try:
        # the loser is refused before it starts anything; the winner trains
        deadline = time.monotonic() + HANG_S
        while all(t.proc.poll() is None for t in twins):
            assert time.monotonic() < deadline, "hang guard: neither twin was refused"
            time.sleep(0.05)
        loser = next(t for t in twins if t.proc.poll() is not None)
        winner = next(t for t in twins if t is not loser)
        assert loser.proc.returncode == 2, loser.text()
        err = loser.err_path.read_text().strip().splitlines()
        assert len(err) == 1 and "is in use by a live launch of run 'alpha'" in err[0], err
        assert "started" not in loser.out_path.read_text()

        _wait_for(lambda: "consumer-0" in winner.launch(), winner, "a consumer")
        c = winner.launch()["consumer-0"]
        _wait_for(lambda: _ledger_lines(run_dir, c) >= 1, winner, "a step")
        beta = _cmd(tiny_target, data, "beta", tmp_path / "run-beta", spool, tmp_path / "ckpt-beta")
        others.append(subprocess.run(beta, env=env, capture_output=True, text=True, timeout=HANG_S))
        assert winner.wait() == 0, winner.text()[-3000:]
        # nothing live now: the spool still belongs to alpha
        others.append(subprocess.run(beta, env=env, capture_output=True, text=True, timeout=HANG_S))
    finally:
        for t in twins:
            t.kill_all()
    live_refusal, record_refusal = others
    assert live_refusal.returncode == 2, live_refusal.stderr
    lines = live_refusal.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in live_refusal.stderr, live_refusal.stderr
    assert "live launch of run 'alpha'" in lines[0] and "this is run 'beta'" in lines[0], lines[0]
    assert record_refusal.returncode == 2, record_refusal.stderr
    lines = record_refusal.stderr.strip().splitlines()
    assert len(lines) == 1 and "belongs to run 'alpha'" in lines[0] and "run 'beta'" in lines[0], lines
    assert not (tmp_path / "run-beta" / "logs").exists(), "the refused run started something"

    final = load_checkpoint(str(ckpt), "alpha")
    eligible = eligible_samples(data, tiny_target, tmp_path / "hf-audit", max_length=MAX_LENGTH)
    got = audit(run_dir, [winner.launch()], final.step, eligible)
    assert got["duplicates"] == 0 and got["missing"] == 0, got
    assert set(final.trained.indices().tolist()) == eligible
