"""Watching the processes of a benchmark: the spool's shards and bytes and each process's memory (GPU via
nvidia-smi, or RSS on the CPU) sampled over time, and stopping what is still running."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from dflash.common.contract.spool import Spool


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return out


def _rss_gb(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            line = next(
                x for x in Path(f"/proc/{p}/status").read_text().splitlines() if x.startswith("VmRSS")
            )
            total += int(line.split()[1]) * 1024
        except (OSError, StopIteration):
            pass
    return total / 1e9


def _gpu_mem_gb() -> dict[int, float]:
    """{pid: GB} of the GPU's compute processes (nvidia-smi), {} without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rows = [line.split(",") for line in out.strip().splitlines() if "," in line]
    return {int(p): float(m) / 1024 for p, m in rows if p.strip().isdigit()}


class Sampler(threading.Thread):
    """Every ``every_s``: the spool's shards and bytes, each process's GPU memory (or RSS on the CPU)."""

    def __init__(self, spool: Path, procs: dict[str, subprocess.Popen], gpu: bool, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.spool, self.procs, self.gpu, self.every_s = spool, procs, gpu, every_s
        self.series: list[dict] = []
        self.t0, self._halt = time.time(), threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            now = time.time()  # "time" (epoch) lines the samples up with the processes' own metrics
            rec: dict = {"t": round(now - self.t0, 2), "time": round(now, 2)}
            if self.spool.is_dir():
                stats = Spool(self.spool, create=False).stats()["states"]
                rec.update(
                    ready=stats["ready"]["shards"],
                    claimed=stats["claimed"]["shards"],
                    spool_gb=round(sum(stats[s]["bytes"] for s in ("tmp", "ready", "claimed")) / 1e9, 4),
                )
            gpu = _gpu_mem_gb() if self.gpu else {}
            for name, proc in self.procs.items():
                tree = _tree(proc.pid)
                rec[f"{name}_gb"] = round(
                    sum(gpu.get(p, 0.0) for p in tree) if self.gpu else _rss_gb(tree), 3
                )
            self.series.append(rec)

    def stop(self) -> list[dict]:
        self._halt.set()
        self.join()
        return self.series


def stop(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM what is still running (the producer CLI forwards it to its workers), then SIGKILL."""
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
