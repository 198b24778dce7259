"""Issue 6 acceptance: the README's first command runs end to end (shortened with --quick)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pipeline_helpers import cpu_env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_demo_trains_checkpoints_to_s3_and_leaves_nothing_running(tmp_path):
    run_dir, summary_path = tmp_path / "demo", tmp_path / "summary.json"
    env = cpu_env()
    env.pop("OMP_NUM_THREADS")  # run_all.sh splits the cores itself, as for a user
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash.common.demo",
            "--quick",
            "--run-dir",
            str(run_dir),
            "--json",
            str(summary_path),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "=== dflash-spool demo: what was trained ===" in proc.stdout
    s = json.loads(summary_path.read_text())
    assert s["samples_trained"] == s["samples_produced"] > 100
    assert s["loss_last"] < s["loss_first"], s
    assert s["tau_last"] > s["tau_first"] >= 1.0, s
    # the checkpoint is in the (moto) S3 store and `latest` names the last step
    assert s["checkpoint"].startswith("s3://dflash-demo/checkpoints/demo/step-")
    assert s["checkpoint_latest"] == s["checkpoint"].rsplit("/", 1)[1]
    assert {p.rsplit("/", 1)[1] for p in s["plots"]} >= {"loss.png", "tau.png", "throughput.png"}
    # no process of the pipeline is left running
    pids = [int(line.split()[1]) for line in (run_dir / "pids").read_text().splitlines() if line.strip()]
    assert pids and not any(_alive(p) for p in pids)
    assert s["s3_server_pid"] and not _alive(s["s3_server_pid"])  # the demo's S3 server was stopped
