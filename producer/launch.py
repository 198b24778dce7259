"""One ``dflash-produce`` launch, before any worker starts: every check a user error can fail (GPUs,
target, dataset, spool), the spool bound to the run, what earlier launches left reconciled, and one
``ProducerConfig`` per worker.

Why all of it up front, in the parent: a user error must be one clear line (exit 2) before any GPU is
touched or a worker spawned, and the spool must be locked to this launch before anything is written.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

from dflash.common.checkpoints.load import read_trained_set
from dflash.common.cli.exits import one_line
from dflash.common.contract.liveness import SpoolLock
from dflash.common.contract.sample_set import SampleSet
from dflash.common.contract.shard import CodecConfig, ShardFormatError
from dflash.common.contract.shard_reader import read_sample_index
from dflash.common.contract.spool import Spool, SpoolError, default_budget_bytes
from dflash.common.contract.spool_records import RunMismatchError, SpoolBusyError
from dflash.common.drafter.layers import check_layer_ids, default_target_layer_ids
from dflash.common.target.chat import check_tokenizer
from dflash.common.target.checks import check_target as check_target_files
from dflash.common.target.data import (
    DataError,
    conversation_column,
    dataset_fingerprint,
    load_raw_dataset,
)
from dflash.common.target.fp8 import fp8_matmul_unavailable
from dflash.common.target.head import target_fingerprint
from dflash.common.target.loading import refusal_line, runs_fp8
from dflash.producer.config import (
    LaunchConfig,
    ProduceConfig,
    ProducerConfig,
    UsageError,
    Worker,
    writer_threads_for,
)

log = logging.getLogger(__name__)


def parse_gpus(spec: str) -> list[tuple[str, int | None]]:
    """'0-3' | '0,2,5' | '1' | 'cpu' | 'cpu:2' -> [(device, cuda index)]."""
    spec = spec.strip()
    if spec == "cpu" or spec.startswith("cpu:"):
        n = spec.partition(":")[2] or "1"
        if not n.isdigit() or int(n) < 1:
            raise UsageError(f"--gpus {spec!r}: cpu:N needs N >= 1")
        return [("cpu", None)] * int(n)
    ids: list[int] = []
    for part in spec.split(","):
        a, sep, b = part.strip().partition("-")
        if not a.isdigit() or (sep and not b.isdigit()):
            raise UsageError(f"--gpus {spec!r}: expected e.g. 0-3, 0,1 or cpu:2")
        ids.extend(range(int(a), int(b) + 1) if sep else [int(a)])
    if not ids or len(set(ids)) != len(ids):
        raise UsageError(f"--gpus {spec!r}: empty or repeated GPU ids")
    return [("cuda", i) for i in ids]


def workers_of(launch: LaunchConfig, launch_no: int | None = None) -> list[Worker]:
    """One Worker per device; ids n<node>p<index>.<launch>: unique per launch of the run (the spool
    counts launches), so shard names and DONE markers of different launches never collide."""
    devices = parse_gpus(launch.gpus)
    per_node = len(devices)
    out = []
    for p, (dev, idx) in enumerate(devices):
        rank = launch.node_rank * per_node + p
        pid = f"n{launch.node_rank}p{p}" + (f".{launch_no}" if launch_no is not None else "")
        device = dev if dev == "cpu" else "cuda:0"  # a spawned worker sees only its own GPU
        out.append(
            Worker(
                producer_id=pid, rank=rank, world=per_node * launch.num_nodes, device=device, cuda_index=idx
            )
        )
    return out


def check_gpus(workers: list[Worker], spec: str) -> None:
    """Every CUDA index asked for exists (before anything loads). Raises UsageError."""
    wanted = [w.cuda_index for w in workers if w.cuda_index is not None]
    if not wanted:
        return

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [i for i in wanted if i >= n]
    if missing:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise UsageError(
            f"--gpus {spec}: no CUDA device {missing[0]}: this machine has {n} visible CUDA device(s){where}; "
            "use --gpus cpu:N for a CPU run"
        )


def check_fp8(producer: ProducerConfig, workers: list[Worker]) -> None:
    """An FP8 target (`runs_fp8`) with ``--fp8-fallback refuse`` on a device without FP8 matmuls: refused
    here, one line, before anything loads (the device's capability only: the parent makes no CUDA context;
    a worker's load probes the matmul itself and refuses the same way)."""
    if producer.fp8_fallback != "refuse":
        return
    config = AutoConfig.from_pretrained(producer.model)
    if not runs_fp8(producer.target_precision, config):
        return
    for w in workers:
        device = w.device if w.cuda_index is None else f"cuda:{w.cuda_index}"
        why = fp8_matmul_unavailable(device, probe=False)
        if why:
            raise UsageError(refusal_line(why))


def check_target(model: str, layer_ids: list[int] | None) -> list[int]:
    """Model config and tokenizer load; the template exists; layer ids fit. Returns the layer ids the
    workers will capture. Raises UsageError."""
    try:
        check_target_files(model, what="--model")
        config = AutoConfig.from_pretrained(model)
        tok = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot load target {model!r}: {str(err).strip().splitlines()[0]}") from None
    try:
        check_tokenizer(tok, model)
    except DataError as err:
        raise UsageError(str(err)) from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = text.num_hidden_layers
    if layer_ids is None:
        return default_target_layer_ids(num_layers)
    try:
        return check_layer_ids(layer_ids, num_layers)
    except ValueError as err:
        raise UsageError(str(err)) from None


def leftover_samples(spool: Spool) -> np.ndarray | None:
    """Sample indices of the shards still in ready/ and claimed/ (None when there are none)."""
    parts = []
    for path in spool.leftover_shards():
        try:
            parts.append(read_sample_index(path))
        except FileNotFoundError:
            continue  # acked or moved meanwhile
        except ShardFormatError:
            continue  # a consumer will quarantine it; its samples are re-produced by the next launch
    return np.concatenate(parts) if parts else None


def cores_per_gpu(workers: list[Worker]) -> int:
    """The cores one producer may use: this process's cores over the node's GPUs (producers and
    consumers alike get a share), or over the CPU workers of a CPU launch."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpus = torch.cuda.device_count() if any(w.cuda_index is not None for w in workers) else 0
    return max(1, cores // max(1, gpus, len(workers)))


@dataclass
class Launch:
    """A prepared launch: the spool (locked to it), its workers and the config they all run."""

    spool: Spool
    lock: SpoolLock
    workers: list[Worker]
    config: ProducerConfig
    num_rows: int


def _bind_spool(spool_dir: str, identity: dict, node_rank: int) -> tuple[Spool, SpoolLock, int]:
    """(spool, this node's launch lock, launch number): another run's spool, or a live launch, refused."""
    run = identity["run"]
    try:
        spool = Spool(spool_dir)
        spool.bind_run(identity, who="this producer")  # another run: refused, naming both
        # one dflash-produce per node and spool: a live one holds this lock (the kernel drops it at death)
        lock = spool.acquire_lock(f"producer-n{node_rank}", f"dflash-produce of run {run!r}")
        return spool, lock, spool.next_launch()
    except (RunMismatchError, SpoolBusyError) as err:  # they name the spool and both launches
        raise UsageError(
            f"{err}; this is run {run!r}" if isinstance(err, SpoolBusyError) else str(err)
        ) from None
    except (SpoolError, OSError) as err:
        raise UsageError(f"spool {spool_dir}: {err}") from None


def _skip_set(spool: Spool, checkpoint: str | None, run: str, node_rank: int) -> SampleSet | None:
    """The samples this launch must not produce: trained ones (checkpoint) and leftovers still in flow.

    No producer of this node is live (we hold its lock). Shards still in the flow are reused: their
    samples are skipped here. The spool is read BEFORE the checkpoint, so a leftover a consumer trains
    meanwhile is either still seen in the spool or already in the trained set read next, never neither
    (ops/run_all.sh discards leftovers instead, see docs/reliability.md)."""
    removed = spool.clean_tmp_of(f"n{node_rank}p")
    if removed:
        log.info("removed %d unpublished tmp/ leftovers of earlier launches", removed)
    leftover = leftover_samples(spool)
    skip = None
    if checkpoint:
        try:
            skip = read_trained_set(checkpoint, run)
        except Exception as err:  # noqa: BLE001 - store errors come in many types; the user needs one line
            raise UsageError(f"cannot read trained samples from {checkpoint} run {run}: {err}") from None
        if skip is not None:
            log.info(
                "skipping %d samples already trained (checkpoint %s, run %s)", len(skip), checkpoint, run
            )
    if leftover is not None and len(leftover):
        skip = skip if skip is not None else SampleSet(epoch=0)
        before = len(skip)
        skip.add(leftover)
        log.info(
            "reusing %d samples still in the spool from an earlier launch (%d not trained yet)",
            len(leftover),
            len(skip) - before,
        )
    return skip


def prepare(cfg: ProduceConfig) -> Launch:
    """Check everything, bind and lock the spool, and place each worker. Raises UsageError."""
    launch, producer, data = cfg.launch, cfg.producer, cfg.producer.data
    check_gpus(workers_of(launch), launch.gpus)  # before anything loads
    try:
        if producer.codec:
            CodecConfig.parse(producer.codec)
    except ValueError as err:
        raise UsageError(str(err)) from None
    layer_ids = check_target(producer.model, producer.layer_ids)
    check_fp8(producer, workers_of(launch))
    try:
        ds = load_raw_dataset(data)
        conversation_column(ds, data.format)
        fingerprint = dataset_fingerprint(data, ds)
    except DataError as err:
        raise UsageError(str(err)) from None
    num_rows = min(len(ds), data.limit) if data.limit else len(ds)
    if not 0 <= producer.eval_samples < num_rows:
        raise UsageError(
            f"--eval-samples {producer.eval_samples}: must be in [0, {num_rows}) for dataset {data.dataset} ({num_rows} rows)"
        )
    run = launch.run_name
    model = os.path.abspath(producer.model) if os.path.exists(producer.model) else producer.model
    identity = {
        "run": run,
        "model": model,
        "target_fingerprint": _fingerprint(producer.model),
        "layer_ids": layer_ids,
        "dataset": fingerprint,
        "plan": _campaign_plan(producer, num_rows),
    }
    spool, lock, launch_no = _bind_spool(launch.spool_dir, identity, launch.node_rank)
    workers = _place_workers(cfg, spool, launch_no)
    spool.register_producers([w.producer_id for w in workers])
    log.info(
        "%d producer(s) %s over %d rows x %d epoch(s) (world %d), spool %s, budget %.1f GB",
        len(workers),
        [w.producer_id for w in workers],
        num_rows,
        producer.epochs,
        workers[0].world,
        spool.root,
        workers[0].budget_bytes / 1e9,
    )
    return Launch(spool=spool, lock=lock, workers=workers, config=producer, num_rows=num_rows)


def _fingerprint(model: str) -> str | None:
    """The target's weights fingerprint for the run record (consumers compare their ``--target`` with
    it before step 1); None when it cannot be read here (the record then holds the model's name only)."""
    try:
        return target_fingerprint(model)
    except Exception as err:  # noqa: BLE001 - a record without it is checked by name; say why once
        log.warning("target %s: no weights fingerprint for the run record (%s)", model, one_line(err))
        return None


def _campaign_plan(producer: ProducerConfig, num_rows: int) -> dict:
    """The campaign as the spool's run record keeps it: later launches and consumers must agree on it."""
    data = producer.data
    return {
        "epochs": producer.epochs,
        "shuffle_seed": producer.shuffle_seed,
        "eval_samples": producer.eval_samples,
        "rows": num_rows,
        "max_length": data.max_length,
        "min_loss_tokens": data.min_loss_tokens,
        "format": data.format,
        "train_reasoning": data.train_reasoning,
    }


def _place_workers(cfg: ProduceConfig, spool: Spool, launch_no: int) -> list[Worker]:
    """This launch's workers with their place in it: spool, world, budget, skip set, threads."""
    launch, producer = cfg.launch, cfg.producer
    placed = workers_of(launch, launch_no)
    budget = int(launch.budget_gb * 1e9) if launch.budget_gb else default_budget_bytes(spool.root)
    skip = _skip_set(spool, launch.checkpoint, launch.run_name, launch.node_rank)
    cpu_threads = max(1, (os.cpu_count() or 1) // len(placed))
    writers = (
        producer.writer_threads
        if producer.writer_threads is not None
        else writer_threads_for(cores_per_gpu(placed))
    )
    return [
        replace(
            w,
            spool=str(spool.root),
            budget_bytes=budget,
            skip=skip.to_bytes() if skip is not None else None,
            num_threads=cpu_threads if w.device == "cpu" else None,
            writer_threads=writers,
        )
        for w in placed
    ]
