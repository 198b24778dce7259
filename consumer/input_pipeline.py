"""Step inputs built ahead of the GPU: pack, sample anchors, pin, copy to the device while the last step runs.

Measured on one H200 at 32B-class shapes: packing + anchor sampling + labels take ~45 ms per step
on one CPU thread and the hidden states are a 210 MB host->device copy; done serially before every step
they left the GPU idle a quarter of the time. Here one background thread does all of it for step n+1 (and
n+2) while the training loop launches step n:

- the feed packs the stream straight into page-locked memory (``pin_memory``), so the copy is a true DMA;
- the copy runs on a dedicated CUDA stream and records an event; ``get()`` makes the compute stream wait
  on that event (a device-side dependency: the host never blocks on it) and marks the tensors as used by
  the compute stream, so the caching allocator cannot hand their memory back to the copy stream early;
- ``depth`` bounds the staged steps (2: one being copied, one ready), so host and device memory stay flat.

The batches are exactly the serial path's: one thread calls ``next_packed`` and ``build`` in order with the
same generator, and nothing else draws from that generator.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash.common.drafter.batch import DraftBatch, PackedSamples
from dflash.consumer.data_clock import PIPELINE_STAGES, StageClock

log = logging.getLogger(__name__)

_END = object()


def put_until_stopped(q: queue.Queue, item: object, stop: threading.Event) -> None:
    """Put ``item`` on the bounded queue ``q``, waiting for room, unless ``stop`` is set first (a producer
    thread must never block forever on a queue its consumer stopped reading)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


@dataclass
class StepInput:
    """One step's batch, on the training device, and the host-side numbers the loop logs."""

    batch: DraftBatch
    tokens: int  # real (non-padding) context tokens in the stream
    weight: float  # sum of the label weights (the loss normaliser's local share)
    ready: torch.cuda.Event | None = None  # recorded on the copy stream after the host->device copy
    padding: bool = False  # a rank's stand-in step without data: nothing to commit


class InputPipeline:
    """A background thread turning packed streams into device batches, ``depth`` steps ahead."""

    def __init__(
        self,
        next_packed: Callable[[float], PackedSamples | None],
        build: Callable[[PackedSamples], DraftBatch],
        exhausted: Callable[[], bool],
        *,
        device: torch.device,
        hidden_dtype: torch.dtype,
        depth: int = 2,
        poll_s: float = 0.2,
        clock: StageClock | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"input pipeline depth must be >= 1, got {depth}")
        self._next_packed = next_packed
        self._build = build
        self._source_exhausted = exhausted
        self.device = device
        self.hidden_dtype = hidden_dtype
        self._poll_s = poll_s
        self.clock = clock or StageClock(PIPELINE_STAGES)
        """This thread's time by stage (pack, build, copy, handoff; ``next_packed`` adds its wait for
        decoded shards): the training loop charges its waits to them (consumer/data_clock.py)."""
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._ended = False
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._loop, name="input-pipeline", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ background thread
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                with self.clock.stage("pack"):
                    packed = self._next_packed(self._poll_s)
                if packed is None:
                    if self._source_exhausted():
                        break
                    continue
                with self.clock.stage("build"):
                    batch = self._build(packed)
                with self.clock.stage("copy"):
                    staged = self._stage(batch)
                with self.clock.stage("handoff"):
                    put_until_stopped(self._queue, staged, self._stop)
        except BaseException as err:  # surfaced to the training loop by get()
            self._error = err
        put_until_stopped(self._queue, _END, self._stop)

    def _stage(self, batch: DraftBatch) -> StepInput:
        tokens = int((batch.doc_ids >= 0).sum())
        weight = float(batch.label_weights.sum(dtype=torch.float64))
        if self._copy_stream is None:
            return StepInput(batch.to(self.device, hidden_dtype=self.hidden_dtype), tokens, weight)
        with torch.cuda.stream(self._copy_stream):
            moved = batch.to(self.device, non_blocking=True, hidden_dtype=self.hidden_dtype)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        return StepInput(moved, tokens, weight, ready)

    # ------------------------------------------------------------------ training loop side
    def get(self, timeout: float) -> StepInput | None:
        """The next step's inputs, usable on the current stream; None if none is ready within ``timeout``
        (check ``exhausted()``). Raises what the background thread raised."""
        if self._ended:
            return None
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _END:
            self._ended = True
            if self._error is not None:
                raise RuntimeError(f"input pipeline failed: {self._error}") from self._error
            return None
        if item.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(item.ready)
            for f in dataclasses.fields(item.batch):
                value = getattr(item.batch, f.name)
                if isinstance(value, torch.Tensor):
                    value.record_stream(stream)
        return item

    def exhausted(self) -> bool:
        """True once the source is drained and every staged step was handed out."""
        return self._ended

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
