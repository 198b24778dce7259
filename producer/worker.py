"""One producer process: its dataset slice -> length buckets -> target forward -> shards in the spool.

Why this shape: the GPU must never wait for the disk. The main thread only tokenizes (up front, cached),
batches, runs the target forward and starts the device-to-host copy into one of a few reused pinned
buffers; writer threads (`writer_threads`, sized from the cores per GPU: config.writer_threads_for) wait
for the copy, encode the shard (zstd runs in zarr's own pool, outside the GIL) and publish it, so writing
overlaps the next forward. Writers never run model code. The forward is the target cut after its last
captured layer, compiled on CUDA (producer/trunk.py: warmed once per process, recompiles counted). The
pinned-buffer pool bounds host memory and is also the backpressure between forward and writers; the spool
budget (`wait_for_budget`, before each write) is the backpressure between producers and consumers.

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
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch
from transformers import AutoTokenizer

from dflash.common.contract.epochs import Epochs
from dflash.common.contract.names import shard_name
from dflash.common.contract.sample_set import SampleSet
from dflash.common.contract.shard_writer import write_shard
from dflash.common.contract.spool import Spool
from dflash.common.contract.spool_records import BUDGET_PHASE
from dflash.common.drafter.layers import default_target_layer_ids
from dflash.common.metrics import MetricsLog
from dflash.common.target.capture import LayerCapture, find_decoder
from dflash.common.target.chat import campaign_counts, check_tokenizer, drop_summary, tokenize_slice
from dflash.common.target.data import conversation_column, load_raw_dataset, slice_indices
from dflash.common.target.loading import TargetInfo, load_target
from dflash.producer.buckets import Batch, Bucketer, Sample
from dflash.producer.config import ProducerConfig, Worker
from dflash.producer.epoch_barrier import EpochBarrier
from dflash.producer.trunk import CompileSpec, Trunk, compile_spec, warm_trunk
from dflash.producer.writers import Counters, ShardWriters, WriteJob, shard_of

log = logging.getLogger(__name__)


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


def _rows_and_segments(tok_ds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dataset row, which sample of its row, status) of each position of the tokenized slice."""
    table = tok_ds.with_format("arrow")[:]
    rows = np.asarray(table["sample_index"].to_numpy(zero_copy_only=False), dtype=np.int64)
    segs = (
        np.asarray(table["segment"].to_numpy(zero_copy_only=False), dtype=np.int64)
        if "segment" in table.column_names
        else np.zeros(len(rows), dtype=np.int64)
    )
    return rows, segs, np.asarray(table["status"].to_numpy(zero_copy_only=False))


def plan_epochs(
    tok_ds, mine: np.ndarray, epochs: Epochs, skip: SampleSet | None
) -> tuple[np.ndarray, np.ndarray, dict]:
    """What this producer still has to produce, in order: (positions into ``tok_ds``, sample ids, counts).

    Epoch by epoch, the slice's rows in the epoch's order (a row's samples one after the other), minus the
    samples tokenization dropped (counted once, not per epoch), the held-out rows (``held_out_plan``) and
    the ids already trained (``skip``, from the checkpoint). ``mine``: this producer's rows (the positions'
    rows are read from ``tok_ds``, where a row may give several samples).
    """
    rows, segs, status = _rows_and_segments(tok_ds)
    ok = status == "ok"
    train = ok & ~np.isin(rows, epochs.held_out())
    positions, ids, skipped = [], [], 0
    for epoch in range(epochs.epochs):
        pos = epochs.slice_order(epoch, rows)
        pos = pos[train[pos]]
        sid = epochs.ids(epoch, rows[pos], segs[pos])
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
    """(positions into ``tok_ds``, sample ids) of this slice's kept held-out samples (epoch 0's ids)."""
    rows, segs, status = _rows_and_segments(tok_ds)
    pos = np.flatnonzero(np.isin(rows, epochs.held_out()) & (status == "ok"))
    return pos, epochs.ids(0, rows[pos], segs[pos])


def held_out_positions(tok_ds, epochs: Epochs) -> np.ndarray:
    """Positions into ``tok_ds`` of the held-out rows' samples (kept or not)."""
    rows, _, _ = _rows_and_segments(tok_ds)
    return np.flatnonzero(np.isin(rows, epochs.held_out()))


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
    meta_kw = dict(target_model=cfg.target_name or cfg.model, layer_ids=capture.layer_ids,
                   hidden_size=capture.hidden_size, producer_id=worker.producer_id)  # fmt: skip
    written = 0
    with torch.inference_mode():
        buckets = capture.bucket_config(cfg.buckets) if isinstance(capture, Trunk) else cfg.buckets
        for seq, batch in enumerate(_all_batches(samples, Bucketer(buckets))):
            shard = shard_of(batch, forward_batch(capture, batch, device, pad_id).cpu(), meta_kw)
            spool.publish_eval(
                shard_name(batch.bucket, worker.producer_id, seq), lambda p, s=shard: write_shard(p, s)
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


class _Heartbeat:
    """Rate-limited heartbeat: spool state file, metrics JSONL, and a callback (the CLI's progress)."""

    def __init__(
        self, cfg: ProducerConfig, worker: Worker, spool, counters: Counters, on_heartbeat: Callable | None
    ):
        self.cfg, self.worker, self.spool, self.counters, self.on_heartbeat = (
            cfg,
            worker,
            spool,
            counters,
            on_heartbeat,
        )
        self.device = torch.device(worker.device)
        self.t0 = self.last_t = time.monotonic()
        self.last_tokens = 0.0
        self.metrics = None
        if cfg.run_dir:
            self.metrics = MetricsLog(Path(cfg.run_dir) / "metrics" / f"producer-{worker.producer_id}.jsonl")

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
        self.spool.heartbeat("producer", self.worker.producer_id, rec)
        if self.metrics is not None:
            self.metrics.write(rec)
        if self.on_heartbeat is not None:
            self.on_heartbeat({"id": self.worker.producer_id, **rec})

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


def _load_target(cfg: ProducerConfig, worker: Worker) -> tuple[LayerCapture, TargetInfo]:
    """The target's text model (loading.py: no vision tower, kernels reported) with the capture hooks."""
    model, info = load_target(cfg.model, dtype=worker.torch_dtype(cfg.dtype), device=worker.device)
    num_layers = len(find_decoder(model)[1])
    if cfg.layer_ids is None:
        layer_ids = default_target_layer_ids(num_layers)
    else:
        layer_ids = list(cfg.layer_ids)
    capture = LayerCapture(model, layer_ids, free_unused=True)
    if worker.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the freed layers and lm_head
    return capture, info


def _lengths(tok_ds, positions: np.ndarray) -> np.ndarray:
    """Token counts of the tokenized rows ``positions``, each once (what the batch shapes are made of):
    from the arrow column's offsets, never its values (a million long chats are gigabytes of ids)."""
    lengths = pc.list_value_length(tok_ds.data.column("input_ids")).to_numpy(zero_copy_only=False)
    if getattr(tok_ds, "_indices", None) is not None:  # a selection over the underlying table
        lengths = lengths[tok_ds._indices.column(0).to_numpy()]
    return np.asarray(lengths, dtype=np.int64)[np.unique(positions)]


def run_producer(
    cfg: ProducerConfig,
    worker: Worker,
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

    if worker.num_threads:
        torch.set_num_threads(worker.num_threads)
    if worker.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(worker.device))
    spool = Spool(worker.spool)
    spool.clean_tmp(worker.producer_id)
    spool.clear_done(worker.producer_id)
    counters = Counters()
    heartbeat = _Heartbeat(cfg, worker, spool, counters, on_heartbeat)
    heartbeat(force=True, phase="tokenize")

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    check_tokenizer(tokenizer, cfg.model)
    ds = load_raw_dataset(cfg.data, quiet=True)
    num_rows = min(len(ds), cfg.data.limit) if cfg.data.limit else len(ds)
    mine = slice_indices(num_rows, rank=worker.rank, world=worker.world)
    tok_ds = tokenize_slice(ds, tokenizer, cfg.data, mine)  # the whole slice: cached across launches
    epochs = Epochs(rows=num_rows, epochs=cfg.epochs, seed=cfg.shuffle_seed, eval_samples=cfg.eval_samples)
    skip = SampleSet.from_bytes(worker.skip) if worker.skip else None
    positions, ids, counts = plan_epochs(tok_ds, mine, epochs, skip)
    held_pos, held_ids = held_out_plan(tok_ds, mine, epochs)
    if len(held_ids):  # spooled once per campaign: what an earlier launch wrote stays in eval/
        keep = ~np.isin(held_ids, spool.eval_sample_ids())
        held_pos, held_ids = held_pos[keep], held_ids[keep]
    # total - samples - dropped = what is left to produce (counted in samples: a row may give several)
    counters.add(**counts, total=len(ids) + counts["dropped"])
    if on_tokenized is not None:
        summary = drop_summary(
            tok_ds, ds, conversation_column(ds, cfg.data.format), min_loss_tokens=cfg.data.min_loss_tokens
        )
        summary["skipped"] = counts["skipped"]
        summary["remaining"] = len(ids)
        summary["campaign"] = campaign_counts(tok_ds, exclude=held_out_positions(tok_ds, epochs))
        if not on_tokenized(summary):
            heartbeat(force=True, phase="aborted", done=False)
            heartbeat.close()
            return {**counters.snapshot(), "done": False, "aborted": True}

    heartbeat(force=True, phase="load model")
    capture, info = _load_target(cfg, worker)
    log.info(
        "producer %s: %d samples over %d epoch(s) (rank %d/%d, %d skipped), layers %s of %d, %s on %s; target %s; "
        "forward %s, %d writer threads",
        worker.producer_id, len(ids), cfg.epochs, worker.rank, worker.world, counts["skipped"], capture.layer_ids,
        capture.num_layers, worker.torch_dtype(cfg.dtype), worker.device, info.line(), compile_spec(cfg.compile_options, worker.device).describe(),
        worker.writer_threads,
    )  # fmt: skip
    heartbeat(force=True, phase="compile")
    capture = warm_trunk(
        cfg, worker, capture, info.kernels, _lengths(tok_ds, np.concatenate([positions, held_pos]))
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    try:
        if len(held_ids):
            n = write_held_out(cfg, worker, capture, _samples(tok_ds, held_pos, held_ids), spool, pad_id)
            log.info("producer %s: %d held-out samples spooled for evaluation (eval/)", worker.producer_id, n)
        return produce(cfg, worker, capture, _samples(tok_ds, positions, ids), pad_id=pad_id, stop=stop, counters=counters, heartbeat=heartbeat, epochs=epochs)  # fmt: skip
    finally:
        capture.close()
        heartbeat.close()


def produce(
    cfg: ProducerConfig,
    worker: Worker,
    capture: LayerCapture | Trunk,
    samples: Iterable[Sample],
    *,
    pad_id: int = 0,
    stop: threading.Event | None = None,
    counters: Counters | None = None,
    heartbeat: _Heartbeat | None = None,
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
    heartbeat = heartbeat or _Heartbeat(cfg, worker, spool, counters, on_heartbeat)
    device = torch.device(worker.device)
    meta_kw = dict(
        target_model=cfg.target_name or cfg.model,
        layer_ids=capture.layer_ids,
        hidden_size=capture.hidden_size,
        producer_id=worker.producer_id,
    )
    writer = ShardWriters(cfg, worker, meta_kw, counters, stop)
    if device.type == "cuda":
        max_tokens = max(cfg.buckets.batch_tokens, cfg.data.max_length)
        for _ in range(worker.writer_threads + 2):  # one per writer, one being filled by D2H, one queued
            writer.free.put(
                torch.empty(max_tokens, capture.feature_size, dtype=torch.bfloat16, pin_memory=True)
            )
    bucketer = Bucketer(trunk.bucket_config(cfg.buckets))
    barrier = EpochBarrier(
        spool, worker.producer_id, stop=stop, on_wait=lambda: heartbeat(phase="epoch barrier")
    )
    writer.start()
    finished = False
    t_start = time.monotonic()
    try:
        with torch.inference_mode():
            for batch in _campaign_batches(samples, bucketer, epochs, writer, barrier):
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
            finished = not stop.is_set()
    finally:
        writer.close()
        if writer.error is not None or not finished:
            finished = False
            spool.clean_tmp(worker.producer_id)
    if writer.error is not None:
        raise writer.error
    if finished:
        spool.mark_done(worker.producer_id)
    produce_s = time.monotonic() - t_start
    heartbeat(
        force=True,
        phase="done" if finished else "stopped",
        done=finished,
        produce_s=produce_s,
        **trunk.report(),
    )
    result = {**counters.snapshot(), "done": finished, "padding_waste": bucketer.padding_waste,
              "produce_s": produce_s, "epoch_barrier_s": barrier.waited_s, **trunk.report()}  # fmt: skip
    log.info("producer %s %s: %s", worker.producer_id, "done" if finished else "stopped", result)
    return result


def _hand_off(
    batch: Batch, packed: torch.Tensor, writer: ShardWriters, stop, heartbeat, device: torch.device
) -> bool:
    """Queue one forward's features for the writer threads; False when stopping (or the writer failed).

    On CUDA the features are copied into a free pinned buffer with an async D2H copy and an event the
    writer waits on, so the main thread never blocks on the GPU here and queues the next forward at once.
    """
    if device.type == "cuda":
        buf = _blocking(writer, stop, heartbeat, lambda t: writer.free.get(timeout=t))
        if buf is None:
            return False
        host = buf[: packed.shape[0]]
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        job = WriteJob(batch=batch, hidden=host, event=event, buffer=buf, seq=writer.next_seq())
    else:
        job = WriteJob(batch=batch, hidden=packed, event=None, buffer=None, seq=writer.next_seq())
    if not _blocking(writer, stop, heartbeat, lambda t: writer.jobs.put(job, timeout=t) or True):
        if job.buffer is not None:
            writer.free.put(job.buffer)
        return False
    return True


def _campaign_batches(
    samples: Iterable[Sample],
    bucketer: Bucketer,
    epochs: Epochs | None,
    writer: ShardWriters,
    barrier: EpochBarrier,
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
            writer.drain()
            if not barrier.reached(epoch):
                return
    if pending is not None:
        raise ValueError(f"sample {pending.sample_index} is not of the campaign's {epochs.epochs} epoch(s)")


def _all_batches(samples: Iterable[Sample], bucketer: Bucketer) -> Iterator[Batch]:
    for s in samples:
        yield from bucketer.add(s)
    yield from bucketer.flush()


def _blocking(
    writer: ShardWriters, stop: threading.Event, heartbeat: _Heartbeat, op: Callable[[float], object]
):
    """Retry a queue op with a timeout (get a free buffer / put a job) while the writer is behind,
    keeping the heartbeat alive; None when stopping or the writer failed."""
    while True:
        try:
            return op(0.2)
        except (queue.Empty, queue.Full):
            if stop.is_set() or writer.error is not None or not writer.alive():
                return None
            heartbeat(phase=BUDGET_PHASE if writer.budget_blocked else "waiting for writer")
