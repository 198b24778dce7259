"""`dflash-produce`: start one producer process per GPU (or N CPU workers) and watch them.

    dflash-produce --gpus 0-3 --model Qwen/Qwen3-8B --dataset data.jsonl --spool /dev/shm/dflash/run1

The parent checks what it can up front (model config, tokenizer chat template, dataset columns, layer
ids) so that user errors are one clear line before any GPU is touched, registers the producer ids in the
spool (consumers then know how many DONE markers to wait for), spawns the workers and prints progress.
Exit status (the convention of every dflash CLI, README "Errors and exit codes"): 0 when every worker
finished; 2 for a user or input error (bad flag, missing GPU, a dataset with no trainable row, a spool of
another run or in use by a live launch), one line; 1 for a runtime failure, one line naming the failed
worker(s) (traceback only with --log-level DEBUG); 130 when stopped by SIGINT/SIGTERM (no DONE markers).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dflash.common.cli.help import DefaultsHelpFormatter
from dflash.producer.config import PROG, UsageError, Worker
from dflash.producer.preflight import _check_dataset, _check_gpus, _check_target, _leftover_samples
from dflash.producer.supervisor import _one_line, _supervise

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


def parse_layer_ids(spec: str | None) -> list[int] | None:
    if spec is None:
        return None
    try:
        ids = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--layer-ids {spec!r}: expected comma-separated ints, e.g. 1,9,17,25,33") from None
    if not ids or min(ids) < 0:
        raise UsageError(f"--layer-ids {spec!r}: expected non-negative ints")
    return ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Run a frozen target over a chat dataset and spool K layers' hidden states.", formatter_class=DefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--gpus", default="0", help="GPUs, one producer each: 0-3 | 0,1 | cpu:N")
    p.add_argument("--model", required=True, help="target model path or hub id")
    p.add_argument("--dataset", required=True, help="hub name, .json/.jsonl/.parquet/.arrow file or folder, or save_to_disk folder")  # fmt: skip
    p.add_argument("--split", default="train", help="dataset split")
    p.add_argument(
        "--format", default="auto", choices=["auto", "openai", "sharegpt"], help="conversation format"
    )
    p.add_argument("--spool", help="spool directory (default /dev/shm/dflash/<run>)")
    p.add_argument("--run", help="run name (checkpoint prefix; default spool folder name)")
    p.add_argument("--run-dir", help="write metrics/producer-<id>.jsonl here (default: no metrics files)")
    p.add_argument(
        "--checkpoint", help="checkpoint store URL (s3://... or a path): skip samples already trained (default: skip none)"
    )
    p.add_argument("--max-length", type=int, default=4096, help="truncate samples to this many tokens")
    p.add_argument("--batch-tokens", type=int, default=32768, help="padded tokens per target forward")
    p.add_argument("--block-size", type=int, default=16, help="drafter block size: samples need 2x supervised tokens")  # fmt: skip
    p.add_argument(
        "--layer-ids", help="target layers to capture, e.g. 1,9,17,25,33 (default: K=5 from 1 to L-3)"
    )
    p.add_argument(
        "--codec", help="hidden-state codec: none | zstd:<level>[:shuffle] (default: shard default)"
    )
    p.add_argument(
        "--writer-threads", type=int, default=2, help="shard writer threads per producer"
    )
    p.add_argument("--budget-gb", type=float, help="spool budget in GB (default: half the free space)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (multi-node)")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes running producers")
    p.add_argument("--limit", type=int, help="use only the first N rows of the dataset (default: all rows)")
    p.add_argument(
        "--epochs", type=int, default=1,
        help="passes over the dataset; recorded in the spool's run record, so consumers and later launches agree",
    )  # fmt: skip
    p.add_argument(
        "--eval-samples", type=int, default=0,
        help="rows held out for evaluation (drawn by --shuffle-seed, never trained): their hidden states go "
        "to the spool's eval/ once, and consumers report the decode-order acceptance length on them",
    )  # fmt: skip
    p.add_argument(
        "--shuffle-seed", type=int, default=0,
        help="each epoch walks the dataset in an order drawn from (this seed, epoch)",
    )  # fmt: skip
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="target dtype (auto: bf16 on GPU, fp32 on CPU)")  # fmt: skip
    p.add_argument("--num-proc", type=int, help="tokenization processes per producer (default: one)")
    p.add_argument("--cache-dir", help="datasets cache directory (default: the datasets library's)")
    p.add_argument("--progress-s", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("--log-level", default="INFO", help="logging level")
    return p


def _fail(msg: str, code: int = 2) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def _workers(args, launch: int | None = None) -> list[Worker]:
    """One Worker per device; ids n<node>p<index>.<launch>: unique per launch of the run (the spool
    counts launches), so shard names and DONE markers of different launches never collide."""
    devices = parse_gpus(args.gpus)
    per_node = len(devices)
    out = []
    for p, (dev, idx) in enumerate(devices):
        rank = args.node_rank * per_node + p
        pid = f"n{args.node_rank}p{p}" + (f".{launch}" if launch is not None else "")
        out.append(Worker(producer_id=pid, rank=rank, device=dev if dev == "cpu" else "cuda:0", cuda_index=idx))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = _main(args)
    except UsageError as err:
        _fail(str(err))
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except Exception as err:  # noqa: BLE001 - a runtime failure: one line, the traceback with DEBUG only
        log.debug("traceback", exc_info=True)
        _fail(f"{type(err).__name__}: {_one_line(err)}", 1)
    sys.exit(code)


def _main(args) -> int:
    from dflash.common.contract.spool import (
        RunMismatchError,
        Spool,
        SpoolBusyError,
        SpoolError,
        default_budget_bytes,
    )
    from dflash.common.target.data import DataConfig, DataError, dataset_fingerprint
    from dflash.producer.buckets import BucketConfig
    from dflash.producer.config import ProducerConfig

    if args.num_nodes < 1 or not 0 <= args.node_rank < args.num_nodes:
        raise UsageError(f"--node-rank {args.node_rank}: must be in [0, --num-nodes {args.num_nodes})")
    if args.epochs < 1:
        raise UsageError(f"--epochs {args.epochs}: must be >= 1")
    if args.spool is None and args.run is None:
        raise UsageError("give --spool DIR or --run NAME (spool then defaults to /dev/shm/dflash/<run>)")
    spool_dir = args.spool or f"/dev/shm/dflash/{args.run}"
    run = args.run or os.path.basename(os.path.normpath(spool_dir))
    layer_ids = parse_layer_ids(args.layer_ids)
    _check_gpus(_workers(args), args.gpus)  # before anything loads
    try:
        data_cfg = DataConfig(
            dataset=args.dataset, split=args.split, format=args.format, max_length=args.max_length,
            min_loss_tokens=2 * args.block_size, limit=args.limit, num_proc=args.num_proc, cache_dir=args.cache_dir,
        )  # fmt: skip
        buckets = BucketConfig(batch_tokens=args.batch_tokens)
        if args.codec:
            from dflash.common.contract.shard import CodecConfig

            CodecConfig.parse(args.codec)
    except ValueError as err:
        raise UsageError(str(err)) from None
    resolved_layers = _check_target(args.model, layer_ids, args.max_length)
    try:
        ds = _check_dataset(data_cfg)
        fingerprint = dataset_fingerprint(data_cfg, ds)
    except DataError as err:
        raise UsageError(str(err)) from None
    num_rows = min(len(ds), args.limit) if args.limit else len(ds)
    try:
        spool = Spool(spool_dir)
        model = os.path.abspath(args.model) if os.path.exists(args.model) else args.model
        if not 0 <= args.eval_samples < num_rows:
            raise UsageError(f"--eval-samples {args.eval_samples}: must be in [0, {num_rows}) for dataset {args.dataset} ({num_rows} rows)")  # fmt: skip
        plan = {"epochs": args.epochs, "shuffle_seed": args.shuffle_seed, "eval_samples": args.eval_samples, "rows": num_rows,
                "max_length": args.max_length, "min_loss_tokens": data_cfg.min_loss_tokens,
                "format": args.format}  # fmt: skip
        identity = {
            "run": run,
            "model": model,
            "layer_ids": resolved_layers,
            "dataset": fingerprint,
            "plan": plan,
        }
        spool.bind_run(identity, who="this producer")  # another run: refused, naming both
        # one dflash-produce per node and spool: a live one holds this lock (the kernel drops it at death)
        lock = spool.acquire_lock(f"producer-n{args.node_rank}", f"dflash-produce of run {run!r}")
        launch = spool.next_launch()
    except (RunMismatchError, SpoolBusyError) as err:  # they name the spool and both launches
        raise UsageError(f"{err}; this is run {run!r}" if isinstance(err, SpoolBusyError) else str(err)) from None
    except (SpoolError, OSError) as err:
        raise UsageError(f"spool {spool_dir}: {err}") from None
    args._lock = lock  # held until this process exits
    workers = _workers(args, launch)
    budget = int(args.budget_gb * 1e9) if args.budget_gb else default_budget_bytes(spool.root)
    # Reconcile with what earlier launches left (no producer of this node is live: we hold its lock).
    # Shards still in the flow are reused: their samples are skipped here. The spool is read BEFORE the
    # checkpoint, so a leftover a consumer trains meanwhile is either still seen in the spool or already
    # in the trained set we read next, never neither (ops/run_all.sh discards leftovers instead, see
    # docs/reliability.md).
    removed = spool.clean_tmp_of(f"n{args.node_rank}p")
    leftover = _leftover_samples(spool)
    skip_set = None
    if args.checkpoint:
        from dflash.common.checkpoints.load import read_trained_set

        try:
            trained = read_trained_set(args.checkpoint, run)
        except Exception as err:  # noqa: BLE001 - store errors come in many types; the user needs one line
            raise UsageError(f"cannot read trained samples from {args.checkpoint} run {run}: {err}") from None
        if trained is not None:
            skip_set = trained
            log.info("skipping %d samples already trained (checkpoint %s, run %s)", len(trained), args.checkpoint, run)  # fmt: skip
    if leftover is not None and len(leftover):
        from dflash.common.contract.sample_set import SampleSet

        skip_set = skip_set if skip_set is not None else SampleSet(epoch=0)
        before = len(skip_set)
        skip_set.add(leftover)
        log.info("reusing %d samples still in the spool from an earlier launch (%d not trained yet)", len(leftover), len(skip_set) - before)  # fmt: skip
    if removed:
        log.info("removed %d unpublished tmp/ leftovers of earlier launches", removed)
    skip = skip_set.to_bytes() if skip_set is not None else None
    world = len(workers) * args.num_nodes
    cpu_threads = max(1, (os.cpu_count() or 1) // len(workers))
    try:
        cfgs = [
            ProducerConfig(
                producer_id=w.producer_id,
                model=args.model,
                spool=str(spool.root),
                data=data_cfg,
                buckets=buckets,
                rank=w.rank,
                world=world,
                device=w.device,
                dtype=args.dtype,
                layer_ids=layer_ids,
                codec=args.codec,
                budget_bytes=budget,
                skip=skip,
                epochs=args.epochs,
                shuffle_seed=args.shuffle_seed,
                eval_samples=args.eval_samples,
                run_dir=args.run_dir,
                writer_threads=args.writer_threads,
                num_threads=cpu_threads if w.device == "cpu" else None,
            )
            for w in workers
        ]
    except ValueError as err:
        raise UsageError(str(err)) from None
    spool.register_producers([w.producer_id for w in workers])
    log.info(
        "%d producer(s) %s over %d rows x %d epoch(s) (world %d), spool %s, budget %.1f GB",
        len(workers), [w.producer_id for w in workers], num_rows, args.epochs, world, spool.root, budget / 1e9,
    )  # fmt: skip
    return _supervise(cfgs, workers, spool, args)


if __name__ == "__main__":
    main()
