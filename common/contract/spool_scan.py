"""What a spool holds, read without changing it: shards and bytes per state and bucket, and the processes'
heartbeats (``Spool.stats``, ``total_bytes`` for the byte budget). A scan tolerates entries moving or
vanishing under it: producers and consumers keep renaming while it runs. ``Spool`` holds one ``SpoolScan``
(its ``scan``), handed the spool's records for the heartbeats and producers a snapshot reports."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from dflash.common.contract.liveness import heartbeat_alive
from dflash.common.contract.names import is_shard_name, parse_shard_name
from dflash.common.contract.spool_records import SpoolRecords

log = logging.getLogger(__name__)


def entry_nbytes(path: str) -> int:
    """Apparent bytes of a file or a directory tree. Tolerates entries vanishing mid-walk (a tmp shard
    being written or published): what moved is counted in its new state."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total, stack = 0, [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        else:
                            total += e.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue
        except FileNotFoundError:
            continue
    return total


FLOW = ("tmp", "ready", "claimed", "acked")
"""The states a shard moves through, in order: scanned in this order, a shard moving during a scan is
seen in its later state and never missed (acked/: being deleted, still holding its bytes)."""


def scan_dirs(parent: Path) -> list[Path]:
    """The sub-directories of ``parent`` (none when it vanished): the owners' folders under claimed/."""
    try:
        with os.scandir(parent) as it:
            return [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def scan_names(d: Path) -> Iterator[str]:
    """The shard names in ``d`` (none when it vanished)."""
    try:
        with os.scandir(d) as it:
            names = [e.name for e in it if is_shard_name(e.name)]
    except FileNotFoundError:
        return iter(())
    return iter(names)


class SpoolScan:
    """Read-only accounting of a spool's states: one per ``Spool``, shared by that process's threads (the
    size cache is a hint guarded by a lock)."""

    STATES = ("tmp", "ready", "claimed", "quarantine")

    def __init__(self, root: Path, claimed_dir: Path, records: SpoolRecords) -> None:
        self.root, self.claimed_dir, self.records = root, claimed_dir, records
        self._lock = threading.Lock()
        self._size_cache: dict[tuple[str, int], int] = {}  # (name, inode) -> bytes; shards are immutable

    def remember_size(self, name: str, inode: int, size: int) -> None:
        """The bytes of a shard just published (its writer knows them: no walk at the next scan)."""
        with self._lock:
            self._size_cache[(name, inode)] = size

    def entries(self, states: tuple[str, ...]) -> list[tuple[str, str, str, int]]:
        """(state, owner, entry name, bytes) for every entry (ack trash included: it still takes space).
        Published shards never change, so their size is cached by (name, inode) and a poll costs one
        scandir per directory; tmp/ and quarantine/ are walked. States are scanned in flow order
        (tmp -> ready -> claimed) so a shard moving during the scan is never missed, and names are
        unique among live shards, so one seen twice is counted once (in its later state)."""
        out: dict[str, tuple[str, str, str, int]] = {}
        seen: set[tuple[str, int]] = set()
        for state in states:
            dirs = scan_dirs(self.claimed_dir) if state == "claimed" else [self.root / state]
            cached = state in ("ready", "claimed")
            for d in dirs:
                try:
                    with os.scandir(d) as it:
                        entries = [
                            (e.name, e.path, e.inode()) for e in it if not e.name.endswith((".tmp", ".why"))
                        ]
                except FileNotFoundError:
                    continue
                owner = d.name if state == "claimed" else ""
                for name, path, inode in entries:
                    if not cached:
                        size = entry_nbytes(path)
                    elif (size := self._size_cache.get((name, inode))) is None:
                        size = entry_nbytes(path)
                        with self._lock:
                            self._size_cache[(name, inode)] = size
                    seen.add((name, inode))
                    out["q/" + name if state == "quarantine" else name] = (state, owner, name, size)
        if "ready" in states and "claimed" in states and "acked" in states:  # a full scan: forget shards gone
            with self._lock:
                self._size_cache = {k: v for k, v in self._size_cache.items() if k in seen}
        return list(out.values())

    def total_bytes(self) -> int:
        """Bytes in tmp+ready+claimed, and acked shards not yet deleted (what backpressure limits)."""
        return sum(s for *_, s in self.entries(FLOW))

    def stats(self, *, heartbeat_timeout_s: float = 60.0) -> dict:
        """Shards and bytes per state and per bucket, per-consumer claims, process heartbeats (pid, age,
        alive, counters, rates) and producer completion. JSON-serializable (bucket keys become str)."""
        states: dict[str, dict] = {s: {"shards": 0, "bytes": 0, "buckets": {}} for s in self.STATES}
        claimed_by: dict[str, dict] = {}
        acked = 0
        for state, owner, name, size in self.entries((*self.STATES, "acked")):
            if state == "acked":  # deleted as we look: only its bytes count (they still hold the budget)
                acked += size
                continue
            try:
                bucket: int | str = parse_shard_name(name)[0]
            except ValueError:
                bucket = "other"  # trash of an ack in progress, stray files
            row = states[state]
            row["shards"] += bucket != "other"
            row["bytes"] += size
            b = row["buckets"].setdefault(bucket, {"shards": 0, "bytes": 0})
            b["shards"] += bucket != "other"
            b["bytes"] += size
            if state == "claimed":
                c = claimed_by.setdefault(owner, {"shards": 0, "bytes": 0})
                c["shards"] += bucket != "other"
                c["bytes"] += size
        now = time.time()
        procs = []
        for hb in self.records.heartbeats():
            procs.append(
                {
                    "role": hb.get("role"),
                    "id": hb.get("id"),
                    "pid": hb.get("pid"),
                    "host": hb.get("host"),
                    "age_s": now - float(hb.get("time", 0.0)),
                    "alive": heartbeat_alive(hb, timeout_s=heartbeat_timeout_s, now=now),
                    "counters": hb.get("counters", {}),
                    "rates": hb.get("rates", {}),
                }
            )
        return {
            "root": str(self.root),
            "time": now,
            "states": states,
            "total_bytes": sum(states[s]["bytes"] for s in ("tmp", "ready", "claimed")) + acked,
            "claimed_by": claimed_by,
            "processes": procs,
            "producers": {
                "registered": self.records.registered_producers(),
                "done": self.records.done_producers(),
                "dead": self.records.dead_producers(),
            },
            "producers_done": self.records.producers_done(),
            "drained": self.records.producers_done()
            and not any(states[s]["shards"] for s in ("tmp", "ready", "claimed")),
        }
