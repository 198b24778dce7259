"""ops/run_all.sh: every argument error and a missing GPU are one clear line, before anything starts."""

from __future__ import annotations

import subprocess

import pytest
from pipeline_helpers import REPO, cpu_env

SCRIPT = str(REPO / "ops" / "run_all.sh")
OK = ["--model", "m", "--dataset", "d"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "unknown argument '--bogus'"),
        (["--dataset", "d"], "--model is required"),
        (["--model", "m"], "--dataset is required"),
        ([*OK, "--producers", "zero-four"], "--producers 'zero-four': expected GPU indices like 0-4"),
        ([*OK, "--consumers", "7-5"], "--consumers '7-5': range 7-5 runs backwards"),
        ([*OK, "--max-steps", "-3"], "--max-steps must be a positive integer"),
        ([*OK, "--restarts", "x"], "--restarts must be a non-negative integer"),
        ([*OK, "--run"], "--run needs a value"),
        ([*OK, "--producers", "0-1", "--consumers", "1"], None),  # overlap or missing GPUs: see below
    ],
)
def test_argument_errors_are_one_line(tmp_path, args, message):
    proc = subprocess.run(
        ["bash", SCRIPT, *args], capture_output=True, text=True, timeout=60, env=cpu_env(), cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run_all.sh: error: "), proc.stderr
    if message:
        assert message in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing was started or created


def test_missing_gpus_are_named(tmp_path):
    env = cpu_env()
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: x)'\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    proc = subprocess.run(
        ["bash", SCRIPT, *OK, "--producers", "0-4", "--consumers", "5-7"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "run_all.sh: error: GPU 7 requested but this machine has 1 GPU(s) (nvidia-smi -L); "
        "use e.g. --producers cpu:1 --consumers cpu:1 for a CPU run"
    )


def test_no_nvidia_smi_means_no_gpus(tmp_path):
    env = cpu_env()
    env["PATH"] = "/usr/bin:/bin"  # no nvidia-smi (and no venv scripts) on PATH
    proc = subprocess.run(
        ["bash", SCRIPT, *OK], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path
    )
    assert proc.returncode == 2
    assert "GPU 7 requested but this machine has 0 GPU(s)" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_same_gpu_for_both_roles_is_refused(tmp_path):
    env = cpu_env()
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    (tmp_path / "nvidia-smi").write_text('#!/bin/sh\nfor i in 0 1 2 3; do echo "GPU $i: H200"; done\n')
    (tmp_path / "nvidia-smi").chmod(0o755)
    proc = subprocess.run(
        ["bash", SCRIPT, *OK, "--producers", "0-1", "--consumers", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "run_all.sh: error: GPU 1 is listed for both producers and consumers"
