"""One producer process, start to end: its slice of the dataset planned and tokenized (slice_plan.py), the
target loaded with its capture hooks and its trunk compiled and warmed (trunk.py), then the loop that turns
buckets into shards (loop.py says why it is shaped as it is: the GPU never waits for the disk).

Stop (SIGINT/SIGTERM -> `stop` event): the main loop stops after the current forward, each writer finishes
the shard it is writing (a complete shard may be published), queued work is dropped, this producer's
tmp/ leftovers are removed, and no DONE marker is written, so consumers keep waiting for a restart.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np
import torch
from transformers import AutoTokenizer

from dflash.common.contract.spool import Spool
from dflash.common.drafter.layers import default_target_layer_ids
from dflash.common.fault import fault_point
from dflash.common.target.capture import LayerCapture, find_decoder
from dflash.common.target.chat import check_tokenizer
from dflash.common.target.loading import TargetInfo, load_target
from dflash.producer.compile_plan import compile_spec
from dflash.producer.config import ProducerConfig, Worker
from dflash.producer.heartbeat import Heartbeat
from dflash.producer.loop import produce, write_held_out
from dflash.producer.slice_plan import SlicePlan, lengths_at, plan_slice, samples_at, tokenized_summary
from dflash.producer.trunk import warm_trunk
from dflash.producer.writers import Counters

log = logging.getLogger(__name__)


def _load_target(cfg: ProducerConfig, worker: Worker) -> tuple[LayerCapture, TargetInfo]:
    """The target's text model (loading.py: no vision tower, kernels reported) with the capture hooks."""
    fault_point(worker.fault_name, "load")
    model, info = load_target(
        cfg.model,
        dtype=worker.torch_dtype(cfg.dtype),
        device=worker.device,
        precision=cfg.target_precision,
        fp8_fallback=cfg.fp8_fallback,
    )
    fault_point(worker.fault_name, "loaded")  # its weights in memory, before the hooks and the compile
    num_layers = len(find_decoder(model)[1])
    if cfg.layer_ids is None:
        layer_ids = default_target_layer_ids(num_layers)
    else:
        layer_ids = list(cfg.layer_ids)
    capture = LayerCapture(model, layer_ids, free_unused=True)
    if worker.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the freed layers and lm_head
    return capture, info


def _set_up_torch(worker: Worker) -> None:
    """This process's torch: its CPU threads (CPU producers share the machine) and its one GPU."""
    if worker.num_threads:
        torch.set_num_threads(worker.num_threads)
    if worker.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(worker.device))


def _say_start(
    cfg: ProducerConfig, worker: Worker, plan: SlicePlan, capture: LayerCapture, info: TargetInfo
) -> None:
    """The worker's one line once its target is loaded: what it will produce, from what, on what."""
    log.info(
        "producer %s: %d samples over %d epoch(s) (rank %d/%d, %d skipped), layers %s of %d, %s on %s; target %s; "
        "forward %s, %d writer threads",
        worker.producer_id,
        len(plan.ids),
        cfg.epochs,
        worker.rank,
        worker.world,
        plan.counts["skipped"],
        capture.layer_ids,
        capture.num_layers,
        worker.torch_dtype(cfg.dtype),
        worker.device,
        info.line(),
        compile_spec(cfg.compile_options, worker.device).describe(),
        worker.writer_threads,
    )


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
    ``on_tokenized(summary)`` (slice_plan.tokenized_summary) is called once the slice is tokenized, before
    the target loads; returning False aborts (no DONE marker, result "aborted": True): dflash-produce uses
    it to stop a run whose dataset yields no trainable sample.
    """
    _set_up_torch(worker)
    spool = Spool(worker.spool)
    spool.clean_tmp(worker.producer_id)
    spool.clear_done(worker.producer_id)
    counters = Counters()
    heartbeat = Heartbeat(cfg, worker, spool, counters, on_heartbeat)
    heartbeat(force=True, phase="tokenize")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    check_tokenizer(tokenizer, cfg.model)
    plan = plan_slice(cfg, worker, tokenizer, spool.eval_sample_ids())
    # total - samples - dropped = what is left to produce (counted in samples: a row may give several)
    counters.add(**plan.counts, total=len(plan.ids) + plan.counts["dropped"])
    fault_point(worker.fault_name, "tokenized")  # its slice counted, not yet reported
    if on_tokenized is not None and not on_tokenized(tokenized_summary(plan, cfg.data)):
        heartbeat(force=True, phase="aborted", done=False)
        heartbeat.close()
        return {**counters.snapshot(), "done": False, "aborted": True}
    heartbeat(force=True, phase="load model")
    capture, info = _load_target(cfg, worker)
    _say_start(cfg, worker, plan, capture, info)
    heartbeat(force=True, phase="compile")
    lengths = lengths_at(plan.tok_ds, np.concatenate([plan.positions, plan.held_pos]))
    trunk = warm_trunk(cfg, worker, capture, info.kernels, lengths)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    try:
        if len(plan.held_ids):
            held = samples_at(plan.tok_ds, plan.held_pos, plan.held_ids)
            n = write_held_out(cfg, worker, trunk, held, spool, pad_id)
            log.info("producer %s: %d held-out samples spooled for evaluation (eval/)", worker.producer_id, n)
        samples = samples_at(plan.tok_ds, plan.positions, plan.ids)
        return produce(
            cfg,
            worker,
            trunk,
            samples,
            pad_id=pad_id,
            stop=stop,
            counters=counters,
            heartbeat=heartbeat,
            epochs=plan.epochs,
        )
    finally:
        trunk.close()
        heartbeat.close()
