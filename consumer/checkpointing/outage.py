"""What a consumer does while its checkpoint store refuses saves: how long it trains on, and where the
state goes when it stops.

Why a bound: a periodic save that fails costs nothing by itself (``latest`` still names the previous
checkpoint), but every step trained after it is held only in memory and every shard it trained is already
acked. An expired credential or a dead endpoint would otherwise let a run train for days into nothing and
fail at its final save. So:

- a save is tried ``SAVE_ATTEMPTS`` times with a pause between (the S3 client already retries each request
  and backs off around each operation: this covers an outage of a few more seconds); a save that still
  fails is one line, its retries counted in it;
- after ``outage_saves`` failed saves in a row, or ``outage_minutes`` since the first of them, whichever
  comes first, the consumer stops taking shards, writes its state to a local folder (``fallback_dir``) and
  exits with one line saying where the state is and that the same command resumes it;
- the same command, once the store takes writes again, resumes from that local state (it is newer than the
  store's ``latest``), uploads it to the store first and removes the local copy.

The bound (docs/reliability.md): steps trained but in no checkpoint at any time are at most
``outage_saves x save_every`` (plus the steps of one save's write); they are lost only if the process dies
during the outage before its stop, and then their samples are in no checkpoint, so the next launch's
producers make them again (none is lost, some compute is).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from dflash.common.checkpoints.store import CheckpointStore, CheckpointStoreError, LocalStore
from dflash.common.cli.exits import one_line

log = logging.getLogger(__name__)

SAVE_ATTEMPTS = 2
RETRY_PAUSE_S = 2.0
T = TypeVar("T")


def with_retries(
    write: Callable[[], T],
    *,
    store: CheckpointStore | None = None,
    attempts: int = SAVE_ATTEMPTS,
    pause_s: float = RETRY_PAUSE_S,
) -> T:
    """``write()``, tried again after ``pause_s`` (doubling) when the store refuses it. The last failure
    raises ``CheckpointStoreError`` with the retries summarised in its one line (these attempts, and the
    operations ``store`` tried again within them): a failed save is one line in the log, not one per
    retry (docs/reliability.md)."""
    before = store.retries if store is not None else 0
    for attempt in range(1, attempts + 1):
        try:
            return write()
        except (CheckpointStoreError, OSError) as err:
            if attempt == attempts:
                raise CheckpointStoreError(f"{one_line(err)} ({_tried(attempts, store, before)})") from None
            log.debug("checkpoint write failed (%s); trying again in %.0f s", one_line(err), pause_s)
            time.sleep(pause_s)
            pause_s *= 2
    raise AssertionError("unreachable")


def _tried(attempts: int, store: CheckpointStore | None, before: int) -> str:
    """``tried 2 times; the store retried 6 operations within them``: what a failed write's line says."""
    text = f"tried {attempts} time{'s' if attempts != 1 else ''}"
    retried = (store.retries - before) if store is not None else 0
    if retried:
        text += f"; the store retried {retried} operation{'s' if retried != 1 else ''} within them"
    return text


@dataclass
class OutagePolicy:
    """Counts failed saves since the last good one and says when training must stop."""

    max_failed_saves: int
    max_minutes: float
    failed: int = 0
    first_failure: float | None = field(default=None)  # monotonic time of the first failed save in a row

    def saved(self) -> None:
        self.failed, self.first_failure = 0, None

    def save_failed(self, now: float | None = None) -> None:
        self.failed += 1
        if self.first_failure is None:
            self.first_failure = time.monotonic() if now is None else now

    def exceeded(self, now: float | None = None) -> str | None:
        """Why training must stop now (None while within the bound)."""
        if self.failed >= self.max_failed_saves:
            return f"{self.failed} checkpoint saves in a row failed (--outage-saves {self.max_failed_saves})"
        if self.first_failure is not None:
            minutes = ((time.monotonic() if now is None else now) - self.first_failure) / 60
            if minutes >= self.max_minutes:
                return (
                    f"no checkpoint saved for {minutes:.1f} min since the first failure "
                    f"(--outage-minutes {self.max_minutes:g})"
                )
        return None


def fallback_store(fallback_dir: str | None, run_dir: str | None) -> LocalStore:
    """The local folder the state goes to when the store refuses it: ``--fallback-dir``, else
    ``<run-dir>/fallback-checkpoint``, else ``./dflash-fallback-checkpoint``."""
    if fallback_dir:
        root = Path(fallback_dir)
    elif run_dir:
        root = Path(run_dir) / "fallback-checkpoint"
    else:
        root = Path("dflash-fallback-checkpoint")
    return LocalStore(root.absolute())


def has_state(store: LocalStore, run: str) -> bool:
    """Whether the fallback folder holds anything of ``run`` (checked before any load: usually nothing)."""
    return Path(store.root, run).is_dir()
