"""Helpers for tests that run real producer/consumer processes (not collected: no test_ prefix)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from dflash.common.contract.names import shard_name
from dflash.common.contract.shard import Shard, ShardMeta
from dflash.common.contract.shard_writer import write_shard
from dflash.common.contract.spool import Spool

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def as_from_a_terminal(cmd: list[str]) -> list[str]:
    """``cmd`` started with SIGINT at its default, as a shell in a terminal starts it.

    A process inherits an ignored SIGINT, and pytest run in the background of a script (a CI runner,
    ``cmd &``) has it ignored; bash cannot trap a signal ignored on entry, so run_all.sh would not see a
    Ctrl-C sent before its children install their own handlers, and a test's Ctrl-C would be lost."""
    reset = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", reset, *cmd]


def cpu_env(threads: int = 1, **extra: str) -> dict[str, str]:
    """Environment for a child process on the 2-core CI box: one torch thread each (oversubscribed OpenMP
    threads make CPU training many times slower), no wandb, the venv's scripts first on PATH."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def consume_cmd(spool: Path, target: Path, *extra: str) -> list[str]:
    return [
        str(BIN / "dflash-consume"),
        "--gpu",
        "cpu",
        "--spool",
        str(spool),
        "--target",
        str(target),
        "--context-tokens",
        "512",
        "--num-anchors",
        "32",
        "--max-anchors-per-doc",
        "8",
        "--log-every",
        "5",
        *extra,
    ]


def produce_cmd(spool: Path, target: Path, dataset: Path, *extra: str) -> list[str]:
    return [
        str(BIN / "dflash-produce"),
        "--gpus",
        "cpu:1",
        "--model",
        str(target),
        "--dataset",
        str(dataset),
        "--spool",
        str(spool),
        "--max-length",
        "512",
        "--batch-tokens",
        "4096",
        *extra,
    ]


def run(cmd: list[str], *, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or cpu_env())


def write_synthetic_spool(
    root: Path,
    *,
    hidden_size: int,
    layer_ids: list[int],
    num_shards: int,
    samples_per_shard: int,
    tokens_per_sample: int,
    vocab: int,
    seed: int = 0,
    producer_id: str = "p0",
) -> Spool:
    """A finished spool of random shards (for consumer tests that do not need real hidden states)."""
    spool = Spool(root)
    g = torch.Generator().manual_seed(seed)
    k = len(layer_ids)
    for seq in range(num_shards):
        n, t = samples_per_shard, samples_per_shard * tokens_per_sample
        shard = Shard(
            input_ids=torch.randint(0, vocab, (t,), generator=g, dtype=torch.int32),
            loss_mask=torch.rand(t, generator=g) > 0.3,
            cu_seqlens=torch.arange(0, t + 1, tokens_per_sample, dtype=torch.int64),
            sample_index=torch.arange(seq * n, (seq + 1) * n, dtype=torch.int64),
            hidden=torch.randn(t, k * hidden_size, generator=g).to(torch.bfloat16),
            meta=ShardMeta(
                target_model="tiny",
                layer_ids=layer_ids,
                hidden_size=hidden_size,
                producer_id=producer_id,
                bucket=tokens_per_sample,
            ),
        )
        tmp = spool.new_tmp_path(shard_name(tokens_per_sample, producer_id, seq))
        spool.publish(tmp, nbytes=write_shard(tmp, shard))
    spool.register_producers([producer_id])
    spool.mark_done(producer_id)
    return spool


class SemaphoreSpy:
    """A ``sitecustomize`` for the processes a test starts (``env`` puts it on PYTHONPATH; spawned children
    load it too) that logs every multiprocessing lock made: named ones (a spawn context's: a file in
    /dev/shm that outlives a process-group SIGKILL) with their stack, anonymous ones (a fork context's,
    unlinked at once) as a count, so a test can also check that the spy ran."""

    def __init__(self, tmp_path: Path):
        site = tmp_path / "semaphore-spy"
        site.mkdir()
        self.log = site / "locks.log"
        self.log.write_text("")
        (site / "sitecustomize.py").write_text(
            "import multiprocessing.synchronize as s, os, traceback\n"
            "_init = s.SemLock.__init__\n"
            "def _spy(self, *a, ctx=None, **k):\n"
            "    _init(self, *a, ctx=ctx, **k)\n"
            "    named = self._semlock.name is not None\n"
            f"    with open({str(self.log)!r}, 'a') as f:\n"
            "        f.write(f'named pid {os.getpid()}:\\n' + ''.join(traceback.format_stack()) + '\\x00'"
            " if named else 'anonymous\\x00')\n"
            "s.SemLock.__init__ = _spy\n"
        )
        old = os.environ.get("PYTHONPATH")
        self.env = {"PYTHONPATH": str(site) + (os.pathsep + old if old else "")}

    def _entries(self) -> list[str]:
        return [e for e in self.log.read_text().split("\x00") if e]

    def named(self) -> list[str]:
        """The stack of each named semaphore made."""
        return [e for e in self._entries() if e.startswith("named")]

    def anonymous(self) -> int:
        return sum(e == "anonymous" for e in self._entries())


def process_alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a killed child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
