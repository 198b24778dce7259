"""the user's path, not a harness. ``ops/run_all.sh`` on the CPU is stopped the ways a user stops
it (Ctrl-C, a crash of the consumer, a crash of the producer) and then simply run again with the same
command; a second run pointed at a live run's spool, and the same run launched twice at once, are refused.
Every verdict comes from the consumers' sample ledgers and the checkpoints (tests/ledger_audit.py: 0
samples trained twice along the final timeline or within a life, 0 eligible samples missing), never from
how fast something ran; waits are on files and exit codes, with timeouts only as hang guards.
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
# trains, so "kill the producer mid-run" always finds it running.
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
def test_ctrl_c_then_kill9_consumer_then_kill9_producer_each_followed_by_the_same_command(
    tmp_path, tiny_target
):
    """(1) SIGINT mid-run, (2) SIGKILL of the consumer, (3) SIGKILL of the producer, each followed by the
    same command, no flag added: over the four lives no sample is trained twice (along the final
    timeline, or within a life) and none is missing."""
    from dflash.common.checkpoints.load import load_checkpoint

    data = _dataset(tmp_path / "data.jsonl")
    run_dir, spool, ckpt = tmp_path / "run", tmp_path / "spool", tmp_path / "ckpt"
    cmd = _cmd(tiny_target, data, "rerun", run_dir, spool, ckpt)
    env = _env(tmp_path)
    lives: list[Life] = []
    try:
        # life 1: Ctrl-C (SIGINT to the whole process group) after a few committed steps
        lives.append(life := Life(cmd, env, tmp_path, 1))
        _wait_for(lambda: "consumer-0" in life.launch(), life, "a consumer")
        c1 = life.launch()["consumer-0"]
        _wait_for(lambda: _ledger_lines(run_dir, c1) >= 2, life, "two steps in life 1")
        os.killpg(life.proc.pid, signal.SIGINT)
        assert life.wait() == 130, life.text()[-3000:]
        assert "failed" not in life.err_path.read_text(), life.text()[-3000:]  # a clean stop is no failure
        producer_log = (run_dir / "logs" / "producer.log").read_text()
        assert "worker(s) failed" not in producer_log, producer_log[-2000:]

        # life 2: the same command; kill -9 the consumer after two steps of its own
        lives.append(life := Life(cmd, env, tmp_path, 2))
        _wait_for(lambda: "consumer-0" in life.launch(), life, "a consumer")
        c2 = life.launch()["consumer-0"]
        _wait_for(lambda: _ledger_lines(run_dir, c2) >= 2, life, "two steps in life 2")
        os.kill(c2, signal.SIGKILL)
        assert life.wait() != 0

        # life 3: the same command; kill -9 the producer (blocked on the small budget) once training runs
        lives.append(life := Life(cmd, env, tmp_path, 3))
        _wait_for(lambda: "consumer-0" in life.launch(), life, "a consumer")
        c3, p3 = life.launch()["consumer-0"], life.launch()["producer"]
        _wait_for(lambda: _ledger_lines(run_dir, c3) >= 1, life, "a step in life 3")
        assert Path(f"/proc/{p3}").exists(), "the producer finished before it could be killed"
        os.kill(p3, signal.SIGKILL)
        assert life.wait() != 0

        # life 4: the same command runs to the end
        lives.append(life := Life(cmd, env, tmp_path, 4))
        assert life.wait() == 0, life.text()[-4000:]
    finally:
        for life in lives:
            life.kill_all()

    launches = [life.launch() for life in lives]
    assert all("consumer-0" in x for x in launches), launches
    final = load_checkpoint(str(ckpt), "rerun")
    eligible = eligible_samples(data, tiny_target, tmp_path / "hf-audit", max_length=MAX_LENGTH)
    assert len(eligible) >= ROWS - 2
    got = audit(run_dir, launches, final.step, eligible)
    print(f"rerun audit: {got}")
    assert got["duplicates"] == 0 and got["missing"] == 0
    assert set(final.trained.indices().tolist()) == eligible
    assert got["lost_tails"][0] == 0, "Ctrl-C lost trained steps (its stop checkpoint should hold them all)"
    for n, text in enumerate((life.out_path.read_text() for life in lives[1:]), 2):
        assert "run 'rerun' continues" in text, f"life {n} did not say it continues the run:\n{text[-2000:]}"
    # nothing left behind: the spool is drained, no process of any life is running
    from dflash.common.contract.spool import Spool

    assert Spool(spool, create=False).is_drained()
    for launch in launches:
        for pid in launch.values():
            st = Path(f"/proc/{pid}/stat")
            assert not st.exists() or st.read_text().rsplit(")", 1)[1].split()[0] == "Z", f"{pid} still runs"


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
