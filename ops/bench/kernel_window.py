"""A kernel table of a few steady iterations of a loop, for the benchmarks: where the time goes.

Why a window around a wrapped per-iteration function (not the whole run): the first iterations hold
compiles and autotuning, and a table over a whole run hides the steady state under them. The window
starts before call FIRST and stops before call FIRST + COUNT (or at ``finish``), synchronizing the device
at both ends, so its wall time covers COUNT whole iterations of the loop as it runs them (hand-offs and
waits included). GPU busy = the kernels' summed device time over that wall time (one stream: an upper
bound where kernels overlap).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

PROFILER_RECORDS = frozenset(
    {"Command Buffer Full", "Lazy Function Loading", "Activity Buffer Request", "Buffer Flush"}
)
"""CUPTI records that the profiler lists among the device's events but are not kernels."""


class KernelWindow:
    """torch.profiler over calls FIRST..FIRST+COUNT-1 of the function `wrap` returns."""

    def __init__(
        self, first: int, count: int, device: torch.device, out: Path | None = None, label: str = ""
    ):
        self.first, self.count, self.device, self.out, self.label = first, count, device, out, label
        self.calls = 0
        self.result: dict | None = None
        self._prof = None
        self._t0 = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def windowed(*args, **kwargs):
            self.calls += 1
            if self.calls == self.first:
                self._start()
            elif self.calls == self.first + self.count:
                self.finish()
            return fn(*args, **kwargs)

        return windowed

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _start(self) -> None:
        self._sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def finish(self) -> dict | None:
        """Stop the window if it is open; the summary (also in ``result``), None if it never opened."""
        if self._prof is None:
            return self.result
        self._sync()
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        averages = prof.key_averages()
        cuda = self.device.type == "cuda"
        # kernels and copies only: a CPU op's device time is its kernels' again, and CUPTI's own records
        # (a full launch queue, buffer requests) are not GPU work
        kernels = [
            e
            for e in averages
            if e.device_type == torch.autograd.DeviceType.CUDA and e.key not in PROFILER_RECORDS
        ]
        device_us = sum(e.self_device_time_total for e in kernels) if cuda else 0.0
        top = (
            sorted(kernels, key=lambda e: e.self_device_time_total)
            if cuda
            else sorted(averages, key=lambda e: e.self_cpu_time_total)
        )
        self.result = {
            "iterations": f"{self.first}..{self.first + self.count - 1}",
            "wall_ms": round(wall * 1e3, 1),
            "device_ms": round(device_us / 1e3, 1),
            "gpu_busy": round(device_us / 1e6 / wall, 3) if cuda and wall else None,
            "top_kernels": [
                {"name": e.key[:120], "calls": e.count, "ms": round(e.self_device_time_total / 1e3, 2)}
                for e in reversed(top[-25:])
            ],
            "top_host_ops": [
                {"name": e.key[:120], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)}
                for e in sorted(averages, key=lambda e: e.self_cpu_time_total)[-15:][::-1]
            ],
        }
        if self.out is not None:
            sort = "self_device_time_total" if cuda else "self_cpu_time_total"
            table = averages.table(sort_by=sort, row_limit=40, max_name_column_width=100)
            host = averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=100)
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(
                f"{self.label}: iterations {self.result['iterations']}, wall {self.result['wall_ms']} ms, "
                f"device {self.result['device_ms']} ms, busy {self.result['gpu_busy']}\n\n"
                f"by device time:\n{table}\n\nby host time:\n{host}\n"
            )
        return self.result
