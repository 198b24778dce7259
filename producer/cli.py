"""`dflash-produce`: start one producer process per GPU (or N CPU workers) and watch them.

    dflash-produce --gpus 0-3 --model Qwen/Qwen3-8B --dataset data.jsonl --spool /dev/shm/dflash/run1

The parent checks what it can up front (model config, tokenizer chat template, dataset columns, layer
ids) so that user errors are one clear line before any GPU is touched, registers the producer ids in the
spool (consumers then know how many DONE markers to wait for), spawns the workers and prints progress.
Exit status: 0 when every worker finished; non-zero naming the failed worker(s) and their error.
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
    p = argparse.ArgumentParser(prog=PROG, description="Run a frozen target over a chat dataset and spool K layers' hidden states.")  # fmt: skip
    p.add_argument("--gpus", default="0", help="GPUs, one producer each: 0-3 | 0,1 | cpu:N (default 0)")
    p.add_argument("--model", required=True, help="target model path or hub id")
    p.add_argument("--dataset", required=True, help="hub name, .json/.jsonl/.parquet/.arrow file or folder, or save_to_disk folder")  # fmt: skip
    p.add_argument("--split", default="train", help="dataset split (default train)")
    p.add_argument(
        "--format", default="auto", choices=["auto", "openai", "sharegpt"], help="conversation format"
    )
    p.add_argument("--spool", help="spool directory (default /dev/shm/dflash/<run>)")
    p.add_argument("--run", help="run name (checkpoint prefix; default spool folder name)")
    p.add_argument("--run-dir", help="write metrics/producer-<id>.jsonl here")
    p.add_argument(
        "--checkpoint", help="checkpoint store URL (s3://... or a path): skip samples already trained"
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
        "--writer-threads", type=int, default=2, help="shard writer threads per producer (default 2)"
    )
    p.add_argument("--budget-gb", type=float, help="spool budget in GB (default: half the free space)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (multi-node)")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes running producers")
    p.add_argument("--limit", type=int, help="use only the first N rows of the dataset")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="target dtype (auto: bf16 on GPU, fp32 on CPU)")  # fmt: skip
    p.add_argument("--num-proc", type=int, help="tokenization processes per producer")
    p.add_argument("--cache-dir", help="datasets cache directory")
    p.add_argument("--progress-s", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("--log-level", default="INFO", help="logging level")
    return p


def _fail(msg: str, code: int = 2) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def _check_target(model: str, layer_ids: list[int] | None, max_length: int) -> None:
    """Model config and tokenizer load; the template exists; layer ids fit. Raises UsageError."""
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


def _check_dataset(data_cfg) -> int:
    from dflash.producer.data import conversation_column, load_raw_dataset

    ds = load_raw_dataset(data_cfg)
    conversation_column(ds, data_cfg.format)
    return len(ds)


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


def _worker_entry(cfg, cuda_index: int | None, events, log_level: str, parent_pid: int) -> None:
    """Spawned process body: own the device, run, report the outcome through `events`."""
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

    try:
        result = run_producer(cfg, stop=stop, on_heartbeat=lambda hb: events.put(("hb", cfg.producer_id, hb)))
    except (DataError, ValueError, OSError) as err:
        events.put(("error", cfg.producer_id, f"{type(err).__name__}: {err}"))
        logging.getLogger(__name__).exception("producer %s failed", cfg.producer_id)
        sys.exit(2)
    except BaseException as err:
        events.put(("error", cfg.producer_id, f"{type(err).__name__}: {err}"))
        logging.getLogger(__name__).exception("producer %s failed", cfg.producer_id)
        sys.exit(1)
    events.put(("done" if result["done"] else "stopped", cfg.producer_id, result))


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


def _workers(args) -> list[Worker]:
    devices = parse_gpus(args.gpus)
    per_node = len(devices)
    out = []
    for p, (dev, idx) in enumerate(devices):
        rank = args.node_rank * per_node + p
        out.append(Worker(producer_id=f"n{args.node_rank}p{p}", rank=rank, device=dev if dev == "cpu" else "cuda:0", cuda_index=idx))  # fmt: skip
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
    sys.exit(code)


def _main(args) -> int:
    from dflash.common.spool import Spool, SpoolError, default_budget_bytes
    from dflash.producer.buckets import BucketConfig
    from dflash.producer.data import DataConfig, DataError
    from dflash.producer.worker import ProducerConfig

    if args.num_nodes < 1 or not 0 <= args.node_rank < args.num_nodes:
        raise UsageError(f"--node-rank {args.node_rank}: must be in [0, --num-nodes {args.num_nodes})")
    if args.spool is None and args.run is None:
        raise UsageError("give --spool DIR or --run NAME (spool then defaults to /dev/shm/dflash/<run>)")
    spool_dir = args.spool or f"/dev/shm/dflash/{args.run}"
    run = args.run or os.path.basename(os.path.normpath(spool_dir))
    layer_ids = parse_layer_ids(args.layer_ids)
    workers = _workers(args)
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
    _check_target(args.model, layer_ids, args.max_length)
    try:
        num_rows = _check_dataset(data_cfg)
    except DataError as err:
        raise UsageError(str(err)) from None
    try:
        spool = Spool(spool_dir)
    except (SpoolError, OSError) as err:
        raise UsageError(f"spool {spool_dir}: {err}") from None
    budget = int(args.budget_gb * 1e9) if args.budget_gb else default_budget_bytes(spool.root)
    skip = None
    if args.checkpoint:
        from dflash.consumer.checkpoint import read_trained_set

        try:
            trained = read_trained_set(args.checkpoint, run)
        except Exception as err:  # noqa: BLE001 - store errors come in many types; the user needs one line
            raise UsageError(f"cannot read trained samples from {args.checkpoint} run {run}: {err}") from None
        if trained is not None:
            skip = trained.to_bytes()
            log.info(
                "skipping %d samples already trained (checkpoint %s, run %s)",
                len(trained),
                args.checkpoint,
                run,
            )
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
        "%d producer(s) %s over %d rows (world %d), spool %s, budget %.1f GB",
        len(workers), [w.producer_id for w in workers], num_rows, world, spool.root, budget / 1e9,
    )  # fmt: skip
    return _supervise(cfgs, workers, spool, args)


def _supervise(cfgs, workers: list[Worker], spool, args) -> int:
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    procs = {}
    for cfg, w in zip(cfgs, workers, strict=True):
        proc = ctx.Process(
            target=_worker_entry,
            args=(cfg, w.cuda_index, events, args.log_level, os.getpid()),
            name=w.producer_id,
        )
        proc.start()
        procs[w.producer_id] = proc
    progress = Progress(spool, list(procs), args.progress_s)
    outcome: dict[str, tuple[str, object]] = {}
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True
        for p in procs.values():
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(p.is_alive() for p in procs.values()) or not events.empty():
            try:
                kind, pid, payload = events.get(timeout=0.5)
            except queue.Empty:
                kind = None
            if kind == "hb":
                progress.update(pid, payload)
            elif kind is not None:
                outcome[pid] = (kind, payload)
                if kind == "error":
                    print(f"{PROG}: worker {pid} failed: {payload}", file=sys.stderr, flush=True)
            progress.maybe_print()
        for p in procs.values():
            p.join()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        progress.close()
    progress.maybe_print(force=True)
    failed = []
    for pid, p in procs.items():
        kind, payload = outcome.get(pid, ("error", f"exited with code {p.exitcode} without a report"))
        if kind == "error" or p.exitcode != 0:
            failed.append(f"{pid}: {payload}")
    if failed:
        print(
            f"{PROG}: error: {len(failed)} worker(s) failed: " + "; ".join(failed),
            file=sys.stderr,
            flush=True,
        )
        return 1
    if stopping or any(kind != "done" for kind, _ in outcome.values()):
        print(
            f"{PROG}: stopped before the end (no DONE markers for stopped workers)",
            file=sys.stderr,
            flush=True,
        )
        return 130
    totals = {
        k: sum(int(r.get(k, 0)) for _, r in outcome.values())
        for k in ("samples", "tokens", "shards", "dropped", "bad", "skipped")
    }
    print(f"{PROG}: done: " + " ".join(f"{k}={v}" for k, v in totals.items()), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    main()
