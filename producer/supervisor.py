"""The ``dflash-produce`` parent: spawn one worker process per device, relay their heartbeats as progress,
decide after tokenization whether the dataset gives anything to train, and turn their outcomes into the
launch's exit status.

The protocol between parent and workers is a pipe per worker (no named semaphores: nothing to leak in
/dev/shm however the launch dies), events up: ("tokenized", id, summary) once a worker's
slice is tokenized (it then waits for "go" or "abort" down its pipe), ("hb", id, heartbeat) while it runs, then one of
("done" | "stopped" | "aborted", id, counters) or ("error", id, message, exit code). A worker that dies
without a word (kill -9, OOM killer) is noticed by its exit code.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, wait

from tqdm import tqdm

from dflash.common.child_process import anonymous_library_locks, die_with_parent
from dflash.common.cli.exits import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, error_line, one_line
from dflash.common.compile import import_dynamo_in_main_thread
from dflash.common.metrics import format_bytes, format_duration, format_rate
from dflash.common.target.drops import format_drops
from dflash.producer.config import PROG, LaunchConfig, ProducerConfig, Worker
from dflash.producer.launch import Launch

log = logging.getLogger(__name__)


class _Channel:
    """The worker's end of its pipe to the parent: events up, "go"/"abort" down. One lock: heartbeats and
    the outcome may come from different threads."""

    def __init__(self, conn) -> None:
        self.conn, self.lock = conn, threading.Lock()

    def send(self, *event) -> None:
        with self.lock:
            try:
                self.conn.send(event)
            except (BrokenPipeError, OSError):  # the parent is gone: nobody to tell
                pass

    def wait_for_go(self, stop: threading.Event) -> bool:
        """True on "go", False on "abort", a stop, or a parent that went away."""
        while not stop.is_set():
            try:
                if self.conn.poll(0.2):
                    return self.conn.recv() == "go"
            except (EOFError, OSError):
                return False
        return False


def _worker_entry(cfg: ProducerConfig, worker: Worker, conn, log_level: str, parent_pid: int) -> None:
    """Spawned process body: own the device, run, report the outcome through the pipe ``conn``. After
    tokenizing its slice it reports ("tokenized", summary) and waits for the parent's "go" (or "abort": the
    dataset yields no trainable sample) before loading the target."""
    die_with_parent(parent_pid)
    anonymous_library_locks()
    channel = _Channel(conn)
    if worker.cuda_index is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = visible.split(",")[worker.cuda_index] if visible else str(worker.cuda_index)
        os.environ["CUDA_VISIBLE_DEVICES"] = physical
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s {worker.producer_id} %(levelname)s %(name)s: %(message)s"
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
    import_dynamo_in_main_thread()

    from dflash.common.target.data import DataError
    from dflash.producer.worker import run_producer

    def tokenized(summary: dict) -> bool:
        channel.send("tokenized", worker.producer_id, summary)
        return channel.wait_for_go(stop)

    wlog = logging.getLogger(__name__)
    debug = logging.getLogger().isEnabledFor(logging.DEBUG)
    try:
        result = run_producer(
            cfg,
            worker,
            stop=stop,
            on_heartbeat=lambda hb: channel.send("hb", worker.producer_id, hb),
            on_tokenized=tokenized,
        )
    except KeyboardInterrupt:  # a second signal: stop now, without the clean stop
        channel.send("stopped", worker.producer_id, {"done": False})
        sys.exit(EXIT_INTERRUPTED)
    except (DataError, ValueError, OSError) as err:
        channel.send("error", worker.producer_id, error_line(err), EXIT_USAGE)
        wlog.error("producer %s failed: %s", worker.producer_id, one_line(err), exc_info=debug)
        sys.exit(EXIT_USAGE)
    except BaseException as err:
        channel.send("error", worker.producer_id, error_line(err), EXIT_FAILURE)
        wlog.error("producer %s failed: %s", worker.producer_id, one_line(err), exc_info=debug)
        sys.exit(EXIT_FAILURE)
    kind = "aborted" if result.get("aborted") else "done" if result["done"] else "stopped"
    channel.send(kind, worker.producer_id, result)


class Progress:
    """Aggregates worker heartbeats into one line (and a tqdm bar on a terminal)."""

    def __init__(self, spool, ids: list[str], every_s: float):
        self.spool, self.every_s = spool, every_s
        self.hb: dict[str, dict] = {i: {} for i in ids}
        self.t0 = self.last = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            self.bar = tqdm(total=0, unit="sample", desc="produce", dynamic_ncols=True)

    def update(self, pid: str, hb: dict) -> None:
        self.hb[pid] = hb
        if self.bar is not None:
            self.bar.total = int(sum(h.get("total", 0) for h in self.hb.values()))
            self.bar.n = int(sum(h.get("samples", 0) + h.get("dropped", 0) for h in self.hb.values()))
            self.bar.set_postfix_str(self._rates(), refresh=True)

    def _rates(self) -> str:
        tok_s = sum(h.get("tok_s", 0.0) for h in self.hb.values())
        ready = sum(1 for _ in self.spool.ready_dir.iterdir()) if self.spool.ready_dir.is_dir() else 0
        return f"{format_rate(tok_s)} tok/s | spool {ready} shards / {format_bytes(self.spool.total_bytes())}"

    def maybe_print(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.bar is not None or (not force and now - self.last < self.every_s):
            return
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


def merge_summaries(summaries: list[dict]) -> dict:
    """The workers' tokenization summaries as one: counts summed, reasons by count, the earliest example."""
    out = {"rows": 0, "samples": 0, "ok": 0, "dropped": 0, "skipped": 0, "reasons": {}, "first": {}}
    for sm in summaries:
        for k in ("rows", "ok", "dropped", "skipped"):
            out[k] += int(sm.get(k, 0))
        out["samples"] += int(sm.get("samples", sm.get("rows", 0)))
        for r, n in sm.get("reasons", {}).items():
            out["reasons"][r] = out["reasons"].get(r, 0) + n
        for r, ex in sm.get("first", {}).items():
            row = lambda e: int(e.split()[1].rstrip(":")) if e.startswith("row ") else 1 << 62  # noqa: E731
            if r not in out["first"] or row(ex) < row(out["first"][r]):
                out["first"][r] = ex
    out["reasons"] = dict(sorted(out["reasons"].items(), key=lambda kv: -kv[1]))
    return out


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


class Supervisor:
    """The workers of one launch, from spawn to exit status."""

    def __init__(self, prepared: Launch, launch: LaunchConfig):
        self.prepared, self.launch = prepared, launch
        # Pipes, not mp.Queue/Event: those are named POSIX semaphores in /dev/shm, and a launch killed with
        # its process group (run_all.sh's stop, a kill -9) takes the resource tracker along and leaks them.
        ctx = mp.get_context("spawn")
        self.procs: dict[str, mp.Process] = {}
        self.conns: dict[str, Connection] = {}
        for w in prepared.workers:
            mine, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_entry,
                args=(prepared.config, w, theirs, launch.log_level, os.getpid()),
                name=w.producer_id,
            )
            proc.start()
            theirs.close()
            self.procs[w.producer_id], self.conns[w.producer_id] = proc, mine
        self.go_sent = False
        self.progress = Progress(prepared.spool, list(self.procs), launch.progress_s)
        self.outcome: dict[str, tuple] = {}
        self.tokenized: dict[str, dict] = {}
        self.no_data: str | None = None
        self.stopping = False

    def on_signal(self, signum, frame) -> None:
        self.stopping = True
        for p in self.procs.values():
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)

    def decide(self) -> None:
        """Every worker tokenized (or died): go on, or abort when the dataset yields nothing to train."""
        summary = merge_summaries(list(self.tokenized.values()))
        unit = "rows" if summary["samples"] == summary["rows"] else "samples"
        _say(f"{summary['ok']} trainable {unit}; {format_drops(summary)}")
        everyone = len(self.tokenized) == len(self.procs)
        word = "go"
        if summary["ok"] == 0 and self.launch.num_nodes == 1 and everyone:
            self.no_data = (
                f"no trainable sample in dataset {self.prepared.config.data.dataset}: {format_drops(summary)}"
            )
            word = "abort"
        elif everyone:  # what this node's slices give, for the consumers' plan
            campaign = {
                k: sum(int(t["campaign"][k]) for t in self.tokenized.values())
                for k in ("samples", "tokens", "loss_tokens")
            }
            epochs = self.prepared.config.epochs
            self.prepared.spool.write_campaign(
                self.launch.node_rank,
                {
                    **campaign,
                    "epochs": epochs,
                    "node_rank": self.launch.node_rank,
                    "num_nodes": self.launch.num_nodes,
                },
            )
        for conn in self.conns.values():
            try:
                conn.send(word)
            except (BrokenPipeError, OSError):  # that worker is gone; its exit code tells
                pass
        self.go_sent = True

    def _events(self, timeout: float):
        """(kind, producer id, payload, *rest) events that arrived within ``timeout``; a closed pipe (the
        worker ended) is dropped from the watch."""
        open_conns = {c: pid for pid, c in self.conns.items()}
        for conn in wait(list(open_conns), timeout=timeout):
            try:
                yield conn.recv()
            except (EOFError, OSError):
                del self.conns[open_conns[conn]]

    def watch(self) -> None:
        """Relay events until every worker has ended and said all it had to say."""
        while self.conns or any(p.is_alive() for p in self.procs.values()):
            events = list(self._events(0.5)) if self.conns else (time.sleep(0.5) or [])
            for kind, pid, payload, *rest in events:
                if kind == "hb":
                    self.progress.update(pid, payload)
                elif kind == "tokenized":
                    self.tokenized[pid] = payload
                else:
                    self.outcome[pid] = (kind, payload, *rest)
                    if kind == "error":
                        log.error(
                            "worker %s failed: %s (the other workers finish their slices)", pid, payload
                        )
            if not self.go_sent and not self.stopping:  # a stop: the waiting workers see it and end
                pending = [
                    i
                    for i, p in self.procs.items()
                    if i not in self.tokenized and p.is_alive() and i not in self.outcome
                ]
                if not pending:
                    self.decide()
            self.progress.maybe_print()
        for p in self.procs.values():
            p.join()

    def exit_status(self) -> int:
        """0 done, 2 user error (every failure a user error, or no data), 1 a failure, 130 stopped."""
        if self.no_data is not None:
            _say(f"error: {self.no_data}")
            return EXIT_USAGE
        self.progress.maybe_print(force=True)
        failed, codes = [], []
        for pid, p in self.procs.items():
            kind, payload, *rest = self.outcome.get(pid, (None, None))
            if kind == "error":
                failed.append(f"{pid}: {payload}")
                codes.append(rest[0] if rest else EXIT_FAILURE)
            elif kind is None and not self.stopping:  # died without a word: kill -9, OOM killer, segfault
                failed.append(f"{pid}: exited with code {p.exitcode} without a report")
                codes.append(EXIT_FAILURE)
            elif kind == "done" and p.exitcode != 0 and not self.stopping:
                failed.append(f"{pid}: exited with code {p.exitcode} after its last shard")
                codes.append(EXIT_FAILURE)
        if failed:
            _say(f"error: {len(failed)} worker(s) failed: " + "; ".join(failed))
            return EXIT_USAGE if all(c == EXIT_USAGE for c in codes) else EXIT_FAILURE
        if len(self.outcome) < len(self.procs) or any(o[0] != "done" for o in self.outcome.values()):
            _say("stopped before the end (no DONE markers for stopped workers)")  # a late signal is no stop
            return EXIT_INTERRUPTED
        totals = {
            k: sum(int(o[1].get(k, 0)) for o in self.outcome.values())
            for k in ("samples", "tokens", "shards", "dropped", "bad", "short", "skipped")
        }
        _say("done: " + " ".join(f"{k}={v}" for k, v in totals.items()))
        return 0


def supervise(prepared: Launch, launch: LaunchConfig) -> int:
    """Run the launch's workers to their end; the launch's exit status."""
    sup = Supervisor(prepared, launch)
    old = {s: signal.signal(s, sup.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        sup.watch()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        sup.progress.close()
    return sup.exit_status()
