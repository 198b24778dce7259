"""One producer process: its dataset slice -> length buckets -> target forward -> shards in the spool.

Why this shape: the GPU must never wait for the disk. The main thread only tokenizes (up front, cached),
batches, runs the target forward and starts the device-to-host copy into one of a few reused pinned
buffers; writer threads (`writer_threads`, 2 by default: one encodes only ~1 GB/s) wait for the copy,
encode the shard (zstd runs in zarr's own pool, outside the GIL) and publish it, so writing overlaps the
next forward. Writers never run model code. The pinned-buffer pool bounds host memory and is also the
backpressure between forward and writers; the spool budget (`wait_for_budget`, before each write) is the
backpressure between producers and consumers.

Stop (SIGINT/SIGTERM -> `stop` event): the main loop stops after the current forward, each writer finishes
the shard it is writing (a complete shard may be published), queued work is dropped, this producer's
tmp/ leftovers are removed, and no DONE marker is written, so consumers keep waiting for a restart.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash.common.epochs import Epochs
from dflash.common.sample_set import SampleSet
from dflash.producer.buckets import Batch, BucketConfig, Bucketer, Sample
from dflash.producer.capture import LayerCapture, find_decoder
from dflash.producer.data import DataConfig, check_tokenizer, load_raw_dataset, slice_indices, tokenize_slice

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ProducerConfig:
    """Everything one producer process needs (the CLI builds one per GPU)."""

    producer_id: str
    """Unique in the spool; appears in shard names ([A-Za-z0-9_.], no '-')."""
    model: str
    """Target model path or hub id (from_pretrained)."""
    spool: str
    """Spool directory."""
    data: DataConfig
    buckets: BucketConfig = field(default_factory=BucketConfig)
    rank: int = 0
    """Global producer rank (node_rank * producers_per_node + local index)."""
    world: int = 1
    """Producers over all nodes; this one takes sample indices i with i % world == rank."""
    device: str = "cpu"
    """cpu | cuda | cuda:N."""
    dtype: str = "auto"
    """auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float32."""
    layer_ids: list[int] | None = None
    """Target layers to capture; None: dflash.common.layers.default_target_layer_ids(L)."""
    codec: str | None = None
    """Codec spec for the hidden array (None: the shard module's default)."""
    budget_bytes: int = 1 << 62
    """Spool budget: block before writing while the spool holds more bytes than this."""
    skip: bytes | None = None
    """SampleSet.to_bytes() of already trained sample ids (from the latest checkpoint)."""
    epochs: int = 1
    """Passes over the dataset (sample ids: dflash.common.epochs)."""
    shuffle_seed: int = 0
    """Each epoch walks the rows in an order drawn from (shuffle_seed, epoch)."""
    eval_samples: int = 0
    """Rows held out for evaluation (dflash.common.epochs): never trained, spooled once into eval/."""
    run_dir: str | None = None
    """If set, append heartbeat counters to <run_dir>/metrics/producer-<id>.jsonl."""
    target_name: str | None = None
    """Model id recorded in shard metadata (default: `model`)."""
    heartbeat_s: float = 5.0
    writer_threads: int = 2
    """Threads encoding and publishing shards (one encodes ~1 GB/s of bf16: see _Writers)."""
    chunk_bytes: int = 8 << 20
    """Bytes per `hidden` chunk in the shards written (larger chunks: less per-chunk overhead)."""
    num_threads: int | None = None
    """torch CPU threads (CPU producers share the machine)."""

    def __post_init__(self) -> None:
        if not self.producer_id or "-" in self.producer_id:
            raise ValueError(
                f"ProducerConfig.producer_id={self.producer_id!r}: must be non-empty without '-'"
            )
        if not 0 <= self.rank < self.world:
            raise ValueError(f"ProducerConfig.rank={self.rank}: must be in [0, world={self.world})")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"ProducerConfig.dtype={self.dtype!r}: must be auto, bfloat16 or float32")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"ProducerConfig.device={self.device!r}: must be cpu or cuda[:N]")
        if self.budget_bytes <= 0:
            raise ValueError(f"ProducerConfig.budget_bytes={self.budget_bytes}: must be > 0")
        if self.writer_threads < 1:
            raise ValueError(f"ProducerConfig.writer_threads={self.writer_threads}: must be >= 1")
        if self.chunk_bytes < 1:
            raise ValueError(f"ProducerConfig.chunk_bytes={self.chunk_bytes}: must be >= 1")
        if self.heartbeat_s <= 0:
            raise ValueError(f"ProducerConfig.heartbeat_s={self.heartbeat_s}: must be > 0")
        if self.epochs < 1:
            raise ValueError(f"ProducerConfig.epochs={self.epochs}: must be >= 1")

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)


@dataclass
class _Job:
    """One forward batch on its way to the writer thread."""

    batch: Batch
    hidden: torch.Tensor  # bf16 [T, K*H] on the host (a view of a pinned buffer on CUDA)
    event: torch.cuda.Event | None
    buffer: torch.Tensor | None  # the pinned buffer to give back after writing
    seq: int  # shard sequence number (assigned by the main thread)


class Counters:
    """Thread-safe counters reported in heartbeats and metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, float] = dict.fromkeys(
            ("total", "samples", "tokens", "shards", "bytes", "dropped", "bad", "short", "skipped",
             "fwd_samples", "fwd_tokens", "padded_tokens"), 0,
        )  # fmt: skip

    def add(self, **kv: float) -> None:
        with self._lock:
            for k, v in kv.items():
                self.values[k] = self.values.get(k, 0) + v

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.values)


def _samples(tok_ds, positions: np.ndarray, ids: np.ndarray) -> Iterator[Sample]:
    """The rows ``positions`` of the tokenized slice, in that order, as Samples with sample ids ``ids``."""
    for start in range(0, len(positions), 512):
        pos, sid = positions[start : start + 512], ids[start : start + 512]
        rows = tok_ds.select(pos).with_format("numpy")[:]
        for i in range(len(pos)):
            yield Sample(
                sample_index=int(sid[i]),
                input_ids=np.asarray(rows["input_ids"][i], dtype=np.int32),
                loss_mask=np.asarray(rows["loss_mask"][i], dtype=bool),
            )


def plan_epochs(
    tok_ds, mine: np.ndarray, epochs: Epochs, skip: SampleSet | None
) -> tuple[np.ndarray, np.ndarray, dict]:
    """What this producer still has to produce, in order: (positions into ``tok_ds``, sample ids, counts).

    Epoch by epoch, the slice's rows in the epoch's order, minus the rows tokenization dropped (counted
    once, not per epoch), the held-out rows (``held_out_plan``) and the ids already trained (``skip``, from
    the checkpoint).
    """
    status = np.asarray(tok_ds.with_format("arrow")["status"].to_numpy(zero_copy_only=False))
    ok = status == "ok"
    train = ok & ~np.isin(mine, epochs.held_out())
    positions, ids, skipped = [], [], 0
    for epoch in range(epochs.epochs):
        pos = epochs.slice_order(epoch, mine)
        pos = pos[train[pos]]
        sid = epochs.ids(epoch, mine[pos])
        if skip is not None and len(sid):
            trained = skip.contains_mask(sid).numpy()
            skipped += int(trained.sum())
            pos, sid = pos[~trained], sid[~trained]
        positions.append(pos)
        ids.append(sid)
    counts = {"dropped": int((~ok).sum()), "short": int((status == "short").sum()), "skipped": skipped}
    counts["bad"] = counts["dropped"] - counts["short"]
    return np.concatenate(positions), np.concatenate(ids), counts


def held_out_plan(tok_ds, mine: np.ndarray, epochs: Epochs) -> tuple[np.ndarray, np.ndarray]:
    """(positions into ``tok_ds``, sample ids) of this slice's kept held-out rows (ids = rows)."""
    status = np.asarray(tok_ds.with_format("arrow")["status"].to_numpy(zero_copy_only=False))
    pos = np.flatnonzero(np.isin(mine, epochs.held_out()) & (status == "ok"))
    return pos, mine[pos].astype(np.int64)


def shard_of(batch: Batch, hidden: torch.Tensor, meta_kw: dict):
    """The Shard of one forward batch: its samples back to back, their features ``hidden`` [T, K*H]."""
    from dflash.common.shard import Shard, ShardMeta

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
        meta=ShardMeta(bucket=batch.bucket, **meta_kw),
    )


def write_held_out(
    cfg: ProducerConfig, capture: LayerCapture, samples: Iterable[Sample], spool, pad_id: int
) -> int:
    """Forward the held-out samples and write them as eval shards into the spool's eval/ folder (no
    trainer claims them; consumers read them for the decode-order τ). Returns the samples written."""
    from dflash.common.shard import write_shard
    from dflash.common.spool import shard_name

    device = torch.device(cfg.device)
    meta_kw = dict(target_model=cfg.target_name or cfg.model, layer_ids=capture.layer_ids,
                   hidden_size=capture.hidden_size, producer_id=cfg.producer_id)  # fmt: skip
    written = 0
    with torch.inference_mode():
        for seq, batch in enumerate(_all_batches(samples, Bucketer(cfg.buckets))):
            shard = shard_of(batch, _forward_batch(capture, batch, device, pad_id).cpu(), meta_kw)
            spool.publish_eval(shard_name(batch.bucket, cfg.producer_id, seq), lambda p, s=shard: write_shard(p, s))
            written += len(batch.samples)
    return written


class _Writers:
    """`cfg.writer_threads` threads that encode and publish shards; they never run model code.

    Several threads because one zarr+zstd writer encodes ~1 GB/s of bf16 on an H200 host (measured,
    docs/producer.md), less than an 8B target produces (~33K tok/s x 40 KB); the codec work runs
    outside the GIL, so threads scale. Shards may be published out of order; names stay unique because
    the main thread assigns sequence numbers.
    """

    def __init__(self, cfg: ProducerConfig, meta_kw: dict, counters: Counters, stop: threading.Event):
        from dflash.common.shard import CodecConfig
        from dflash.common.spool import Spool

        self.cfg, self.meta_kw, self.counters, self.stop = cfg, meta_kw, counters, stop
        self.codec = CodecConfig.parse(cfg.codec) if cfg.codec else None
        self.jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=2)
        self.free: queue.Queue[torch.Tensor] = queue.Queue()
        self.error: BaseException | None = None
        self.seq = Spool(cfg.spool).next_seq(cfg.producer_id)
        self._admit_lock = threading.Lock()  # one budget admission at a time
        self._inflight_lock = threading.Lock()
        self._inflight = 0  # bytes reserved by shards admitted past the budget check and not yet published
        self.threads = [
            threading.Thread(target=self._run, name=f"shard-writer-{cfg.producer_id}-{i}", daemon=True)
            for i in range(cfg.writer_threads)
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq - 1

    def close(self) -> None:
        """Finish queued jobs (dropped when stopping) and join the threads."""
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join()

    def _run(self) -> None:
        from dflash.common.spool import Spool

        spool = Spool(self.cfg.spool)  # one per thread: Spool caches are not shared across threads
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

    def _admit(self, spool, reserved: int) -> bool:
        """Wait for room in the spool budget, then reserve ``reserved`` bytes; False when stopping.

        The check counts the shards this producer's other writer threads are still writing: each thread
        alone would pass a check made before the others' bytes land, and the spool would overshoot by one
        shard per thread. A shard is admitted past the budget only when none of its producer is in
        flight, so the spool stays under budget + one shard per producer.
        """
        with self._admit_lock:
            while True:
                # read what is in flight BEFORE scanning: no shard is admitted while we hold the lock, so a
                # shard counted here as in flight either is still in flight or, published since, is seen by
                # the scan. Read after the scan, a shard published between the two counts nowhere (a busy
                # box's CI once saw two shards past the budget that way).
                with self._inflight_lock:
                    pending = self._inflight
                if not spool.wait_for_budget(self.cfg.budget_bytes, should_stop=self.stop.is_set):
                    return False
                if pending == 0 or spool.total_bytes() + pending <= self.cfg.budget_bytes:
                    break
                if self.stop.wait(0.05):
                    return False
            with self._inflight_lock:
                self._inflight += reserved
            return True

    def _write(self, spool, job: _Job) -> None:
        from dflash.common.shard import write_shard
        from dflash.common.spool import shard_name

        if job.event is not None:
            t0 = time.monotonic()
            job.event.synchronize()  # the D2H copy (and so the forward) of this batch is done
            self.counters.add(d2h_wait_s=time.monotonic() - t0)
        samples = job.batch.samples
        shard = shard_of(job.batch, job.hidden, self.meta_kw)
        cu = shard.cu_seqlens.numpy()
        t0 = time.monotonic()
        reserved = _shard_bytes_bound(shard)
        if not self._admit(spool, reserved):
            return
        try:
            t1 = time.monotonic()
            tmp = spool.new_tmp_path(shard_name(job.batch.bucket, self.cfg.producer_id, job.seq))
            nbytes = write_shard(tmp, shard, self.codec, chunk_bytes=self.cfg.chunk_bytes)
            spool.publish(tmp, nbytes=nbytes)
        finally:
            with self._inflight_lock:
                self._inflight -= reserved
        self.counters.add(
            samples=len(samples), tokens=int(cu[-1]), shards=1, bytes=nbytes,
            budget_wait_s=t1 - t0, write_s=time.monotonic() - t1,
        )  # fmt: skip


def _shard_bytes_bound(shard) -> int:
    """An upper bound of a shard's bytes on disk: its raw arrays (compression may expand incompressible
    chunks by a fraction of a percent) plus the zarr metadata files."""
    raw = sum(
        t.numel() * t.element_size()
        for t in (shard.input_ids, shard.loss_mask, shard.cu_seqlens, shard.sample_index, shard.hidden)
    )
    return raw + raw // 64 + (64 << 10)


def _forward_batch(capture: LayerCapture, batch: Batch, device: torch.device, pad_id: int) -> torch.Tensor:
    """Right-padded [rows, pad_len] forward; returns packed bf16 features [T, K*H] on `device`.

    Inputs are built on the host (pinned, async copy) and the valid mask stays on the host, so the
    main thread never waits for the GPU here and can queue forward N+1 while forward N runs.
    """
    rows = len(batch.samples)
    ids = torch.full((rows, batch.pad_len), pad_id, dtype=torch.int64)
    valid = torch.zeros((rows, batch.pad_len), dtype=torch.bool)
    for r, s in enumerate(batch.samples):
        ids[r, : len(s)] = torch.from_numpy(s.input_ids)
        valid[r, : len(s)] = True
    if device.type == "cuda":
        ids = ids.pin_memory().to(device, non_blocking=True)
    return capture.run(ids, valid).to(torch.bfloat16)


class _Heartbeat:
    """Rate-limited heartbeat: spool state file, metrics JSONL, and a callback (the CLI's progress)."""

    def __init__(self, cfg: ProducerConfig, spool, counters: Counters, on_heartbeat: Callable | None):
        self.cfg, self.spool, self.counters, self.on_heartbeat = cfg, spool, counters, on_heartbeat
        self.device = torch.device(cfg.device)
        self.t0 = self.last_t = time.monotonic()
        self.last_tokens = 0.0
        self.metrics = None
        if cfg.run_dir:
            from dflash.common.metrics_log import MetricsLog

            self.metrics = MetricsLog(Path(cfg.run_dir) / "metrics" / f"producer-{cfg.producer_id}.jsonl")

    def __call__(self, *, force: bool = False, **extra) -> None:
        now = time.monotonic()
        if not force and now - self.last_t < self.cfg.heartbeat_s:
            return
        c = self.counters.snapshot()
        rec = {
            **c,
            "tok_s": (c["tokens"] - self.last_tokens) / max(now - self.last_t, 1e-9),
            "avg_tok_s": c["tokens"] / max(now - self.t0, 1e-9),
            "padding_waste": 1.0 - c["fwd_tokens"] / c["padded_tokens"] if c["padded_tokens"] else 0.0,
            "spool_bytes": self.spool.total_bytes(),
            "elapsed_s": now - self.t0,
            **extra,
        }
        if self.device.type == "cuda":
            rec["gpu_mem_gb"] = torch.cuda.memory_allocated(self.device) / 1e9
            rec["gpu_max_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        self.last_t, self.last_tokens = now, c["tokens"]
        self.spool.heartbeat("producer", self.cfg.producer_id, rec)
        if self.metrics is not None:
            self.metrics.write(rec)
        if self.on_heartbeat is not None:
            self.on_heartbeat({"id": self.cfg.producer_id, **rec})

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


def _load_target(cfg: ProducerConfig) -> LayerCapture:
    from transformers import AutoModelForCausalLM

    kw: dict = {"dtype": cfg.torch_dtype()}
    if cfg.device.startswith("cuda"):
        kw["device_map"] = {"": cfg.device}
    model = AutoModelForCausalLM.from_pretrained(cfg.model, **kw).eval()
    num_layers = len(find_decoder(model)[1])
    if cfg.layer_ids is None:
        from dflash.common.layers import default_target_layer_ids

        layer_ids = default_target_layer_ids(num_layers)
    else:
        layer_ids = list(cfg.layer_ids)
    capture = LayerCapture(model, layer_ids, free_unused=True)
    if cfg.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the freed layers and lm_head
    return capture


def run_producer(
    cfg: ProducerConfig,
    *,
    stop: threading.Event | None = None,
    on_heartbeat: Callable[[dict], None] | None = None,
    on_tokenized: Callable[[dict], bool] | None = None,
) -> dict:
    """Produce every sample of this producer's slice into the spool; returns the final counters.

    Raises DataError / ValueError for user errors; returns early (no DONE marker) when `stop` is set.
    ``on_tokenized(summary)`` (data.drop_summary of the slice, plus "skipped") is called once the slice is
    tokenized, before the target loads; returning False aborts (no DONE marker, result "aborted": True):
    dflash-produce uses it to stop a run whose dataset yields no trainable sample.
    """
    from transformers import AutoTokenizer

    from dflash.common.spool import Spool

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if cfg.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(cfg.device))
    spool = Spool(cfg.spool)
    spool.clean_tmp(cfg.producer_id)
    spool.clear_done(cfg.producer_id)
    counters = Counters()
    heartbeat = _Heartbeat(cfg, spool, counters, on_heartbeat)
    heartbeat(force=True, phase="tokenize")

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    check_tokenizer(tokenizer, cfg.model)
    ds = load_raw_dataset(cfg.data, quiet=True)
    num_rows = min(len(ds), cfg.data.limit) if cfg.data.limit else len(ds)
    mine = slice_indices(num_rows, rank=cfg.rank, world=cfg.world)
    tok_ds = tokenize_slice(ds, tokenizer, cfg.data, mine)  # the whole slice: cached across launches
    epochs = Epochs(rows=num_rows, epochs=cfg.epochs, seed=cfg.shuffle_seed, eval_samples=cfg.eval_samples)
    skip = SampleSet.from_bytes(cfg.skip) if cfg.skip else None
    positions, ids, counts = plan_epochs(tok_ds, mine, epochs, skip)
    held_pos, held_ids = held_out_plan(tok_ds, mine, epochs)
    if len(held_ids):  # spooled once per campaign: what an earlier launch wrote stays in eval/
        keep = ~np.isin(held_ids, spool.eval_sample_ids())
        held_pos, held_ids = held_pos[keep], held_ids[keep]
    # total - samples - dropped = what is left to produce
    counters.add(**counts, total=len(ids) + counts["dropped"])
    if on_tokenized is not None:
        from dflash.producer.data import campaign_counts, conversation_column, drop_summary

        summary = drop_summary(
            tok_ds, ds, conversation_column(ds, cfg.data.format), min_loss_tokens=cfg.data.min_loss_tokens
        )
        summary["skipped"] = counts["skipped"]
        summary["remaining"] = len(ids)
        summary["campaign"] = campaign_counts(tok_ds, exclude=np.flatnonzero(np.isin(mine, epochs.held_out())))
        if not on_tokenized(summary):
            heartbeat(force=True, phase="aborted", done=False)
            heartbeat.close()
            return {**counters.snapshot(), "done": False, "aborted": True}

    heartbeat(force=True, phase="load model")
    capture = _load_target(cfg)
    log.info(
        "producer %s: %d samples over %d epoch(s) (rank %d/%d, %d skipped), layers %s of %d, %s on %s",
        cfg.producer_id, len(ids), cfg.epochs, cfg.rank, cfg.world, counts["skipped"], capture.layer_ids,
        capture.num_layers, cfg.torch_dtype(), cfg.device,
    )  # fmt: skip
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    try:
        if len(held_ids):
            n = write_held_out(cfg, capture, _samples(tok_ds, held_pos, held_ids), spool, pad_id)
            log.info("producer %s: %d held-out samples spooled for evaluation (eval/)", cfg.producer_id, n)
        return produce(cfg, capture, _samples(tok_ds, positions, ids), pad_id=pad_id, stop=stop, counters=counters, heartbeat=heartbeat)  # fmt: skip
    finally:
        capture.close()
        heartbeat.close()


def produce(
    cfg: ProducerConfig,
    capture: LayerCapture,
    samples: Iterable[Sample],
    *,
    pad_id: int = 0,
    stop: threading.Event | None = None,
    counters: Counters | None = None,
    heartbeat: _Heartbeat | None = None,
    on_heartbeat: Callable[[dict], None] | None = None,
) -> dict:
    """The producer loop over ready-made samples (run_producer's core; the benchmark calls it directly):
    buckets -> forward -> D2H -> writer thread -> spool; DONE marker if it ran to the end."""
    from dflash.common.spool import Spool

    stop = stop or threading.Event()
    counters = counters or Counters()
    spool = Spool(cfg.spool)
    heartbeat = heartbeat or _Heartbeat(cfg, spool, counters, on_heartbeat)
    device = torch.device(cfg.device)
    meta_kw = dict(
        target_model=cfg.target_name or cfg.model,
        layer_ids=capture.layer_ids,
        hidden_size=capture.hidden_size,
        producer_id=cfg.producer_id,
    )
    writer = _Writers(cfg, meta_kw, counters, stop)
    if device.type == "cuda":
        max_tokens = max(cfg.buckets.batch_tokens, cfg.data.max_length)
        for _ in range(cfg.writer_threads + 2):  # one per writer, one being filled by D2H, one queued
            writer.free.put(
                torch.empty(max_tokens, capture.feature_size, dtype=torch.bfloat16, pin_memory=True)
            )
    bucketer = Bucketer(cfg.buckets)
    writer.start()
    finished = False
    try:
        with torch.inference_mode():
            for batch in _all_batches(samples, bucketer):
                if stop.is_set():
                    break
                t_launch = time.monotonic()
                packed = _forward_batch(capture, batch, device, pad_id)
                num_tokens = packed.shape[0]
                t_wait = time.monotonic()
                if device.type == "cuda":
                    buf = _blocking(writer, stop, heartbeat, lambda t: writer.free.get(timeout=t))
                    if buf is None:
                        break
                    host = buf[:num_tokens]
                    host.copy_(packed, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                    job = _Job(batch=batch, hidden=host, event=event, buffer=buf, seq=writer.next_seq())
                else:
                    job = _Job(batch=batch, hidden=packed, event=None, buffer=None, seq=writer.next_seq())
                del packed
                if not _blocking(
                    writer, stop, heartbeat, lambda t, job=job: writer.jobs.put(job, timeout=t) or True
                ):
                    if job.buffer is not None:
                        writer.free.put(job.buffer)
                    break
                # launch_s: host time to queue the forward (async on CUDA); main_wait_s: blocked on the writer.
                counters.add(
                    fwd_samples=len(batch.samples),
                    fwd_tokens=num_tokens,
                    padded_tokens=batch.num_padded_tokens,
                    launch_s=t_wait - t_launch,
                    main_wait_s=time.monotonic() - t_wait,
                )
                heartbeat(phase="produce")
            finished = not stop.is_set()
    finally:
        writer.close()
        if writer.error is not None or not finished:
            finished = False
            spool.clean_tmp(cfg.producer_id)
    if writer.error is not None:
        raise writer.error
    if finished:
        spool.mark_done(cfg.producer_id)
    heartbeat(force=True, phase="done" if finished else "stopped", done=finished)
    result = {**counters.snapshot(), "done": finished, "padding_waste": bucketer.padding_waste}
    log.info("producer %s %s: %s", cfg.producer_id, "done" if finished else "stopped", result)
    return result


def _all_batches(samples: Iterable[Sample], bucketer: Bucketer) -> Iterator[Batch]:
    for s in samples:
        yield from bucketer.add(s)
    yield from bucketer.flush()


def _blocking(writer: _Writers, stop: threading.Event, heartbeat: _Heartbeat, op: Callable[[float], object]):
    """Retry a queue op with a timeout (get a free buffer / put a job) while the writer is behind,
    keeping the heartbeat alive; None when stopping or the writer failed."""
    while True:
        try:
            return op(0.2)
        except (queue.Empty, queue.Full):
            if stop.is_set() or writer.error is not None or not writer.alive():
                return None
            heartbeat(phase="waiting for writer")
