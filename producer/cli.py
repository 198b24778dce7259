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
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass

from dflash.common.cli_help import DefaultsHelpFormatter

log = logging.getLogger(__name__)

PROG = "dflash-produce"


class UsageError(ValueError):
    """A bad flag value (reported as one line)."""


@dataclass(kw_only=True)
class Worker:
    producer_id: str
    rank: int
    device: str
    cuda_index: int | None = None


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


def _check_target(model: str, layer_ids: list[int] | None, max_length: int) -> list[int]:
    """Model config and tokenizer load; the template exists; layer ids fit. Returns the layer ids the
    workers will capture. Raises UsageError."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash.producer.data import DataError, check_tokenizer

    try:
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
    if layer_ids is not None and max(layer_ids) >= num_layers:
        raise UsageError(
            f"--layer-ids {layer_ids}: the target has {num_layers} layers (ids 0..{num_layers - 1})"
        )
    if layer_ids is None:
        from dflash.common.layers import default_target_layer_ids

        layer_ids = default_target_layer_ids(num_layers)
    return list(layer_ids)


def _check_gpus(workers: list[Worker], spec: str) -> None:
    """Every CUDA index asked for exists (before anything loads). Raises UsageError."""
    wanted = [w.cuda_index for w in workers if w.cuda_index is not None]
    if not wanted:
        return
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [i for i in wanted if i >= n]
    if missing:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise UsageError(
            f"--gpus {spec}: no CUDA device {missing[0]}: this machine has {n} visible CUDA device(s){where}; "
            "use --gpus cpu:N for a CPU run"
        )


def _check_dataset(data_cfg):
    from dflash.producer.data import conversation_column, load_raw_dataset

    ds = load_raw_dataset(data_cfg)
    conversation_column(ds, data_cfg.format)
    return ds


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this worker when the dflash-produce parent dies, however it dies (Linux).

    Why: a worker that outlives a parent killed with SIGKILL keeps publishing shards and finally writes its
    DONE marker, possibly into the fresh spool of the pipeline's next life (run_all.sh --restarts wipes and
    recreates it): consumers there would see "producers done" early and stop with samples never trained.
    SIGKILL, not SIGTERM: an orphan must not publish even the shard it is writing.
    """
    if sys.platform != "linux":
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _worker_entry(cfg, cuda_index: int | None, events, log_level: str, parent_pid: int, go, abort) -> None:
    """Spawned process body: own the device, run, report the outcome through `events`. After
    tokenizing its slice it reports ("tokenized", summary) and waits for the parent's `go` (or `abort`:
    the dataset yields no trainable sample) before loading the target."""
    _die_with_parent(parent_pid)
    if cuda_index is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = visible.split(",")[cuda_index] if visible else str(cuda_index)
        os.environ["CUDA_VISIBLE_DEVICES"] = physical
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s {cfg.producer_id} %(levelname)s %(name)s: %(message)s"
    )
    stop = threading.Event()
    first = []

    def on_signal(signum, frame):
        # Ctrl-C reaches a worker twice (SIGINT from the terminal, SIGTERM forwarded by the parent):
        # only a signal well after the first one aborts without the clean stop.
        if first and time.monotonic() - first[0] > 2.0:
            raise KeyboardInterrupt
        first.append(time.monotonic())
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    import torch._dynamo  # noqa: F401  - import in the main thread first (concurrent first imports crash)

    from dflash.producer.data import DataError
    from dflash.producer.worker import run_producer

    def tokenized(summary: dict) -> bool:
        events.put(("tokenized", cfg.producer_id, summary))
        while not go.wait(0.2):
            if abort.is_set() or stop.is_set():
                return False
        return not abort.is_set()

    wlog = logging.getLogger(__name__)
    debug = logging.getLogger().isEnabledFor(logging.DEBUG)
    try:
        result = run_producer(
            cfg,
            stop=stop,
            on_heartbeat=lambda hb: events.put(("hb", cfg.producer_id, hb)),
            on_tokenized=tokenized,
        )
    except KeyboardInterrupt:  # a second signal: stop now, without the clean stop
        events.put(("stopped", cfg.producer_id, {"done": False}))
        sys.exit(130)
    except (DataError, ValueError, OSError) as err:
        events.put(("error", cfg.producer_id, f"{type(err).__name__}: {_one_line(err)}", 2))
        wlog.error("producer %s failed: %s", cfg.producer_id, _one_line(err), exc_info=debug)
        sys.exit(2)
    except BaseException as err:
        events.put(("error", cfg.producer_id, f"{type(err).__name__}: {_one_line(err)}", 1))
        wlog.error("producer %s failed: %s", cfg.producer_id, _one_line(err), exc_info=debug)
        sys.exit(1)
    kind = "aborted" if result.get("aborted") else "done" if result["done"] else "stopped"
    events.put((kind, cfg.producer_id, result))


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


class Progress:
    """Aggregates worker heartbeats into one line (and a tqdm bar on a terminal)."""

    def __init__(self, spool, ids: list[str], every_s: float):
        self.spool, self.every_s = spool, every_s
        self.hb: dict[str, dict] = {i: {} for i in ids}
        self.t0 = self.last = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=0, unit="sample", desc="produce", dynamic_ncols=True)

    def update(self, pid: str, hb: dict) -> None:
        self.hb[pid] = hb
        if self.bar is not None:
            self.bar.total = int(sum(h.get("total", 0) for h in self.hb.values()))
            self.bar.n = int(sum(h.get("samples", 0) + h.get("dropped", 0) for h in self.hb.values()))
            self.bar.set_postfix_str(self._rates(), refresh=True)

    def _rates(self) -> str:
        from dflash.common.metrics_log import format_bytes, format_rate

        tok_s = sum(h.get("tok_s", 0.0) for h in self.hb.values())
        ready = sum(1 for _ in self.spool.ready_dir.iterdir()) if self.spool.ready_dir.is_dir() else 0
        return f"{format_rate(tok_s)} tok/s | spool {ready} shards / {format_bytes(self.spool.total_bytes())}"

    def maybe_print(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.bar is not None or (not force and now - self.last < self.every_s):
            return
        from dflash.common.metrics_log import format_duration

        self.last = now
        total = sum(h.get("total", 0) for h in self.hb.values())
        done = sum(h.get("samples", 0) + h.get("dropped", 0) for h in self.hb.values())
        rate = done / max(now - self.t0, 1e-9)
        eta = f" | ETA {format_duration((total - done) / rate)}" if rate > 0 and total else ""
        drop = sum(h.get("dropped", 0) for h in self.hb.values())
        skip = sum(h.get("skipped", 0) for h in self.hb.values())
        print(
            f"[{format_duration(now - self.t0)}] samples {done}/{total} | {self._rates()} | "
            f"dropped {drop} skipped {skip}{eta}",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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
    from dflash.common.spool import RunMismatchError, Spool, SpoolBusyError, SpoolError, default_budget_bytes
    from dflash.producer.buckets import BucketConfig
    from dflash.producer.data import DataConfig, DataError, dataset_fingerprint
    from dflash.producer.worker import ProducerConfig

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
            from dflash.common.shard import CodecConfig

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
        from dflash.consumer.checkpoint import read_trained_set

        try:
            trained = read_trained_set(args.checkpoint, run)
        except Exception as err:  # noqa: BLE001 - store errors come in many types; the user needs one line
            raise UsageError(f"cannot read trained samples from {args.checkpoint} run {run}: {err}") from None
        if trained is not None:
            skip_set = trained
            log.info("skipping %d samples already trained (checkpoint %s, run %s)", len(trained), args.checkpoint, run)  # fmt: skip
    if leftover is not None and len(leftover):
        from dflash.common.sample_set import SampleSet

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


def _leftover_samples(spool):
    """Sample indices of the shards still in ready/ and claimed/ (None when there are none)."""
    import numpy as np

    from dflash.common.shard import ShardFormatError, read_sample_index

    parts = []
    for path in spool.leftover_shards():
        try:
            parts.append(read_sample_index(path))
        except FileNotFoundError:
            continue  # acked or moved meanwhile
        except ShardFormatError:
            continue  # a consumer will quarantine it; its samples are re-produced by the next launch
    return np.concatenate(parts) if parts else None


def _merge_summaries(summaries: list[dict]) -> dict:
    out = {"rows": 0, "ok": 0, "dropped": 0, "skipped": 0, "reasons": {}, "first": {}}
    for sm in summaries:
        for k in ("rows", "ok", "dropped", "skipped"):
            out[k] += int(sm.get(k, 0))
        for r, n in sm.get("reasons", {}).items():
            out["reasons"][r] = out["reasons"].get(r, 0) + n
        for r, ex in sm.get("first", {}).items():
            row = lambda e: int(e.split()[1].rstrip(":")) if e.startswith("row ") else 1 << 62  # noqa: E731
            if r not in out["first"] or row(ex) < row(out["first"][r]):
                out["first"][r] = ex
    out["reasons"] = dict(sorted(out["reasons"].items(), key=lambda kv: -kv[1]))
    return out


def _supervise(cfgs, workers: list[Worker], spool, args) -> int:
    from dflash.producer.data import format_drops

    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    go, abort = ctx.Event(), ctx.Event()
    procs = {}
    for cfg, w in zip(cfgs, workers, strict=True):
        proc = ctx.Process(
            target=_worker_entry,
            args=(cfg, w.cuda_index, events, args.log_level, os.getpid(), go, abort),
            name=w.producer_id,
        )
        proc.start()
        procs[w.producer_id] = proc
    progress = Progress(spool, list(procs), args.progress_s)
    outcome: dict[str, tuple] = {}
    tokenized: dict[str, dict] = {}
    no_data: str | None = None
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True
        for p in procs.values():
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)

    def decide() -> None:
        """Every worker tokenized (or died): go on, or abort when the dataset yields nothing to train."""
        nonlocal no_data
        summary = _merge_summaries(list(tokenized.values()))
        print(f"{PROG}: {summary['ok']} trainable rows; {format_drops(summary)}", file=sys.stderr, flush=True)
        if summary["ok"] == 0 and args.num_nodes == 1 and len(tokenized) == len(procs):
            no_data = f"no trainable sample in dataset {args.dataset}: {format_drops(summary)}"
            abort.set()
        elif len(tokenized) == len(procs):  # what this node's slices give, for the consumers' plan
            campaign = {k: sum(int(t["campaign"][k]) for t in tokenized.values()) for k in ("samples", "tokens", "loss_tokens")}  # fmt: skip
            spool.write_campaign(
                args.node_rank,
                {**campaign, "epochs": args.epochs, "node_rank": args.node_rank, "num_nodes": args.num_nodes},
            )
        go.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(p.is_alive() for p in procs.values()) or not events.empty():
            try:
                kind, pid, payload, *rest = events.get(timeout=0.5)
            except queue.Empty:
                kind = None
            if kind == "hb":
                progress.update(pid, payload)
            elif kind == "tokenized":
                tokenized[pid] = payload
            elif kind is not None:
                outcome[pid] = (kind, payload, *rest)
                if kind == "error":
                    log.error("worker %s failed: %s (the other workers finish their slices)", pid, payload)
            if not go.is_set() and not stopping:  # a stop: the waiting workers see it and end
                pending = [
                    i for i, p in procs.items() if i not in tokenized and p.is_alive() and i not in outcome
                ]
                if not pending:
                    decide()
            progress.maybe_print()
        for p in procs.values():
            p.join()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        progress.close()
    if no_data is not None:
        print(f"{PROG}: error: {no_data}", file=sys.stderr, flush=True)
        return 2
    progress.maybe_print(force=True)
    failed, codes = [], []
    for pid, p in procs.items():
        kind, payload, *rest = outcome.get(pid, (None, None))
        if kind == "error":
            failed.append(f"{pid}: {payload}")
            codes.append(rest[0] if rest else 1)
        elif kind is None and not stopping:  # died without a word: kill -9, OOM killer, segfault
            failed.append(f"{pid}: exited with code {p.exitcode} without a report")
            codes.append(1)
        elif kind == "done" and p.exitcode != 0 and not stopping:
            failed.append(f"{pid}: exited with code {p.exitcode} after its last shard")
            codes.append(1)
    if failed:
        code = 2 if all(c == 2 for c in codes) else 1
        print(
            f"{PROG}: error: {len(failed)} worker(s) failed: " + "; ".join(failed),
            file=sys.stderr,
            flush=True,
        )
        return code
    if len(outcome) < len(procs) or any(o[0] != "done" for o in outcome.values()):  # a late signal is no stop
        print(
            f"{PROG}: stopped before the end (no DONE markers for stopped workers)",
            file=sys.stderr,
            flush=True,
        )
        return 130
    totals = {
        k: sum(int(o[1].get(k, 0)) for o in outcome.values())
        for k in ("samples", "tokens", "shards", "dropped", "bad", "short", "skipped")
    }
    print(f"{PROG}: done: " + " ".join(f"{k}={v}" for k, v in totals.items()), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    main()
