"""Checkpoints that do not stall training: snapshot to host memory, write and upload in a background thread.

A 32B-class drafter's checkpoint is 15-30 GB (weights + Adam state); written in the training loop it stopped
the GPU for 37 s per save (measured, 8B: 12.6 GB). Here a save costs the loop only the device->host copy:

1. ``snapshot`` enqueues a copy of every state tensor into page-locked host buffers ON THE COMPUTE STREAM, so
   the copy sees exactly the state after the last optimizer step and the next step's kernels run after it
   (stream order, no host sync); the buffers are allocated once (``prepare``, in the background, right after
   the first step) and reused by every save;
2. a writer thread waits for the copy, then serialises and uploads through ``save_checkpoint``, which writes
   ``latest`` last: a crash during the upload leaves the previous ``latest`` complete and resumable;
3. at most one save is in flight: the next ``snapshot`` first waits for the previous write (logged as a stall
   when it has to wait), so the buffers are never overwritten while being written.

torch.distributed.checkpoint's ``async_save`` does the same staging, but writes its own sharded format; this
project's format (one safetensors file + sha256-verified meta, ``latest`` pointer, S3 or a folder) is what
export, resume and the producers' skip logic read, so the staging is done here and the format kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass
class SaveOutcome:
    step: int
    url: str | None = None
    error: str | None = None
    snapshot_gb: float = 0.0
    copy_s: float = 0.0  # device time of the device->host copy (the GPU's share of the stall)
    write_s: float = 0.0  # background time to serialise and upload
    waited_s: float = 0.0  # host time the training loop spent in the save (previous save's end, the copy)


@dataclass
class _Job:
    step: int
    state: dict[str, Any]
    write: Callable[[dict[str, Any]], str]
    copied: torch.cuda.Event | None
    copy_start: torch.cuda.Event | None
    outcome: SaveOutcome = field(default_factory=lambda: SaveOutcome(step=-1))


def _tensor_leaves(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in _tensor_leaves(v, f"{prefix}/{k}")]
    if isinstance(obj, list | tuple):
        return [leaf for i, v in enumerate(obj) for leaf in _tensor_leaves(v, f"{prefix}/{i}")]
    return []


def _replace_tensors(obj: Any, copy: Callable[[str, torch.Tensor], torch.Tensor], prefix: str = "") -> Any:
    if isinstance(obj, torch.Tensor):
        return copy(prefix, obj)
    if isinstance(obj, dict):
        return {k: _replace_tensors(v, copy, f"{prefix}/{k}") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_replace_tensors(v, copy, f"{prefix}/{i}") for i, v in enumerate(obj))
    return obj


class AsyncCheckpointer:
    """One background writer; ``snapshot_and_write`` returns as soon as the copy is enqueued."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._finished: list[SaveOutcome] = []

    # ------------------------------------------------------------------ buffers
    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate the host buffers for a state of this structure, in a background thread (page-locked
        allocation of tens of GB takes seconds; done once, long before the first save)."""

        def allocate() -> None:
            for name, t in _tensor_leaves(state):
                self._buffer(name, t)

        self._wait()
        self._thread = threading.Thread(target=allocate, name="checkpoint-prepare", daemon=True)
        self._thread.start()

    def _buffer(self, name: str, t: torch.Tensor) -> torch.Tensor:
        with self._lock:
            buf = self._buffers.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin)
                self._buffers[name] = buf
            return buf

    # ------------------------------------------------------------------ saving
    def snapshot_and_write(
        self, step: int, state: dict[str, Any], write: Callable[[dict[str, Any]], str]
    ) -> float:
        """Copy ``state`` (nested dicts/lists of tensors and plain values) to host buffers on the current
        stream, then ``write(host_state)`` in the background. Returns the seconds the caller waited for the
        previous save to finish (0 when it had finished)."""
        t0 = time.monotonic()
        self._wait()
        waited = time.monotonic() - t0
        copy_start = copied = None
        if self.device.type == "cuda":
            copy_start = torch.cuda.Event(enable_timing=True)
            copy_start.record()

        def copy(name: str, t: torch.Tensor) -> torch.Tensor:
            buf = self._buffer(name, t)
            buf.copy_(t.detach(), non_blocking=self._pin)
            return buf

        host_state = _replace_tensors(state, copy)
        if copy_start is not None:
            copied = torch.cuda.Event(enable_timing=True)
            copied.record()
        job = _Job(step=step, state=host_state, write=write, copied=copied, copy_start=copy_start)
        job.outcome = SaveOutcome(
            step=step,
            waited_s=time.monotonic() - t0,  # waiting for the previous save + enqueueing (CPU: copying)
            snapshot_gb=sum(t.numel() * t.element_size() for _, t in _tensor_leaves(host_state)) / 1e9,
        )
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"checkpoint-{step}", daemon=True)
        self._thread.start()
        return waited

    def _run(self, job: _Job) -> None:
        out = job.outcome
        try:
            if job.copied is not None:
                job.copied.synchronize()
                out.copy_s = job.copy_start.elapsed_time(job.copied) / 1e3
            t = time.monotonic()
            out.url = job.write(job.state)
            out.write_s = time.monotonic() - t
        except Exception as err:  # reported by the training loop as one line (see Checkpointer.save)
            out.error = str(err).splitlines()[0] if str(err) else type(err).__name__
        with self._lock:
            self._finished.append(out)

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> list[SaveOutcome]:
        """Block until the save in flight (if any) is done; return every outcome not yet collected."""
        self._wait()
        return self.collect()

    def collect(self) -> list[SaveOutcome]:
        """Outcomes of saves finished since the last call (never blocks)."""
        with self._lock:
            done, self._finished = self._finished, []
        return done
