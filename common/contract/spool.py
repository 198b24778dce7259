"""The spool's shard flow: every state transition of a shard, as the methods of one class.

The crash-safe spool between producers and consumers is one directory and POSIX renames
(docs/architecture.md). ``Spool`` is the flow and holds two parts: its ``records`` (``SpoolRecords``,
spool_records.py: run record, locks, producers, heartbeats) and its ``scan`` (``SpoolScan``, spool_scan.py:
read-only accounting); its methods of the same names hand each call to the part that owns it, so callers
keep one object. The renames themselves (and what a crash halfway leaves) are in spool_files.py.

Every state change of a shard is one ``os.rename`` inside one filesystem, so a process killed at any
instant leaves each shard in exactly one state:

    tmp/<name>  --publish-->  ready/<name>  --claim-->  claimed/<consumer>/<name>  --ack-->  (deleted)
                                   ^------- release / recover_dead_claims ----------'
                              any state  --quarantine-->  quarantine/<name> (+ <name>.why)

A shard is opaque here (a directory or a file); this module never imports zarr or torch, so producers,
consumers and the CLI share it cheaply. Delivery is at-least-once: a shard claimed by a consumer that
dies is moved back to ready/ by any other consumer (``recover_dead_claims``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from dflash.common.contract.liveness import SpoolLock, heartbeat_alive
from dflash.common.contract.names import check_id, is_shard_name, parse_shard_name
from dflash.common.contract.spool_files import (
    ACKED_SEP,
    check_bucket,
    claim_order,
    finish_acks_of,
    forget_flow,
    looks_like_spool,
    quarantine_into,
    remove,
    return_to_ready,
)
from dflash.common.contract.spool_records import SpoolError, SpoolRecords, read_json
from dflash.common.contract.spool_scan import SpoolScan, entry_nbytes, scan_dirs, scan_names

log = logging.getLogger(__name__)

DIR_MODE = 0o700


def default_budget_bytes(root: str | Path, fraction: float = 0.5) -> int:
    """``fraction`` of the space the spool may use: free space on its filesystem plus what it holds now
    (so a restarted producer gets the same budget as before, not a smaller one)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    path = Path(root).absolute()
    while not path.exists():
        path = path.parent
    st = os.statvfs(path)
    held = Spool(root, create=False).total_bytes() if looks_like_spool(Path(root)) else 0
    return int((st.f_bavail * st.f_frsize + held) * fraction)


class Spool:
    """A spool directory. One object per process and role (consumers: one per consumer id); it may be
    shared by that process's threads (its caches are hints guarded by a lock)."""

    STATES = SpoolScan.STATES

    def __init__(self, root: str | Path, *, create: bool = True):
        self.root = Path(root).absolute()
        self.tmp_dir = self.root / "tmp"
        self.ready_dir = self.root / "ready"
        self.claimed_dir = self.root / "claimed"
        self.quarantine_dir = self.root / "quarantine"
        self.state_dir = self.root / "state"
        self.acked_dir = self.root / "acked"  # acked shards being deleted (see ack)
        self._lock = threading.RLock()
        self._adopted: set[str] = set()  # consumer ids whose leftovers this object has taken over
        self.records = SpoolRecords(self.root, self.state_dir)
        """``state/``: the run record, launch locks, producers and their markers, the campaign, heartbeats."""
        self.scan = SpoolScan(self.root, self.claimed_dir, self.records)
        """What the spool holds, read without changing it: bytes per state, ``stats``."""
        if create:
            for d in (
                self.tmp_dir,
                self.ready_dir,
                self.claimed_dir,
                self.quarantine_dir,
                self.state_dir,
                self.acked_dir,
            ):
                self._makedirs(d)
        elif not self.root.is_dir():
            raise SpoolError(f"no spool directory at {self.root}")
        elif not looks_like_spool(self.root):
            raise SpoolError(f"{self.root} is not a spool (expected tmp/ ready/ claimed/ quarantine/ state/)")

    @staticmethod
    def _makedirs(path: Path) -> None:
        """mkdir -p with mode 0700 for every directory we create, whatever the umask."""
        missing = []
        p = path
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                d.mkdir(mode=DIR_MODE)
            except FileExistsError:
                continue
            os.chmod(d, DIR_MODE)

    # ---- the records' and the scan's methods, on the spool itself (one object for every caller) ----

    def read_run(self) -> dict | None:
        return self.records.read_run()

    def bind_run(self, identity: dict, *, who: str = "this launch") -> dict:
        return self.records.bind_run(identity, who=who)

    def next_launch(self) -> int:
        return self.records.next_launch()

    def acquire_lock(self, name: str, holder: str) -> SpoolLock:
        return self.records.acquire_lock(name, holder)

    def live_locks(self) -> dict[str, str]:
        return self.records.live_locks()

    def register_producers(self, producer_ids: list[str]) -> None:
        self.records.register_producers(producer_ids)

    def registered_producers(self) -> list[str]:
        return self.records.registered_producers()

    def write_campaign(self, node_rank: int, record: dict) -> None:
        self.records.write_campaign(node_rank, record)

    def read_campaign(self) -> list[dict] | None:
        return self.records.read_campaign()

    def mark_done(self, producer_id: str) -> None:
        self.records.mark_done(producer_id)

    def clear_done(self, producer_id: str) -> None:
        self.records.clear_done(producer_id)

    def done_producers(self) -> list[str]:
        return self.records.done_producers()

    def mark_dead(self, producer_id: str, how: str) -> None:
        self.records.mark_dead(producer_id, how)

    def dead_producers(self) -> dict[str, str]:
        return self.records.dead_producers()

    def producers_done(self) -> bool:
        return self.records.producers_done()

    def mark_epoch_done(self, producer_id: str, epoch: int) -> None:
        self.records.mark_epoch_done(producer_id, epoch)

    def epochs_done(self) -> dict[str, int]:
        return self.records.epochs_done()

    def heartbeat(self, role: str, proc_id: str, counters: dict) -> None:
        self.records.heartbeat(role, proc_id, counters)

    def heartbeats(self) -> list[dict]:
        return self.records.heartbeats()

    def total_bytes(self) -> int:
        return self.scan.total_bytes()

    def stats(self, *, heartbeat_timeout_s: float = 60.0) -> dict:
        return self.scan.stats(heartbeat_timeout_s=heartbeat_timeout_s)

    # ---- the flow ----

    def leftover_shards(self) -> list[Path]:
        """Published shards still in the flow (ready/ and claimed/): a previous launch's leftovers when no
        process of the run is live."""
        out = [self.ready_dir / n for n in scan_names(self.ready_dir)]
        for d in scan_dirs(self.claimed_dir):
            out += [d / n for n in scan_names(d)]
        return sorted(out, key=lambda p: p.name)

    def discard_flow(self) -> dict:
        """Forget a previous launch's flow: every shard in tmp/, ready/ and claimed/ (and ack trash), the
        producer registration, DONE markers, heartbeats and the quarantined shards (their samples are in no
        trained set, so they are produced again). Keeps state/run.json (the run's identity), the
        quarantine/*.why reasons and the lock files. Only when no process of the run is live (the caller
        holds the launch lock and checked ``live_locks``). Returns {"shards": n, "samples": m}."""
        leftovers = self.leftover_shards()
        samples = sum(_said_num_samples(p) for p in leftovers)
        forget_flow(self.root)
        return {"shards": len(leftovers), "samples": samples}

    # ---- producer side ----

    def new_tmp_path(self, name: str) -> Path:
        """Where to write shard ``name`` before publishing; the name carries the producer id (clean_tmp)."""
        parse_shard_name(name)
        return self.tmp_dir / name

    def publish(self, tmp_path: Path, *, nbytes: int | None = None) -> Path:
        """Atomically move a fully written shard into ready/. ``nbytes`` (e.g. write_shard's return) saves
        a walk for the byte accounting."""
        tmp_path = Path(tmp_path).absolute()
        if tmp_path.parent != self.tmp_dir:
            raise ValueError(f"publish expects a path from new_tmp_path(), got {tmp_path}")
        name = tmp_path.name
        dest = self.ready_dir / name
        if dest.exists() or any(True for _ in self._claimed_copies(name)):
            raise SpoolError(f"shard {name} is already live in the spool (reused producer seq?)")
        inode = os.lstat(tmp_path).st_ino
        os.rename(tmp_path, dest)
        self.scan.remember_size(name, inode, entry_nbytes(str(dest)) if nbytes is None else int(nbytes))
        return dest

    def _claimed_copies(self, name: str) -> Iterator[Path]:
        for d in scan_dirs(self.claimed_dir):
            if (d / name).exists():
                yield d / name

    def next_seq(self, producer_id: str) -> int:
        """1 + the highest seq of ``producer_id`` still in the spool (0 if none): a restarted producer
        starts there so its names never collide with live shards."""
        best = -1
        for state_dir in (
            self.tmp_dir,
            self.ready_dir,
            self.quarantine_dir,
            *scan_dirs(self.claimed_dir),
        ):
            for name in scan_names(state_dir):
                _, pid, seq = parse_shard_name(name)
                if pid == producer_id:
                    best = max(best, seq)
        return best + 1

    def clean_tmp(self, producer_id: str) -> int:
        """Remove this producer's tmp/ leftovers (a previous life killed mid-write). Call once on start;
        never while another live process uses the same producer id."""
        check_id("producer_id", producer_id)
        n = 0
        for name in scan_names(self.tmp_dir):
            if parse_shard_name(name)[1] == producer_id:
                remove(self.tmp_dir / name)
                n += 1
        if n:
            log.info("removed %d tmp leftovers of producer %s", n, producer_id)
        return n

    def clean_tmp_of(self, prefix: str) -> int:
        """Remove the tmp/ leftovers of every producer whose id starts with ``prefix`` (dflash-produce
        of node N passes "nNp" while it holds that node's producer lock, so none of them is live)."""
        n = 0
        for name in scan_names(self.tmp_dir):
            if parse_shard_name(name)[1].startswith(prefix):
                remove(self.tmp_dir / name)
                n += 1
        return n

    def wait_for_budget(
        self,
        budget_bytes: int,
        *,
        poll_s: float = 0.05,
        should_stop: Callable[[], bool] | None = None,
        waiting: threading.Event | None = None,
    ) -> bool:
        """Block while the spool holds more than ``budget_bytes`` (tmp+ready+claimed). Nothing is dropped:
        the caller writes its next shard only after this returns, so the spool stays under budget plus
        one shard per producer. ``waiting`` is set once the spool is seen over the budget and cleared when
        this returns after that (the producer's heartbeat and rates tell a budget wait from work by it).
        Returns False if ``should_stop()`` ended the wait, else True."""
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes!r}")
        t0 = None
        try:
            while (total := self.total_bytes()) > budget_bytes:
                if t0 is None:
                    t0 = time.monotonic()
                    log.info("spool holds %d bytes > budget %d: waiting for consumers", total, budget_bytes)
                    if waiting is not None:
                        waiting.set()
                if should_stop is not None and should_stop():
                    return False
                time.sleep(poll_s)
        finally:
            if waiting is not None and t0 is not None:
                waiting.clear()
        if t0 is not None:
            log.info("spool back under budget after %.1f s", time.monotonic() - t0)
        return True

    @property
    def eval_dir(self) -> Path:
        """eval/: held-out shards, written once per campaign, read (never claimed) by consumers."""
        path = self.root / "eval"
        path.mkdir(mode=DIR_MODE, exist_ok=True)
        return path

    def publish_eval(self, name: str, write: Callable[[Path], object]) -> Path:
        """Write an eval shard with ``write(path)`` under a hidden name, then rename it into eval/: readers
        only ever see whole shards, as with publish."""
        parse_shard_name(name)
        tmp = self.eval_dir / f".tmp-{name}"
        write(tmp)
        dest = self.eval_dir / name
        os.rename(tmp, dest)
        return dest

    def eval_shards(self) -> list[Path]:
        """The complete eval shards (a shard being written is hidden as .tmp-*)."""
        return sorted(p for p in self.eval_dir.iterdir() if not p.name.startswith("."))

    def eval_sample_ids(self):
        """Sample ids in the eval shards (a numpy int64 array)."""
        from dflash.common.contract.shard_reader import read_sample_index  # zarr and torch only here

        parts = [read_sample_index(p) for p in self.eval_shards()]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def is_drained(self) -> bool:
        """No shard will ever arrive again: producers done (checked first: they publish before DONE)
        and no shard left in tmp/, ready/ or claimed/ (claims of dead consumers count until
        ``recover_dead_claims`` gives them back)."""
        if not self.producers_done():
            return False
        dirs = (self.tmp_dir, self.ready_dir, *scan_dirs(self.claimed_dir))
        return not any(any(True for _ in scan_names(d)) for d in dirs)

    # ---- consumer side ----

    def claim(self, consumer_id: str, *, bucket: int | None | str = None) -> Path | None:
        """Lease one ready shard by renaming it into claimed/<consumer_id>/; exactly one consumer wins a
        race, losers try the next name. Only shards of the lowest epoch ready are candidates (epochs are
        trained in order; producers publish epoch k+1 only once all of epoch k is published: their epoch
        barrier, producer/loop.py). bucket: None = any (lowest name first), an int = only that
        bucket, "fullest" = the bucket with the most ready shards, "random" = any, uniformly (consumers
        that pack fixed-size steps use it: training order then mixes lengths instead of running through
        the buckets shortest first). None when nothing matches."""
        check_bucket(bucket)
        mine = self.claimed_dir / check_id("consumer_id", consumer_id)
        with self._lock:
            if consumer_id not in self._adopted:
                self._adopt(consumer_id)
        for name in claim_order(list(scan_names(self.ready_dir)), bucket):
            try:
                os.rename(self.ready_dir / name, mine / name)
            except FileNotFoundError:
                if not mine.is_dir():  # recovered (and removed) while we looked stale: take it back
                    self._makedirs(mine)
                    try:
                        os.rename(self.ready_dir / name, mine / name)
                    except FileNotFoundError:
                        continue
                    return mine / name
                continue  # another consumer won this one
            return mine / name
        return None

    def _adopt(self, consumer_id: str) -> None:
        """First claim of this object for ``consumer_id``: make sure its claimed dir and a heartbeat
        exist, and give back what a previous process with the same id left claimed (at-least-once)."""
        mine = self.claimed_dir / consumer_id
        self._makedirs(mine)
        if not (self.state_dir / f"consumer-{consumer_id}.json").exists():
            self.heartbeat("consumer", consumer_id, {})
        n = return_to_ready(mine, self.ready_dir, remove_dir=False)
        if n:
            log.warning("consumer %s: returned %d shards left claimed by its previous life", consumer_id, n)
        finish_acks_of(self.acked_dir, consumer_id)
        self._adopted.add(consumer_id)

    def _claimed_path_parts(self, path: Path) -> tuple[Path, str]:
        path = Path(path)
        if path.parent.parent != self.claimed_dir or not is_shard_name(path.name):
            raise ValueError(f"not a claimed shard path of this spool: {path}")
        return path.parent, path.name

    def ack(self, claimed_path: Path, *, delete: bool = True) -> Path | None:
        """Delete a shard whose samples are trained (after the optimizer step that used them). Renamed to
        a hidden trash name first, so a crash mid-delete never leaves a half shard that looks claimed.

        The rename is the ack. ``delete=False`` returns the trash path for the caller to remove later with
        ``remove_trash`` (freeing a 1.6 GB shard of tmpfs pages takes tens of ms: a training loop hands it
        to a background thread); None if the shard was already gone."""
        owner_dir, name = self._claimed_path_parts(claimed_path)
        # Into acked/, not beside the claim: a directory listing that runs while an entry is renamed
        # within it may miss the entry altogether, and a producer's budget scan that missed a 1.6 GB
        # shard being deleted would admit the next one early. acked/ is scanned after claimed/ (flow
        # order), so an acked shard is always counted until its pages are freed.
        trash = self.acked_dir / f"{owner_dir.name}{ACKED_SEP}{name}{ACKED_SEP}{uuid.uuid4().hex[:8]}"
        try:
            os.rename(claimed_path, trash)
        except FileNotFoundError:
            if not self.acked_dir.is_dir() and claimed_path.exists():  # a spool made before acked/ existed
                self._makedirs(self.acked_dir)
                return self.ack(claimed_path, delete=delete)
            log.warning("ack: %s is gone (recovered as dead and re-delivered?)", claimed_path)
            return None
        if not delete:
            return trash
        remove(trash)
        return None

    @staticmethod
    def remove_trash(trash: Path) -> None:
        """Finish an ``ack(..., delete=False)``."""
        remove(trash)

    def release(self, claimed_path: Path) -> None:
        """Give a claimed shard back to ready/ unprocessed (e.g. on a clean shutdown)."""
        _, name = self._claimed_path_parts(claimed_path)
        try:
            os.rename(claimed_path, self.ready_dir / name)
        except FileNotFoundError:
            log.warning("release: %s is gone (recovered as dead?)", claimed_path)

    def quarantine(self, path: Path, why: str, *, say: bool = True) -> Path:
        """Move a shard that cannot be decoded into quarantine/ with a <name>.why (spool_files.py); a
        warning line says so unless ``say=False`` (the caller's own line does)."""
        return quarantine_into(self.quarantine_dir, path, why, say=say)

    def recover_dead_claims(self, *, heartbeat_timeout_s: float = 60.0) -> int:
        """Move shards claimed by dead consumers back to ready/; returns how many. Any consumer may call
        it (races are safe: each rename has one winner). Claims of a consumer with no heartbeat file are
        left alone until its claimed dir is older than the timeout."""
        n = 0
        now = time.time()
        for d in scan_dirs(self.claimed_dir):
            hb = read_json(self.state_dir / f"consumer-{d.name}.json")
            if hb is not None:
                dead = not heartbeat_alive(hb, timeout_s=heartbeat_timeout_s, now=now)
            else:
                try:
                    dead = now - os.stat(d).st_mtime > heartbeat_timeout_s
                except FileNotFoundError:
                    continue
            if dead and d.name not in self._adopted:
                moved = return_to_ready(d, self.ready_dir, remove_dir=True)
                if moved:
                    log.warning("recovered %d shards claimed by dead consumer %s", moved, d.name)
                n += moved
                finish_acks_of(self.acked_dir, d.name)
        return n

    def return_claims(self, consumer_id: str) -> int:
        """Give everything ``consumer_id`` holds in claimed/ back to ready/ at once; returns how many.

        For a process that knows the owner is dead (the trainer, after its data worker died: the worker
        claims under the trainer's id), so the shards need not wait for the heartbeat timeout. What the
        dead owner left half-acked in acked/ was trained: it is deleted, never returned."""
        n = return_to_ready(
            self.claimed_dir / check_id("consumer_id", self.ready_dir, consumer_id), remove_dir=False
        )
        finish_acks_of(self.acked_dir, consumer_id)
        self._adopted.discard(consumer_id)  # the next claim under this id adopts (and checks) again
        return n


def _said_num_samples(shard: Path) -> int:
    """A leftover shard's sample count, for the line that says what a launch discarded: its ``num_samples``
    attribute read straight from the zarr v3 group's metadata file (``zarr.json``), 0 when it cannot be
    read (a torn or foreign shard is discarded all the same). Not through shard_reader: that imports torch
    and zarr, ~1.5 s of every ``dflash-spool prepare``, which every launch of run_all.sh runs."""
    try:
        attrs = json.loads((shard / "zarr.json").read_text())["attributes"]
        return int(attrs.get("num_samples", 0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0
