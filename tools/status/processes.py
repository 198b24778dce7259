"""dflash-status's process table: one row per process of the current launch, merged from its metrics
file, its spool heartbeat and the launcher's pid file (the counters of the newest source win), with the
state each is in (alive, blocked, finished, stopped, failed, stale) and how the run as a whole stands.

Earlier launches are left out and named: producer ids carry their launch (n0p0.<launch>); a consumer rank
whose last record is older than the newest life's start belongs to an earlier (larger) group.
"""

from __future__ import annotations

import re
from typing import Any

from dflash.common.contract.spool_records import BUDGET_PHASE, DEAD_PHASE
from dflash.common.metrics import average_tok_s, is_number
from dflash.tools.status.sources import pid_alive

COUNTERS = (
    "samples",
    "tokens",
    "tok_s",
    "avg_tok_s",
    "elapsed_s",
    "total",
    "dropped",
    "phase",
    "step",
    "world_size",
    "shards_quarantined",
    "samples_quarantined",
)
ROLES = ("producer", "consumer")  # processes; other metrics files (ledger-r<rank>: trained samples) are not
# The trainer names its consumer id r<rank>-<pid> (unique per incarnation); its metrics file is per rank.
CONSUMER_ID_RE = re.compile(r"^r(\d+)-\d+$")
OVER = ("finished", "stopped", "failed")  # a process that said how it ended (or died without saying)
ENDS = ("end", "failed")  # the consumer's last metrics events (consumer/cli.py)
RUNNING = ("alive", "active", "blocked")

Key = tuple[str, str]  # (role, id)


def rank_key(row: dict[str, Any]) -> tuple:
    i = str(row["id"])
    return (row["role"], 0 if i.isdigit() else 1, int(i) if i.isdigit() else 0, i)


def current_producers(
    spool: dict[str, Any] | None, metrics: dict[str, list[dict[str, Any]]]
) -> set[str] | None:
    """The producer ids of the current launch (state/producers.json), None when no launch registered any:
    producer ids carry their launch (n0p0.<launch>), so earlier launches' files are told apart by id. With
    the spool gone (a finished run's is removed), the ids of the newest launch in the metrics."""
    reg = spool["producers_registered"] if spool and spool["exists"] else []
    if reg:
        return set(map(str, reg))
    ids = [stem.partition("-")[2] for stem in metrics if stem.startswith("producer-")]
    launches = {i: int(i.rpartition(".")[2]) for i in ids if i.rpartition(".")[2].isdigit() and "." in i}
    if not launches:
        return None
    newest = max(launches.values())
    return {i for i, n in launches.items() if n == newest}


def consumer_ends(recs: list[dict[str, Any]]) -> tuple[str | None, float | None, float | None]:
    """(how its last life ended: finished / stopped / failed, None while it runs; when that life started;
    its last record's time) from one consumer rank's metrics (lives are split by its end events)."""
    if not recs:
        return None, None, None
    ended = None
    last = recs[-1]
    if last.get("event") in ENDS:
        ended = "failed" if last["event"] == "failed" else ("stopped" if last.get("stopped") else "finished")
    ends = [i for i, r in enumerate(recs[:-1]) if r.get("event") in ENDS]
    start = recs[ends[-1] + 1 if ends else 0].get("time")
    return ended, start, last.get("time")


class ProcessTable:
    """The rows being merged: each source adds what it knows (``add_*``), ``finish`` settles them."""

    def __init__(self, metrics: dict[str, list[dict[str, Any]]], spool: dict[str, Any] | None) -> None:
        self.metrics, self.spool = metrics, spool
        self.rows: dict[Key, dict[str, Any]] = {}
        self.sources: dict[Key, list[tuple[float, dict[str, Any]]]] = {}
        self.verdict: dict[Key, tuple[bool, bool | None]] = {}  # (heartbeat alive, pid alive)
        self.current = current_producers(spool, metrics)
        self.older: set[str] = set()
        self.older_consumers: set[str] = set()
        self.ends = {
            s.partition("-")[2]: consumer_ends(r) for s, r in metrics.items() if s.startswith("consumer-")
        }

    def row(self, key: Key) -> dict[str, Any] | None:
        """The row of ``key``, made on first sight; None for what is no process of the current launch."""
        if key[0] not in ROLES:
            return None
        if key[0] == "producer" and self.current is not None and key[1] not in self.current:
            self.older.add(key[1])
            return None
        return self.rows.setdefault(key, {"role": key[0], "id": key[1], "pid": None, "host": None})

    def add_metrics(self) -> None:
        for stem, recs in self.metrics.items():
            role, _, id_ = stem.partition("-")
            steps = [r for r in recs if "event" not in r]
            if self.row((role, id_)) is not None and steps:
                self.sources.setdefault((role, id_), []).append((steps[-1].get("time") or 0.0, steps[-1]))

    def add_heartbeats(self) -> None:
        # oldest first, so a rank's newest incarnation (after a restart) sets pid/host/alive last
        for hb in sorted(self.spool["processes"] if self.spool else [], key=lambda h: h["time"]):
            key = (str(hb["role"]), str(hb["id"]))
            if key[0] == "consumer" and (m := CONSUMER_ID_RE.match(key[1])):
                key = ("consumer", m.group(1))
            if (r := self.row(key)) is None:
                continue
            r["pid"], r["host"] = hb.get("pid"), hb.get("host")
            self.verdict[key] = (bool(hb["alive"]), hb.get("pid_alive"))
            counters = {**hb.get("counters", {})}
            if (
                key[0] == "consumer"
                and "tok_s" not in counters
                and is_number(hb.get("rates", {}).get("tokens"))
            ):
                counters["tok_s"] = hb["rates"]["tokens"]  # the spool's rate of the `tokens` counter
            self.sources.setdefault(key, []).append((hb["time"], counters))

    def add_pids(self, pids: dict[str, int]) -> None:
        for name, pid in pids.items():
            role, _, id_ = name.partition("-")
            if not id_ and any(k[0] == role for k in self.rows):
                continue  # `producer <pid>`: the launcher of the workers already listed, not one more process
            if (r := self.row((role, id_))) is not None:
                r["pid"] = r["pid"] or pid

    def add_registered(self) -> None:
        """A row for every producer the current launch registered, also one that never wrote a heartbeat
        (a worker killed as it started): the run's producers are all listed, none silently left out."""
        if self.spool and self.spool["exists"]:
            for pid in self.spool["producers_registered"]:
                self.row(("producer", str(pid)))

    def finish(self, *, now: float, stale_s: float) -> None:
        """Each row's counters (newest source last), age, state and rate."""
        done = set(self.spool["producers_done"]) if self.spool else set()
        dead = self.spool.get("producers_dead", {}) if self.spool else {}
        for key, r in self.rows.items():
            for _, src in sorted(self.sources.get(key, []), key=lambda s: s[0]):
                r.update({k: src[k] for k in COUNTERS if src.get(k) is not None})
            last = max((t for t, _ in self.sources.get(key, [])), default=None)
            r["age_s"] = now - last if last else None
            ended = self.ends.get(r["id"], (None,))[0] if r["role"] == "consumer" else None
            is_done = r["role"] == "producer" and r["id"] in done
            if r["role"] == "producer" and r["id"] in dead:  # its parent saw it die
                r["phase"] = DEAD_PHASE
            r["state"] = process_state(r, self.verdict.get(key), done=is_done, stale_s=stale_s, ended=ended)
            r["active"] = r["state"] in RUNNING
            if r["role"] == "producer":
                r["tok_s"] = average_tok_s(r)  # the sustained rate, never the last heartbeat's

    def drop_older_consumers(self) -> None:
        """Consumers of a launch that is over: a rank whose last record is older than the newest life's
        start (it ended, died, or has said nothing since: a rank of an earlier, larger group)."""
        newest = max((e[1] for e in self.ends.values() if e[1] is not None), default=None)
        for key, r in list(self.rows.items()):
            last = self.ends.get(r["id"], (None, None, None))[2] if key[0] == "consumer" else None
            if newest is not None and last is not None and last < newest and r["state"] in (*OVER, "stale"):
                del self.rows[key]
                self.older_consumers.add(r["id"])


def process_rows(
    metrics: dict[str, list[dict[str, Any]]],
    spool: dict[str, Any] | None,
    pids: dict[str, int],
    *,
    now: float,
    stale_s: float,
) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """One row per process of the current launch, merged from its metrics file, spool heartbeat and
    launcher pid (the counters of the newest source win), sorted by role, then numeric id; and the ids of
    earlier launches' producers and consumer ranks, which are left out (their files stay in state/ and
    metrics/)."""
    table = ProcessTable(metrics, spool)
    table.add_metrics()
    table.add_heartbeats()
    table.add_registered()
    table.add_pids(pids)
    table.finish(now=now, stale_s=stale_s)
    table.drop_older_consumers()
    return sorted(table.rows.values(), key=rank_key), sorted(table.older), sorted(table.older_consumers)


def process_state(
    r: dict[str, Any],
    verdict: tuple[bool, bool | None] | None,
    *,
    done: bool,
    stale_s: float,
    ended: str | None = None,
) -> str:
    """finished | stopped | failed (it said so: a DONE marker, its last phase or end event; or it is gone
    without saying how it ended) | blocked (alive, waiting on the spool's byte budget) | alive | stale (no
    news, the process may still run) | active (fresh, liveness unknown)."""
    phase = r.get("phase")
    if done or (r["role"] == "producer" and phase == "done"):
        return "finished"
    if ended is not None:
        return ended
    if r["role"] == "producer" and phase in ("stopped", "aborted", DEAD_PHASE):
        return "stopped" if phase == "stopped" else "failed"
    live = liveness(r, verdict, stale_s=stale_s)
    if live == "exited":
        return "failed"
    return "blocked" if live == "alive" and phase == BUDGET_PHASE else live


def liveness(r: dict[str, Any], verdict: tuple[bool, bool | None] | None, *, stale_s: float) -> str:
    """alive | exited | stale | active, from the spool's verdict, else the launcher's pid, else the age."""
    fresh = r["age_s"] is not None and r["age_s"] <= stale_s
    if verdict is not None:  # the spool's verdict (pid, start time, heartbeat age), then the pid alone
        hb_alive, proc_alive = verdict
        if hb_alive:
            return "alive"
        return "exited" if proc_alive is False else "stale"
    alive = pid_alive(r["pid"], r["host"])  # no heartbeat: the launcher's pid, if any
    if alive is not None:
        return ("alive" if fresh else "stale") if alive else "exited"
    return "active" if fresh else "stale"
