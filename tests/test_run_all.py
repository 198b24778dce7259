"""ops/run_all.sh: every argument error and a missing GPU are one clear line, before anything starts."""

from __future__ import annotations

import subprocess

import pytest
from pipeline_helpers import REPO, SemaphoreSpy, cpu_env

pytestmark = pytest.mark.pipeline  # every test here starts processes

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


def _env_with_gpus(tmp_path, n: int) -> dict:
    """A PATH whose nvidia-smi -L lists ``n`` GPUs."""
    env = cpu_env()
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        f'#!/bin/sh\ni=0; while [ $i -lt {n} ]; do echo "GPU $i: NVIDIA H200"; i=$((i+1)); done\n'
    )
    fake.chmod(0o755)
    return env


def test_missing_gpus_are_named(tmp_path):
    env = _env_with_gpus(tmp_path, 1)
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
    env = _env_with_gpus(tmp_path, 4)
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


def test_sigterm_checkpoints_then_stops_every_process(tmp_path, tiny_target):
    """Ctrl-C / SIGTERM on the pipeline: consumers finish the step and checkpoint first, then every
    process is stopped; exit status 130."""
    import json
    import os
    import signal
    import time

    from dflash.common.checkpoints.load import load_checkpoint
    from dflash.tools.demo.assets import demo_dataset_path

    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    cmd = [
        "bash",
        SCRIPT,
        "--producers",
        "cpu:1",
        "--consumers",
        "cpu:1",
        "--model",
        str(tiny_target),
        "--dataset",
        str(demo_dataset_path()),
        "--run",
        "t",
        "--run-dir",
        str(run_dir),
        "--spool",
        str(tmp_path / "spool"),
        "--checkpoint",
        str(ckpt),
        "--producer-args",
        "--max-length 512 --batch-tokens 4096",
        "--consumer-args",
        "--context-tokens 512 --num-anchors 32 --max-anchors-per-doc 8 --log-every 1 "
        "--save-every 1000 --compile-backend eager",
    ]
    proc = subprocess.Popen(
        cmd,
        env=cpu_env(),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ledger = run_dir / "metrics" / "ledger-r0.jsonl"
    deadline = time.monotonic() + 240
    try:
        while not (ledger.exists() and len(ledger.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "pipeline did not start training"
            time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-2000:]
    assert "stop requested: saving a checkpoint" in (run_dir / "logs" / "consumer-0.log").read_text()
    assert not (tmp_path / "spool").exists(), "a stopped launch's own new spool stays in RAM"
    last_step = json.loads(ledger.read_text().splitlines()[-1])["step"]
    assert load_checkpoint(str(ckpt), "t").step == last_step  # nothing trained after the checkpoint
    for line in (run_dir / "pids").read_text().splitlines():
        pid = int(line.split()[1])
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().split()[2] == "Z", f"{line} still running"
        except ProcessLookupError:
            pass


def _pipeline(tmp_path, tiny_target, *extra: str) -> list[str]:
    from dflash.tools.demo.assets import demo_dataset_path

    return [
        "bash",
        SCRIPT,
        "--producers",
        "cpu:1",
        "--consumers",
        "cpu:1",
        "--model",
        str(tiny_target),
        "--dataset",
        str(demo_dataset_path()),
        "--run",
        "t",
        "--run-dir",
        str(tmp_path / "run"),
        "--spool",
        str(tmp_path / "shm" / "t"),
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--producer-args",
        "--max-length 512 --batch-tokens 4096",
        *extra,
    ]


def test_a_consumer_failing_at_start_up_leaves_nothing_in_shm(tmp_path, tiny_target):
    """A consumer that fails at start-up (here: its --target-layer-ids are not the spool's)
    leaves nothing behind: no named semaphore in any process of the launch (each is a file in /dev/shm that
    outlives the process-group kill that stops the producers), and no spool (this launch created it;
    ``tmp_path/shm`` stands in for /dev/shm)."""
    spy = SemaphoreSpy(tmp_path)
    args = "--context-tokens 512 --num-anchors 32 --target-layer-ids 0,1 --compile-backend eager"
    proc = subprocess.run(
        _pipeline(tmp_path, tiny_target, "--consumer-args", args),
        env={**cpu_env(), **spy.env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    # the consumer refuses the other layers at start-up (exit 2) when the producer has written them into
    # the spool's run record by then, else at its first shard (exit 1): which one comes first is timing
    refused_at_start = proc.returncode == 2 and "captured target layers" in out
    failed_at_first_shard = proc.returncode == 1 and "holds target layers" in out
    assert refused_at_start or failed_at_first_shard, out[-3000:]
    assert "run_all.sh: FAILED: consumer-0" in out, out[-3000:]
    assert spy.anonymous() >= 1, (
        "the producers made no lock at all: the spy did not run, or they never started"
    )
    assert spy.named() == [], spy.named()[0][-3000:]
    assert list((tmp_path / "shm").iterdir()) == [], out[-2000:]
    assert "removed the spool" in out


def _stub_commands(bin_dir, produce_body: str) -> None:
    """Stand-ins for the dflash commands run_all.sh starts (shell scripts, no torch): the spool commands
    succeed, the consumer finishes at once, the producer runs ``produce_body``."""
    bin_dir.mkdir()
    scripts = {
        "dflash-spool": '#!/bin/sh\n[ "$1" = prepare ] && mkdir -p "$2/state"\nexit 0\n',
        "dflash-consume": "#!/bin/sh\necho consumed\n",
        "dflash-produce": f"#!/bin/sh\n{produce_body}\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


def test_the_same_command_right_after_a_launch_exits_is_not_refused(tmp_path):
    """A launch is over when run_all.sh exits: re-running the same command at once is accepted, even while a
    process of the old launch is still going away with the launch's log pipe open (a producer worker
    killed with its parent, multiprocessing's resource tracker). Here the stand-in producer leaves a child
    that keeps its output open for 30 s after run_all.sh exits; it holds no lock of its own (Python starts
    children with close_fds), as a real worker does not. The log pipes' tee must not hold the launch lock
    either, or the re-run is refused for as long as such a child lives."""
    import contextlib
    import os
    import signal
    import time

    bin_dir = tmp_path / "bin"
    # the lingering child closes fd 9 (run_all.sh's lock) as Python's subprocess and spawn do
    _stub_commands(bin_dir, 'sh -c \'echo "$$" >> "$STUB_CHILD_PIDS"; exec sleep 30\' 9>&- &\necho produced')
    pid_file = tmp_path / "lingering.pids"
    env = cpu_env(STUB_CHILD_PIDS=str(pid_file))
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    cmd = ["bash", SCRIPT, "--producers", "cpu:1", "--consumers", "cpu:1", "--model", "m", "--dataset", "d"]
    cmd += [
        "--run",
        "t",
        "--run-dir",
        str(tmp_path / "run"),
        "--spool",
        str(tmp_path / "spool"),
        "--keep-spool",
    ]
    try:
        for launch in (1, 2):
            t0 = time.monotonic()
            err = tmp_path / f"launch{launch}.err"
            with open(err, "w") as err_f:  # a file, not a pipe: the test waits for run_all.sh alone
                rc = subprocess.run(
                    cmd, stdout=subprocess.DEVNULL, stderr=err_f, timeout=60, env=env, cwd=tmp_path
                )
            assert rc.returncode == 0, f"launch {launch}: {err.read_text()}"
            assert time.monotonic() - t0 < 20, "run_all.sh waited for a process it did not start"
    finally:
        for pid in pid_file.read_text().split() if pid_file.exists() else []:  # only the stand-ins' children
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
