"""The producer loop: samples -> length buckets -> target forward -> D2H copy -> writer threads -> spool.

Why this shape: the GPU must never wait for the disk. The main thread batches, runs the forward and starts
the device-to-host copy into one of a few reused pinned buffers; writer threads (writers.py) wait for the
copy, encode and publish the shard, so writing overlaps the next forward. With an FP8 codec the features
are quantized where they are (on the GPU, before the copy: hidden_fp8.py), so the copy, the pinned buffers
and the writers' encode handle half the bytes. The pinned-buffer pool bounds host
memory and is the backpressure between forward and writers; the spool budget (before each write) is the
backpressure between producers and consumers. With a campaign, the epoch barrier (epoch_barrier.py) keeps
every shard of epoch k published before any of k+1.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from dflash.common.contract import hidden_fp8
from dflash.common.contract.codecs import CodecConfig
from dflash.common.contract.epochs import Epochs
from dflash.common.contract.names import shard_name
from dflash.common.contract.shard_writer import write_shard
from dflash.common.contract.spool import Spool
from dflash.common.contract.spool_records import BUDGET_PHASE
from dflash.common.target.capture import LayerCapture
from dflash.producer.buckets import Batch, Bucketer, Sample
from dflash.producer.compile_plan import CompileSpec
from dflash.producer.config import ProducerConfig, Worker
from dflash.producer.epoch_barrier import EpochBarrier
from dflash.producer.heartbeat import Heartbeat
from dflash.producer.trunk import Trunk
from dflash.producer.writers import Counters, HostBuffer, ShardWriters, WriteJob, shard_of

log = logging.getLogger(__name__)


def shard_meta(cfg: ProducerConfig, worker: Worker, capture: LayerCapture | Trunk) -> dict:
    """The metadata every shard of this producer carries (target, layers, width, producer)."""
    return dict(
        target_model=cfg.target_name or cfg.model,
        layer_ids=capture.layer_ids,
        hidden_size=capture.hidden_size,
        producer_id=worker.producer_id,
    )


def write_held_out(
    cfg: ProducerConfig,
    worker: Worker,
    capture: LayerCapture | Trunk,
    samples: Iterable[Sample],
    spool,
    pad_id: int,
) -> int:
    """Forward the held-out samples and write them as eval shards into the spool's eval/ folder (no
    trainer claims them; consumers read them for the decode-order τ). Returns the samples written."""
    device = torch.device(worker.device)
    meta_kw = shard_meta(cfg, worker, capture)
    codec = CodecConfig.parse(cfg.codec) if cfg.codec else None  # the training shards' codec
    written = 0
    with torch.inference_mode():
        buckets = capture.bucket_config(cfg.buckets) if isinstance(capture, Trunk) else cfg.buckets
        for seq, batch in enumerate(_all_batches(samples, Bucketer(buckets))):
            shard = shard_of(batch, forward_batch(capture, batch, device, pad_id).cpu(), meta_kw)
            spool.publish_eval(
                shard_name(batch.bucket, worker.producer_id, seq), lambda p, s=shard: write_shard(p, s, codec)
            )
            written += len(batch.samples)
    return written


def forward_batch(
    capture: LayerCapture | Trunk, batch: Batch, device: torch.device, pad_id: int
) -> torch.Tensor:
    """Right-padded [rows, pad_len] forward; returns packed bf16 features [T, K*H] on `device`.

    Inputs are built on the host (pinned, async copy) and the valid mask stays on the host, so the
    main thread never waits for the GPU here and can queue forward N+1 while forward N runs.
    """
    rows = batch.num_rows  # more than the samples with fixed shapes (static compile): padding rows
    ids = torch.full((rows, batch.pad_len), pad_id, dtype=torch.int64)
    valid = torch.zeros((rows, batch.pad_len), dtype=torch.bool)
    for r, s in enumerate(batch.samples):
        ids[r, : len(s)] = torch.from_numpy(s.input_ids)
        valid[r, : len(s)] = True
    if device.type == "cuda":
        ids = ids.pin_memory().to(device, non_blocking=True)
    return capture.run(ids, valid).to(torch.bfloat16)


def produce(
    cfg: ProducerConfig,
    worker: Worker,
    capture: LayerCapture | Trunk,
    samples: Iterable[Sample],
    *,
    pad_id: int = 0,
    stop: threading.Event | None = None,
    counters: Counters | None = None,
    heartbeat: Heartbeat | None = None,
    on_heartbeat: Callable[[dict], None] | None = None,
    epochs: Epochs | None = None,
) -> dict:
    """The producer loop over ready-made samples (run_producer's core; the benchmark calls it directly):
    buckets -> forward -> D2H -> writer thread -> spool; DONE marker if it ran to the end. ``capture``: a
    Trunk (compiled, warmed by the caller) or a LayerCapture (run eagerly).

    With ``epochs`` (a campaign: samples come epoch by epoch, ids ``epoch x rows + row``), each epoch's
    buckets are flushed at its end, so no batch or shard mixes epochs, and the producers' epoch barrier
    (epoch_barrier.py) keeps every shard of epoch k published before any of k+1."""
    trunk = capture if isinstance(capture, Trunk) else Trunk(capture, CompileSpec())
    stop = stop or threading.Event()
    counters = counters or Counters()
    spool = Spool(worker.spool)
    heartbeat = heartbeat or Heartbeat(cfg, worker, spool, counters, on_heartbeat)
    writer = ShardWriters(cfg, worker, shard_meta(cfg, worker, capture), counters, stop)
    pinned_bytes = _pin_buffers(writer, cfg, worker, capture.feature_size)
    bucketer = Bucketer(trunk.bucket_config(cfg.buckets))
    on_wait = lambda: heartbeat(phase="epoch barrier")  # noqa: E731
    barrier = EpochBarrier(spool, worker.producer_id, stop=stop, on_wait=on_wait)
    writer.start()
    finished, waiting = False, _WriterWait(writer, heartbeat, counters)
    t_start = time.monotonic()
    try:
        batches = _campaign_batches(samples, bucketer, epochs, writer, barrier, waiting)
        finished = _forward_all(
            trunk, batches, writer, heartbeat, torch.device(worker.device), pad_id, t_start
        )
    finally:
        waiting.through(writer.close)  # the last shards may wait on the budget
        if writer.error is not None or not finished:
            finished = False
            spool.clean_tmp(worker.producer_id)
    if writer.error is not None:
        raise writer.error
    if finished:
        spool.mark_done(worker.producer_id)
    produce_s = time.monotonic() - t_start
    phase = "done" if finished else "stopped"
    heartbeat(force=True, phase=phase, done=finished, produce_s=produce_s, **trunk.report())
    run = {
        "padding_waste": bucketer.padding_waste,
        "produce_s": produce_s,
        "epoch_barrier_s": barrier.waited_s,
    }
    result = {**counters.snapshot(), "done": finished, **run, "codec": writer.codec.spec}
    result.update(pinned_bytes=pinned_bytes, **trunk.report())
    log.info("producer %s %s: %s", worker.producer_id, phase, result)
    return result


def _pin_buffers(writer: ShardWriters, cfg: ProducerConfig, worker: Worker, feature_size: int) -> int:
    """On CUDA, the pinned host buffers the D2H copies land in: one per writer, one being filled, one
    queued (their number bounds host memory and makes the forward wait for slow writers). With an FP8
    codec they hold e4m3 values and bf16 scales: about half the bytes. Returns their bytes."""
    if not worker.device.startswith("cuda"):
        return 0
    max_tokens = max(cfg.buckets.batch_tokens, cfg.data.max_length)
    total = 0
    for _ in range(worker.writer_threads + 2):
        buf = HostBuffer.allocate(max_tokens, feature_size, writer.num_layers, fp8=writer.codec.fp8)
        total += buf.nbytes
        writer.free.put(buf)
    return total


def _forward_all(
    trunk: Trunk,
    batches: Iterable[Batch],
    writer: ShardWriters,
    heartbeat: Heartbeat,
    device: torch.device,
    pad_id: int,
    t_start: float,
) -> bool:
    """Forward each batch and hand its features to the writers; True unless stopped."""
    stop, counters = writer.stop, writer.counters
    with torch.inference_mode():
        for batch in batches:
            if stop.is_set():
                break
            t_launch = time.monotonic()
            packed = forward_batch(trunk, batch, device, pad_id)
            num_tokens = packed.shape[0]
            t_wait = time.monotonic()
            if not _hand_off(batch, packed, writer, stop, heartbeat, device):
                break
            del packed
            # launch_s: host time to queue the forward (async on CUDA); main_wait_s: blocked on the writer.
            counters.add(
                fwd_samples=len(batch.samples),
                fwd_tokens=num_tokens,
                padded_tokens=batch.num_padded_tokens,
                launch_s=t_wait - t_launch,
                main_wait_s=time.monotonic() - t_wait,
            )
            heartbeat(phase="produce", produce_s=time.monotonic() - t_start, **trunk.report())
    return not stop.is_set()


def _hand_off(
    batch: Batch, packed: torch.Tensor, writer: ShardWriters, stop, heartbeat, device: torch.device
) -> bool:
    """Queue one forward's features for the writer threads; False when stopping (or the writer failed).

    With an FP8 codec the features are quantized first, where they are (queued GPU kernels, no host sync;
    on the CPU path, on the CPU). On CUDA they are copied into a free pinned buffer with an async D2H copy
    and an event the writer waits on, so the main thread never blocks on the GPU here and queues the next
    forward at once.
    """
    values, scales = hidden_fp8.quantize(packed, writer.num_layers) if writer.codec.fp8 else (packed, None)
    nbytes = sum(t.numel() * t.element_size() for t in (values, scales) if t is not None)
    if device.type == "cuda":
        buf = _blocking(writer, stop, heartbeat, lambda t: writer.free.get(timeout=t))
        if buf is None:
            return False
        host, host_scales = buf.fill(values, scales)
        event = torch.cuda.Event()
        event.record()
        job = WriteJob(
            batch=batch,
            hidden=host,
            hidden_scales=host_scales,
            event=event,
            buffer=buf,
            seq=writer.next_seq(),
        )
    else:
        job = WriteJob(
            batch=batch, hidden=values, hidden_scales=scales, event=None, buffer=None, seq=writer.next_seq()
        )
    writer.counters.add(host_bytes=nbytes)
    if not _blocking(writer, stop, heartbeat, lambda t: writer.jobs.put(job, timeout=t) or True):
        if job.buffer is not None:
            writer.free.put(job.buffer)
        return False
    return True


class _WriterWait:
    """The main loop waiting on its writers (a hand-off, an epoch's drain, the final close): called as it
    waits, it counts the time into ``main_wait_s`` (and ``budget_blocked_s``) as it passes and keeps
    the heartbeat going, its phase the budget wait while a writer waits on the spool budget. Why: the last
    shards of a slice (or an epoch) can wait on the budget for as long as the consumers take; uncounted
    and unsaid, a producer blocked most of a short run was rated at its throttled rate by dflash-plan and
    shown producing by dflash-status."""

    def __init__(
        self, writer: ShardWriters, heartbeat: Heartbeat, counters: Counters, *, main_wait: bool = True
    ) -> None:
        self.writer, self.heartbeat, self.counters = writer, heartbeat, counters
        self.main_wait = main_wait
        """Count the wait into ``main_wait_s`` too (a hand-off's caller counts its own)."""
        self.since: float | None = None
        self.blocked = False

    def start(self) -> None:
        self.since, self.blocked = time.monotonic(), self.writer.budget_blocked

    def end(self) -> None:
        self._count()
        self.since = None

    def through(self, wait: Callable[..., None]) -> None:
        """``wait(on_wait=self)`` (``writer.close``, ``writer.drain``), its time counted."""
        self.start()
        wait(on_wait=self)
        self.end()

    def __call__(self) -> None:
        """A look during the wait: the stretch since the last one counted, the heartbeat."""
        self._count()
        self.heartbeat(phase=BUDGET_PHASE if self.blocked else "waiting for writer")

    def _count(self) -> None:
        if self.since is None:
            return
        start = self.since
        self.since, self.blocked = _budget_stretch(self.writer, start, self.blocked)
        if self.main_wait:
            self.counters.add(main_wait_s=self.since - start)


def _campaign_batches(
    samples: Iterable[Sample],
    bucketer: Bucketer,
    epochs: Epochs | None,
    writer: ShardWriters,
    barrier: EpochBarrier,
    waiting: _WriterWait,
) -> Iterator[Batch]:
    """The batches of ``samples``; with ``epochs``, epoch by epoch: each epoch's buckets flushed at its end
    (batches tagged with it), its shards published (``writer.drain``), then the barrier (every epoch of
    the campaign reaches it, also one this producer has nothing left of). Stops early when the barrier
    says stop."""
    if epochs is None:
        yield from _all_batches(samples, bucketer)
        return
    it = iter(samples)
    pending = next(it, None)
    for epoch in range(epochs.epochs):

        def this_epoch(epoch: int) -> Iterator[Sample]:
            nonlocal pending
            while pending is not None and int(epochs.epoch_of(pending.sample_index)) == epoch:
                yield pending
                pending = next(it, None)

        for batch in _all_batches(this_epoch(epoch), bucketer):
            batch.epoch = epoch
            yield batch
        if epoch < epochs.epochs - 1:
            waiting.through(writer.drain)
            if not barrier.reached(epoch):
                return
    if pending is not None:
        raise ValueError(f"sample {pending.sample_index} is not of the campaign's {epochs.epochs} epoch(s)")


def _all_batches(samples: Iterable[Sample], bucketer: Bucketer) -> Iterator[Batch]:
    for s in samples:
        yield from bucketer.add(s)
    yield from bucketer.flush()


def _blocking(
    writer: ShardWriters, stop: threading.Event, heartbeat: Heartbeat, op: Callable[[float], object]
):
    """Retry a queue op with a timeout (get a free buffer / put a job) while the writer is behind,
    keeping the heartbeat alive; None when stopping or the writer failed. The wait counts as
    ``budget_blocked_s`` while a writer waits on the spool budget (``_WriterWait``; the caller counts
    ``main_wait_s``)."""
    waiting = _WriterWait(writer, heartbeat, writer.counters, main_wait=False)
    waiting.start()
    try:
        while True:
            try:
                return op(0.2)
            except (queue.Empty, queue.Full):
                if stop.is_set() or writer.error is not None or not writer.alive():
                    return None
                waiting()
    finally:
        waiting.end()


def _budget_stretch(writer: ShardWriters, since: float, was_blocked: bool) -> tuple[float, bool]:
    """Count the main loop's wait on its writers since ``since`` into ``budget_blocked_s`` when a writer
    waited on the spool budget at either end of it; (now, whether one waits now).

    Why a counter of its own: the main loop also waits on writers that are merely slower than the forward
    (that is the producer's own rate), and the writers' ``budget_wait_s`` sums every thread's wait and
    grows only when a shard is admitted; this is the wall time the producer made nothing because the
    consumers had not trained what it made, which dflash-plan leaves out of its rate."""
    now, blocked = time.monotonic(), writer.budget_blocked
    if blocked or was_blocked:
        writer.counters.add(budget_blocked_s=now - since)
    return now, blocked
