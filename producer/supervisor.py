"""The ``dflash-produce`` parent: spawn one worker process per device, relay their heartbeats as progress,
decide after tokenization whether the dataset gives anything to train, and turn their outcomes into the
launch's exit status.

The protocol between parent and workers is a pipe per worker (no named semaphores: nothing to leak in
/dev/shm however the launch dies), events up: ("tokenized", id, summary) once a worker's
slice is tokenized (it then waits for "go" or "abort" down its pipe), ("hb", id, heartbeat) while it runs, then one of
("done" | "stopped" | "aborted", id, counters) or ("error", id, message, exit code). A worker that dies
without a word (kill -9, OOM killer) is noticed when its pipe closes: named at once on the console, recorded
in the spool and its metrics; one that dies before its report stops the launch before any shard (decide).
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

from dflash.common.child_process import anonymous_library_locks, die_with_parent
from dflash.common.cli.exits import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, error_line, one_line
from dflash.common.compile import import_dynamo_in_main_thread
from dflash.common.contract.spool_records import DEAD_PHASE
from dflash.common.fault import fault_point
from dflash.common.metrics import MetricsLog
from dflash.common.target.drops import format_drops
from dflash.producer.config import PROG, LaunchConfig, ProducerConfig, Worker
from dflash.producer.launch import Launch
from dflash.producer.progress import Progress, merge_summaries

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
    fault_point(worker.fault_name, "start")  # before its first heartbeat
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


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


class Supervisor:
    """The workers of one launch, from spawn to exit status."""

    def __init__(self, prepared: Launch, launch: LaunchConfig, *, entry=None):
        """``entry``: the worker process's body (``_worker_entry``; a test passes a stand-in that speaks the
        same pipe protocol without a model)."""
        self.prepared, self.launch = prepared, launch
        # Pipes, not mp.Queue/Event: those are named POSIX semaphores in /dev/shm, and a launch killed with
        # its process group (run_all.sh's stop, a kill -9) takes the resource tracker along and leaks them.
        launch_no = prepared.workers[0].producer_id.rpartition(".")[2]
        self.fault_name = ("producer", f"producer.{launch_no}")  # its names in DFLASH_FAULT
        fault_point(self.fault_name, "registered")  # the spool bound, the workers registered, none spawned
        ctx = mp.get_context("spawn")
        self.procs: dict[str, mp.Process] = {}
        self.conns: dict[str, Connection] = {}
        for w in prepared.workers:
            mine, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=entry or _worker_entry,
                args=(prepared.config, w, theirs, launch.log_level, os.getpid()),
                name=w.producer_id,
            )
            proc.start()
            theirs.close()
            self.procs[w.producer_id], self.conns[w.producer_id] = proc, mine
        fault_point(self.fault_name, "spawned")
        self.go_sent = False
        self.progress = Progress(prepared.spool, list(self.procs), launch.progress_s)
        self.outcome: dict[str, tuple] = {}
        self.tokenized: dict[str, dict] = {}
        self.no_data: str | None = None
        self.dead: dict[str, str] = {}
        """Workers that died without a word (kill -9, OOM killer), said at once: how each died."""
        self.lost_before_report: list[str] = []
        """Workers that died before reporting their slice: the launch was stopped before any shard."""
        self.stopping = False

    def on_signal(self, signum, frame) -> None:
        self.stopping = True
        for p in self.procs.values():
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)

    def decide(self) -> None:
        """Every worker tokenized (or died): go on, or abort when the dataset yields nothing to train, or
        when a worker died before its report.

        Why a death before the report stops the launch: the campaign (what the consumers size their
        learning-rate schedule from) needs every slice's count. Without it the consumers trained on a
        made-up schedule of 10000 steps (lr 9e-6 .. 4e-5 where the real 53-step plan peaks at 6e-4) and
        a re-run resumed on the real one half-way through its warm-up. Stopped here, no worker has loaded
        the target yet, no shard exists: the same command again (or run_all.sh --restarts) starts over
        with nothing lost."""
        lost = [pid for pid in self.procs if pid not in self.tokenized and pid not in self.outcome]
        if lost and not self.stopping:
            self.lost_before_report = lost
            self._send_all("abort")
            self.go_sent = True
            return
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
        self._send_all(word)
        self.go_sent = True
        fault_point(self.fault_name, "decided")

    def _send_all(self, word: str) -> None:
        for conn in self.conns.values():
            try:
                conn.send(word)
            except (BrokenPipeError, OSError):  # that worker is gone; its exit code tells
                pass

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
            self._notice_deaths()
            if not self.go_sent and not self.stopping:  # a stop: the waiting workers see it and end
                pending = [
                    i
                    for i, p in self.procs.items()
                    if i not in self.tokenized and (p.is_alive() or i in self.conns) and i not in self.outcome
                ]
                if not pending:
                    self.decide()
            self.progress.maybe_print()
        for p in self.procs.values():
            p.join()

    def _notice_deaths(self) -> None:
        """A worker that ended without a word (its pipe closed, no outcome) died: say so at once, and
        record it in the spool (``mark_dead``) for the consumers, the others' epoch barrier and
        dflash-status. Before, it was said only when every other worker had finished its slice."""
        for pid, p in self.procs.items():
            if pid in self.dead or pid in self.outcome or pid in self.conns or p.is_alive():
                continue
            how = _how_it_died(p.exitcode)
            when = "after reporting its slice" if pid in self.tokenized else "before reporting its slice"
            self.dead[pid] = f"{how} {when}"
            if self.stopping:
                continue
            self._record_death(pid)
            rest = (
                "the launch stops (its slice is not counted: no campaign, no shard)"
                if pid not in self.tokenized
                else "the other workers finish their slices; its slice is produced by the next launch"
            )
            _say(f"worker {pid} {self.dead[pid]}; {rest}")

    def _record_death(self, pid: str) -> None:
        """The death in the spool (``mark_dead``: consumers, the epoch barrier) and as the last record of
        the worker's metrics file (dflash-status reads it after the spool is gone: phase ``dead``)."""
        run_dir = self.prepared.config.run_dir
        try:
            self.prepared.spool.mark_dead(pid, self.dead[pid])
            if run_dir:
                metrics = MetricsLog(os.path.join(run_dir, "metrics", f"producer-{pid}.jsonl"))
                metrics.write({"phase": DEAD_PHASE, "how": self.dead[pid]})
                metrics.close()
        except OSError as err:  # the spool or run dir went away: the console line still names it
            log.warning("could not record worker %s's death: %s", pid, one_line(err))

    def exit_status(self) -> int:
        """0 done, 2 user error (every failure a user error, or no data), 1 a failure, 130 stopped."""
        if self.no_data is not None:
            _say(f"error: {self.no_data}")
            return EXIT_USAGE
        if self.lost_before_report:
            rows = self.prepared.num_rows
            counted = sum(int(t.get("rows", 0)) for t in self.tokenized.values())
            dead = ", ".join(f"{i} ({self.dead.get(i, 'died')})" for i in self.lost_before_report)
            _say(
                f"error: worker(s) {dead}: the launch stopped before any shard ({counted} of {rows} rows "
                "counted); run the same command again"
            )
            return EXIT_FAILURE
        self.progress.maybe_print(force=True)
        failed, codes = [], []
        for pid, p in self.procs.items():
            kind, payload, *rest = self.outcome.get(pid, (None, None))
            if kind == "error":
                failed.append(f"{pid}: {payload}")
                codes.append(rest[0] if rest else EXIT_FAILURE)
            elif kind is None and not self.stopping:  # died without a word: kill -9, OOM killer, segfault
                failed.append(f"{pid}: {self.dead.get(pid) or _how_it_died(p.exitcode)}")
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


def _how_it_died(exitcode: int | None) -> str:
    """'killed by SIGKILL' for a signal's death, 'exited with code N without a report' otherwise."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode} without a report"


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
