"""The producer's shard writers: threads that wait for a batch's device-to-host copy, encode it as a shard
(zarr + zstd, outside the GIL) and publish it into the spool under its byte budget. They never run model
code, so the forward of the next batch overlaps the writing of this one. With an FP8 codec the features
arrive already quantized (on the device, before the copy: loop.py), as e4m3 values and their scales."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dflash.common.contract import hidden_fp8
from dflash.common.contract.codecs import default_codec
from dflash.common.contract.names import shard_name
from dflash.common.contract.shard import CodecConfig, Shard, ShardMeta
from dflash.common.contract.shard_writer import write_shard
from dflash.common.contract.spool import Spool
from dflash.common.fault import fault_point
from dflash.producer.buckets import Batch
from dflash.producer.config import ProducerConfig, Worker

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.2
"""How often a wait on the writers (``drain``, ``close``) calls back: the heartbeat keeps its phase true."""


@dataclass
class HostBuffer:
    """Pinned host memory one batch's device-to-host copy lands in: its features (bf16, or e4m3 values
    with the codec FP8: half the bytes) and, with FP8, their scales."""

    hidden: torch.Tensor  # [max_tokens, K*H]
    scales: torch.Tensor | None  # bf16 [max_tokens, K] with FP8

    @classmethod
    def allocate(
        cls, max_tokens: int, feature_size: int, num_layers: int, *, fp8: bool, pin_memory: bool = True
    ) -> HostBuffer:
        dtype = hidden_fp8.FP8_DTYPE if fp8 else torch.bfloat16
        hidden = torch.empty(max_tokens, feature_size, dtype=dtype, pin_memory=pin_memory)
        scales = (
            torch.empty(max_tokens, num_layers, dtype=hidden_fp8.SCALE_DTYPE, pin_memory=pin_memory)
            if fp8
            else None
        )
        return cls(hidden=hidden, scales=scales)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.hidden, self.scales) if t is not None)

    def fill(
        self, values: torch.Tensor, scales: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Start copying one batch's features (and scales) in (asynchronously from a device); the views
        of this buffer that hold them."""
        rows = values.shape[0]
        if values.dtype != self.hidden.dtype or (scales is None) != (self.scales is None):
            raise ValueError(f"a {values.dtype} batch does not fit a host buffer of {self.hidden.dtype}")
        host = self.hidden[:rows]
        host.copy_(values, non_blocking=True)
        if scales is None or self.scales is None:
            return host, None
        host_scales = self.scales[:rows]
        host_scales.copy_(scales, non_blocking=True)
        return host, host_scales


@dataclass
class WriteJob:
    """One forward batch on its way to the writer thread."""

    batch: Batch
    hidden: torch.Tensor  # bf16 or e4m3 [T, K*H] on the host (a view of a pinned buffer on CUDA)
    event: torch.cuda.Event | None
    buffer: HostBuffer | None  # the pinned buffer to give back after writing
    seq: int  # shard sequence number (assigned by the main thread)
    hidden_scales: torch.Tensor | None = None  # bf16 [T, K] with e4m3 `hidden`


class Counters:
    """Thread-safe counters reported in heartbeats and metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, float] = dict.fromkeys(
            (
                "total",
                "samples",
                "tokens",
                "shards",
                "bytes",
                "dropped",
                "bad",
                "short",
                "skipped",
                "fwd_samples",
                "fwd_tokens",
                "padded_tokens",
                "host_bytes",
            ),
            0,
        )

    def add(self, **kv: float) -> None:
        with self._lock:
            for k, v in kv.items():
                self.values[k] = self.values.get(k, 0) + v

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.values)


def shard_of(batch: Batch, hidden: torch.Tensor, meta_kw: dict, hidden_scales: torch.Tensor | None = None):
    """The Shard of one forward batch: its samples back to back, their features ``hidden`` [T, K*H] (bf16,
    or e4m3 with ``hidden_scales`` [T, K])."""
    samples = batch.samples
    lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    cu = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    return Shard(
        input_ids=torch.from_numpy(np.concatenate([s.input_ids for s in samples])),
        loss_mask=torch.from_numpy(np.concatenate([s.loss_mask for s in samples])),
        cu_seqlens=torch.from_numpy(cu),
        sample_index=torch.tensor([s.sample_index for s in samples], dtype=torch.int64),
        hidden=hidden,
        hidden_scales=hidden_scales,
        meta=ShardMeta(bucket=batch.bucket, epoch=batch.epoch or 0, **meta_kw),
    )


class ShardWriters:
    """`worker.writer_threads` threads that encode and publish shards; they never run model code.

    Several threads because one zarr+zstd writer encodes ~1 GB/s of bf16 on an H200 host (measured,
    docs/producer.md), less than an 8B target produces (~33K tok/s x 40 KB); the codec work runs
    outside the GIL, so threads scale. Shards may be published out of order; names stay unique because
    the main thread assigns sequence numbers.
    """

    def __init__(
        self, cfg: ProducerConfig, worker: Worker, meta_kw: dict, counters: Counters, stop: threading.Event
    ):
        self.cfg, self.worker, self.meta_kw, self.counters, self.stop = cfg, worker, meta_kw, counters, stop
        self.codec = CodecConfig.parse(cfg.codec) if cfg.codec else default_codec()
        self.jobs: queue.Queue[WriteJob | None] = queue.Queue(maxsize=2)
        self.free: queue.Queue[HostBuffer] = queue.Queue()
        self.error: BaseException | None = None
        self.seq = Spool(worker.spool).next_seq(worker.producer_id)
        self._admit_lock = threading.Lock()  # one budget admission at a time
        self._inflight_lock = threading.Lock()
        self._inflight = 0  # bytes reserved by shards admitted past the budget check and not yet published
        self._budget_waiting = threading.Event()
        """Set while the writer admitting a shard waits on the spool budget (one admits at a time)."""
        self.threads = [
            threading.Thread(target=self._run, name=f"shard-writer-{worker.producer_id}-{i}", daemon=True)
            for i in range(worker.writer_threads)
        ]

    @property
    def num_layers(self) -> int:
        """K, the captured layers: one FP8 scale per token and layer."""
        return len(self.meta_kw["layer_ids"])

    @property
    def budget_blocked(self) -> bool:
        """A writer waits to be admitted under the spool budget: the spool is over it, or the shards its
        other threads have in flight would take it over (the heartbeat's phase says so: a consumer then
        knows that no more data comes until it trains what it holds; the main loop counts its waits then
        as ``budget_blocked_s``). Under the budget a shard is admitted at once and this stays False."""
        return self._budget_waiting.is_set()

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq - 1

    def drain(self, on_wait: Callable[[], None] = lambda: None) -> None:
        """Wait until every job queued so far is published (or dropped: stopping, or a writer failed),
        calling ``on_wait`` every ``WAIT_POLL_S`` meanwhile (the producer's heartbeat and wait clock: the
        jobs may wait on the spool budget for as long as the consumers take)."""
        done = self.jobs.all_tasks_done  # the condition Queue.join waits on
        while self.alive():
            with done:
                if done.wait_for(lambda: not self.jobs.unfinished_tasks, timeout=WAIT_POLL_S):
                    return
            on_wait()

    def close(self, on_wait: Callable[[], None] = lambda: None) -> None:
        """Finish queued jobs (dropped when stopping) and join the threads, calling ``on_wait`` every
        ``WAIT_POLL_S`` meanwhile, as ``drain`` does."""
        for _ in self.threads:
            while True:
                try:
                    self.jobs.put(None, timeout=WAIT_POLL_S)
                    break
                except queue.Full:
                    on_wait()
        for t in self.threads:
            while t.is_alive():
                t.join(timeout=WAIT_POLL_S)
                on_wait()

    def _run(self) -> None:

        spool = Spool(self.worker.spool)  # one per thread: Spool caches are not shared across threads
        while (job := self.jobs.get()) is not None:
            t0 = time.monotonic()
            try:
                if self.error is None and not self.stop.is_set():
                    self._write(spool, job)
            except BaseException as err:  # noqa: BLE001 - reported to the main thread, which re-raises
                self.error = self.error or err
                self.stop.set()
            finally:
                if job.buffer is not None:
                    self.free.put(job.buffer)
                self.counters.add(writer_busy_s=time.monotonic() - t0)
                self.jobs.task_done()

    def _admit(self, spool, reserved: int) -> bool:
        """Wait for room in the spool budget, then reserve ``reserved`` bytes; False when stopping.

        The check counts the shards this producer's other writer threads are still writing: each thread
        alone would pass a check made before the others' bytes land, and the spool would overshoot by one
        shard per thread. A shard is admitted past the budget only when none of its producer is in
        flight, so the spool stays under budget + one shard per producer.
        """
        budget = self.worker.budget_bytes
        with self._admit_lock:
            try:
                while True:
                    # read what is in flight BEFORE scanning: no shard is admitted while we hold the lock,
                    # so a shard counted here as in flight either is still in flight or, published since,
                    # is seen by the scan. Read after the scan, a shard published between the two counts
                    # nowhere (a busy box's CI once saw two shards past the budget that way).
                    with self._inflight_lock:
                        pending = self._inflight
                    if not spool.wait_for_budget(
                        budget, should_stop=self.stop.is_set, waiting=self._budget_waiting
                    ):
                        return False
                    if pending == 0 or spool.total_bytes() + pending <= budget:
                        break
                    self._budget_waiting.set()  # the shards in flight would take the spool over it
                    if self.stop.wait(0.05):
                        return False
            finally:
                self._budget_waiting.clear()
            with self._inflight_lock:
                self._inflight += reserved
            return True

    def _write(self, spool, job: WriteJob) -> None:

        if job.event is not None:
            t0 = time.monotonic()
            job.event.synchronize()  # the D2H copy (and so the forward) of this batch is done
            self.counters.add(d2h_wait_s=time.monotonic() - t0)
        samples = job.batch.samples
        shard = shard_of(job.batch, job.hidden, self.meta_kw, job.hidden_scales)
        cu = shard.cu_seqlens.numpy()
        t0 = time.monotonic()
        reserved = _shard_bytes_bound(shard)
        if not self._admit(spool, reserved):
            return
        try:
            t1 = time.monotonic()
            tmp = spool.new_tmp_path(
                shard_name(job.batch.bucket, self.worker.producer_id, job.seq, job.batch.epoch)
            )
            nbytes = write_shard(tmp, shard, self.codec, chunk_bytes=self.cfg.chunk_bytes)
            if job.seq == 0:  # written to tmp/, not yet published
                fault_point(self.worker.fault_name, "first-shard")
            spool.publish(tmp, nbytes=nbytes)
        finally:
            with self._inflight_lock:
                self._inflight -= reserved
        self.counters.add(
            samples=len(samples),
            tokens=int(cu[-1]),
            shards=1,
            bytes=nbytes,
            budget_wait_s=t1 - t0,
            write_s=time.monotonic() - t1,
        )


def _shard_bytes_bound(shard) -> int:
    """An upper bound of a shard's bytes on disk: its raw arrays (compression may expand incompressible
    chunks by a fraction of a percent) plus the zarr metadata files."""
    raw = sum(
        t.numel() * t.element_size()
        for t in (
            shard.input_ids,
            shard.loss_mask,
            shard.cu_seqlens,
            shard.sample_index,
            shard.hidden,
            shard.hidden_scales,
        )
        if t is not None
    )
    return raw + raw // 64 + (64 << 10)
