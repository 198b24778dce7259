"""Where a training step's time goes, per log interval: a host stall told apart from a slow kernel.

- **GPU busy**: a timing event is recorded on the compute stream before each step's first kernel and after
  its last (the optimizer's). The GPU's own clock then gives, per interval, the time spent inside steps
  (``gpu_ms`` per step) against the time from the previous interval's last step end to this one's
  (``gpu_busy`` = the share of that window the stream spent in steps; the rest it idled between steps,
  waiting for the host to launch the next one). Events are read only once they have completed
  (``query()``): reading them never syncs; a step still running is counted in the next interval.
- **Host**: the main thread's time blocked on the next step's inputs (``host_wait_ms`` per step: a slow
  data path; ``wait_ms_by_cause`` says which stage of the data path it waited on, and ``feed_ms`` /
  ``pipeline_ms`` what each data thread spent per step: consumer/data_clock.py) and spent launching a
  step (``host_launch_ms`` per step: on a GPU the launches run ahead of the kernels unless the host is
  slow or the launch queue is full).
- **Python's garbage collector**: every collection in the process, timed with ``gc.callbacks``
  (``gc_ms``, ``gc_max_ms``, ``gc_count`` over the interval, ``gc_full`` of them full ones); a collection holds the GIL for its whole
  length, so the launching thread waits on it wherever it runs.
- **CUDA caching allocator**: ``alloc_retries`` (the allocator freed its cache and retried a cudaMalloc:
  a device-wide sync each time), reserved memory.
- **The GPU's clocks**: SM clock, temperature and power at the log line (NVML, when ``pynvml`` is
  installed; otherwise left out): a step time that drifts up with the busy fraction at 1 and the clock
  falling is the chip throttling, not the loop.

On the CPU only the host's figures are reported (no events, no allocator). ``gc_mode`` (HostConfig) is
applied here too: ``freeze``/``interval`` freeze what is alive after the warm-up steps (the model, its
compiled graphs), ``interval`` also turns automatic collection off and collects at each log line.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dflash.consumer.data_clock import DataPathClock

log = logging.getLogger(__name__)


class LoopWatch:
    """Per-interval step timing (module docstring). ``begin()``/``end()`` bracket each step's launches,
    ``waiting()`` brackets the wait for the next step's inputs, ``interval()`` returns the interval's figures
    and starts the next."""

    def __init__(
        self,
        device: torch.device,
        *,
        gc_mode: str = "python",
        freeze_at_step: int = 2,
        data_clock: DataPathClock | None = None,
    ) -> None:
        self.data_clock = data_clock
        """The data path's stage clocks, which a wait is charged to (None: the wait is only timed)."""
        self.cuda = device.type == "cuda"
        self.device = device
        self.gc_mode = gc_mode
        self.freeze_at_step = freeze_at_step
        self.frozen = False
        self._gc_t0: float | None = None
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._last_end: torch.cuda.Event | None = None
        self._host_t0 = 0.0
        self._retries0 = self._alloc_retries()
        self._nvml = self.cuda  # until the first query fails (no pynvml): then never again
        self._reset()
        gc.callbacks.append(self._on_gc)

    def _reset(self) -> None:
        self.steps = 0
        self.wait_s = 0.0
        self.launch_s = 0.0
        self.gc_s = 0.0
        self.gc_max_s = 0.0
        self.gc_count = 0
        self.gc_full = 0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            took = time.perf_counter() - self._gc_t0
            self._gc_t0 = None
            self.gc_s += took
            self.gc_max_s = max(self.gc_max_s, took)
            self.gc_count += 1
            self.gc_full += info.get("generation") == 2

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """The main thread blocks on the next step's inputs inside: timed, and charged to the data path's
        stages that ran meanwhile."""
        t0 = time.perf_counter()
        try:
            if self.data_clock is None:
                yield
            else:
                with self.data_clock.during():
                    yield
        finally:
            self.wait_s += time.perf_counter() - t0

    def begin(self) -> None:
        self._host_t0 = time.perf_counter()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._pending.append((start, start))  # the end replaces the second slot in end()

    def end(self, step: int) -> None:
        """After the step's last launch (``step``: the steps done, for the GC freeze after warm-up)."""
        if self.cuda:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            self._pending[-1] = (self._pending[-1][0], stop)
        self.launch_s += time.perf_counter() - self._host_t0
        self.steps += 1
        if step == self.freeze_at_step and self.gc_mode != "python" and not self.frozen:
            gc.collect()  # what is garbage now is not frozen with the rest
            gc.freeze()
            if self.gc_mode == "interval":
                gc.disable()
            self.frozen = True

    def at_log_line(self) -> None:
        """``interval`` mode: the one collection of the interval (timed like any other)."""
        if self.gc_mode == "interval" and self.frozen:
            gc.collect()

    def _gpu_figures(self) -> dict:
        done = 0
        while done < len(self._pending) and self._pending[done][1].query():
            done += 1
        pairs, self._pending = self._pending[:done], self._pending[done:]
        if not pairs:
            return {}
        inside = sum(s.elapsed_time(e) for s, e in pairs)
        window_start = self._last_end or pairs[0][0]
        window = window_start.elapsed_time(pairs[-1][1])
        gaps = [a[1].elapsed_time(b[0]) for a, b in zip(pairs, pairs[1:], strict=False)]
        if self._last_end is not None:
            gaps.append(self._last_end.elapsed_time(pairs[0][0]))
        self._last_end = pairs[-1][1]
        out = {"gpu_ms": round(inside / len(pairs), 2), "gpu_steps": len(pairs)}
        if window > 0:
            out["gpu_busy"] = round(min(1.0, inside / window), 4)
        if gaps:
            out["gpu_gap_max_ms"] = round(max(gaps), 2)
        return out

    def _clocks(self) -> dict:
        if not self._nvml:
            return {}
        try:
            return {
                "sm_clock_mhz": torch.cuda.clock_rate(self.device),
                "gpu_temp_c": torch.cuda.temperature(self.device),
                "power_w": round(torch.cuda.power_draw(self.device) / 1e3),
            }
        except Exception as err:  # noqa: BLE001  pynvml absent or NVML unusable: said once, then skipped
            log.info("GPU clocks not reported (%s: %s)", type(err).__name__, err)
            self._nvml = False
            return {}

    def _alloc_retries(self) -> int:
        if not self.cuda:
            return 0
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def interval(self) -> dict:
        """The figures since the last call (module docstring), then a fresh interval."""
        n = max(1, self.steps)
        out = {
            "host_wait_ms": round(1e3 * self.wait_s / n, 2),
            "host_launch_ms": round(1e3 * self.launch_s / n, 2),
            "gc_ms": round(1e3 * self.gc_s, 2),
            "gc_max_ms": round(1e3 * self.gc_max_s, 2),
            "gc_count": self.gc_count,
            "gc_full": self.gc_full,
        }
        if self.data_clock is not None:
            out.update(self.data_clock.interval(self.steps))
        if self.cuda:
            out.update(self._gpu_figures())
            retries = self._alloc_retries()
            out["alloc_retries"] = retries - self._retries0
            self._retries0 = retries
            out["mem_reserved_gb"] = round(torch.cuda.memory_reserved(self.device) / 2**30, 2)
            out.update(self._clocks())
        self._reset()
        return out

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self.frozen:
            gc.unfreeze()
            gc.enable()
            self.frozen = False


class StepProfiler:
    """torch.profiler over steps FIRST..FIRST+COUNT-1 (``LogConfig.profile_steps``); the kernel table
    (self device time per kernel, summed over the steps) is written to ``out`` after the last one."""

    def __init__(self, window: tuple[int, int], out: Path, device: torch.device) -> None:
        self.first, self.count = window
        self.out = out
        self.device = device
        self._prof = None

    def before_step(self, step: int) -> None:
        """``step``: the steps done so far (the next step is step + 1)."""
        if step + 1 == self.first and self._prof is None:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(activities=acts)
            self._prof.__enter__()

    def after_step(self, step: int) -> None:
        if self._prof is None or step < self.first + self.count - 1:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        sort = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(
            f"steps {self.first}..{self.first + self.count - 1} ({self.count} steps)\n{table}\n"
        )
        log.info(
            "kernel table of steps %d-%d written to %s", self.first, self.first + self.count - 1, self.out
        )
        self.first = -1  # once
