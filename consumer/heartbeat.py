"""The consumer's heartbeat: a thread that writes this consumer's counters to the spool's ``state/`` every
few seconds and reads back what the spool holds (its depth, the producers' rate, how many producers still
produce).

Why a thread of its own: a long first compile, a checkpoint or an evaluation must never make this consumer
look dead to the others (they would take its claims back), and a scan of the spool takes tens of ms, too
long for the training loop. Its owners hand it their counters (``update``, ``add_source``); the feed asks
it whether a producer still produces, the interval logger what the spool holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from dflash.common.cli.exits import error_line
from dflash.common.contract.liveness import heartbeat_alive
from dflash.common.contract.spool import Spool
from dflash.common.contract.spool_records import IDLE_PHASES

log = logging.getLogger(__name__)


class ConsumerHeartbeat:
    """One consumer's heartbeat (module docstring): started at construction, a first beat and a first scan
    done before it returns; ``close`` writes the last one."""

    def __init__(self, spool: Spool, consumer_id: str, *, timeout_s: float) -> None:
        self.spool, self.consumer_id, self.timeout_s = spool, consumer_id, timeout_s
        self.every_s = max(0.5, min(5.0, timeout_s / 4))
        """Beats often enough that the others' timeout sees four of them."""
        self._counters: dict = {}
        self._sources: list[Callable[[], dict]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._spool_summary: dict = {}
        self._producers_producing = 0
        self._last_problem = ""
        self._scan_safely()
        self.spool.heartbeat("consumer", consumer_id, {})
        self._thread = threading.Thread(target=self._loop, name=f"hb-{consumer_id}", daemon=True)
        self._thread.start()

    def update(self, **counters) -> None:
        """Counters of the training (step, samples, rate, world size) for the next beats."""
        with self._lock:
            self._counters.update(counters)

    def add_source(self, counters: Callable[[], dict]) -> None:
        """A part whose counters every beat reads afresh (the feed's quarantine losses)."""
        with self._lock:
            self._sources.append(counters)

    @property
    def producers_producing(self) -> int:
        """Live producers not done and not blocked on the spool budget, as the last scan saw them: while
        one is, a stream short of samples waits for more (``ShardFeed.next_packed``)."""
        return self._producers_producing

    @property
    def spool_summary(self) -> dict:
        """Spool depth and the producers' summed rate, as the last scan saw them (a copy)."""
        return dict(self._spool_summary)

    def _beat_counters(self) -> dict:
        with self._lock:
            out = dict(self._counters)
            sources = list(self._sources)
        for counters in sources:
            out.update(counters())
        return out

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.spool.heartbeat("consumer", self.consumer_id, self._beat_counters())
            except Exception as err:  # noqa: BLE001  a full spool, a failing counter source: beat on
                self._warn(f"heartbeat failed: {error_line(err)}")
            self._scan_safely()

    def _scan_safely(self) -> None:
        """A scan whose failure is said (once while it lasts) and leaves the last scan's view: a vanished
        spool, or another process's unreadable record, must not stop this consumer's beats (the others
        would take its claims back) nor its training."""
        try:
            self._scan()
        except Exception as err:  # noqa: BLE001
            self._warn(f"spool scan failed (the last one's view is kept): {error_line(err)}")

    def _warn(self, problem: str) -> None:
        if problem != self._last_problem:
            log.warning("%s", problem)
            self._last_problem = problem

    def _scan(self) -> None:
        s = self.spool.stats(heartbeat_timeout_s=self.timeout_s)
        live = [p for p in s["processes"] if p.get("role") == "producer" and p.get("alive")]
        self._producers_producing = sum(p["counters"].get("phase") not in IDLE_PHASES for p in live)
        self._spool_summary = {
            "spool_shards": s["states"]["ready"]["shards"],
            "spool_bytes": s["total_bytes"],
            "prod_tok_s": sum(float(p["counters"].get("tok_s", 0.0)) for p in live),
        }

    def close(self) -> None:
        """Stop the thread; the last beat carries the final counters (quarantine losses: dflash-status)."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        try:
            self.spool.heartbeat("consumer", self.consumer_id, self._beat_counters())
        except OSError:
            pass


def dead_producers_phrase(spool: Spool, *, timeout_s: float) -> str:
    """'; registered producer(s) X (how) dead: ...' for the registered producers that will never write
    their DONE marker (their parent recorded the death, or their heartbeat's process is gone), else ''.
    Why: a consumer waits for a dead producer's marker for ever, and only a new producer launch (the same
    command) ends the wait; a hand-started consumer must say so, not look merely idle."""
    done = set(spool.done_producers())
    how = spool.dead_producers()
    for hb in spool.heartbeats():
        pid = str(hb.get("id"))
        if hb.get("role") == "producer" and pid not in how and not heartbeat_alive(hb, timeout_s=timeout_s):
            how[pid] = "its process is gone"
    dead = [p for p in spool.registered_producers() if p in how and p not in done]
    if not dead:
        return ""
    named = ", ".join(f"{p} ({how[p]})" for p in dead)
    return (
        f"; registered producer(s) {named} dead: no DONE marker will come, run the producers' command again "
        "(a new launch produces what they left)"
    )
