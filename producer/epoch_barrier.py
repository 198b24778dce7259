"""The producers' epoch barrier: no producer publishes a shard of epoch k+1 before every producer of the
spool has published all of epoch k.

Why: a consumer claims the lowest epoch ready (common/contract/spool.py) and packs one epoch per step
(consumer/packing.py). That alone keeps epochs in order only if no shard of epoch k can appear after one
of k+1: a fast producer that ran ahead into k+1 while a slow one still wrote k would hand the consumers
k+1 samples whenever k's next shard was late. So each producer, at the end of its slice of epoch k, waits
until its writers have published everything, says so (``state/epoch-<id>.json``), and waits for the
others to say the same. The wait at a boundary is the slowest producer's tail of the epoch; producers
hold no spool bytes while they wait, so it cannot deadlock against the byte budget. A producer that is
gone (its parent recorded its death; its heartbeat stale, or DONE; or no heartbeat at all for as long:
killed before its first) is not waited for: its parent reports it, and one line says that the order
across producers no longer holds for that epoch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from dflash.common.contract.liveness import heartbeat_alive
from dflash.common.contract.spool import Spool

log = logging.getLogger(__name__)

GONE_AFTER_S = 60.0
"""A producer whose heartbeat is older than this (and that wrote no DONE marker) is not waited for."""
WAITING_LOG_S = 30.0


class EpochBarrier:
    """One producer's side of the barrier (``reached(k)`` at the end of each epoch of its slice)."""

    def __init__(self, spool: Spool, producer_id: str, *, stop: threading.Event, on_wait: Callable[[], None]):
        self.spool, self.producer_id, self.stop, self.on_wait = spool, producer_id, stop, on_wait
        self.waited_s = 0.0
        self._warned: set[str] = set()
        self._unseen_since: dict[str, float] = {}
        """When this barrier first found a registered producer without any heartbeat record."""

    def reached(self, epoch: int) -> bool:
        """Say that this producer published all of ``epoch``, then wait for the others; False when stopping."""
        self.spool.mark_epoch_done(self.producer_id, epoch)
        t0 = last_log = time.monotonic()
        while not self.stop.is_set():
            behind = self._behind(epoch)
            if not behind:
                self.waited_s += time.monotonic() - t0
                return True
            now = time.monotonic()
            if now - last_log >= WAITING_LOG_S:
                log.info(
                    "producer %s: epoch %d done, waiting %.0f s for %s to finish it (epochs stay in order)",
                    self.producer_id,
                    epoch,
                    now - t0,
                    ", ".join(behind),
                )
                last_log = now
            self.on_wait()
            self.stop.wait(0.2)
        return False

    def _behind(self, epoch: int) -> list[str]:
        """The registered producers that have not published all of ``epoch`` and are still alive."""
        done = self.spool.epochs_done()
        finished = set(self.spool.done_producers())
        alive = {
            str(hb.get("id")): heartbeat_alive(hb, timeout_s=GONE_AFTER_S)
            for hb in self.spool.heartbeats()
            if hb.get("role") == "producer"
        }
        dead = self.spool.dead_producers()  # its parent saw it die: gone at once
        behind = []
        for pid in self.spool.registered_producers():
            if pid == self.producer_id or pid in finished or done.get(pid, -1) >= epoch:
                continue
            if pid in dead or self._gone(pid, alive.get(pid)):
                if pid not in self._warned:
                    self._warned.add(pid)
                    log.warning(
                        "producer %s: producer %s is gone (no heartbeat for %.0f s); not waiting for it at "
                        "epoch %d: its relaunch may publish epoch %d shards after others' epoch %d",
                        self.producer_id,
                        pid,
                        GONE_AFTER_S,
                        epoch,
                        epoch,
                        epoch + 1,
                    )
                continue
            behind.append(pid)
        return behind

    def _gone(self, pid: str, alive: bool | None) -> bool:
        """A stale heartbeat, or none at all for ``GONE_AFTER_S`` of this barrier's waits: a worker killed
        before its first heartbeat never writes one, and waiting for it would hold every epoch forever."""
        if alive is not None:
            return not alive
        since = self._unseen_since.setdefault(pid, time.monotonic())
        return time.monotonic() - since >= GONE_AFTER_S
