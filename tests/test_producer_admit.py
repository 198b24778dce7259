"""The spool budget's admission of a producer's shards (producer.writers.ShardWriters._admit): driven through
one interleaving that a busy box produced (another writer thread's shard is published between this
thread's budget scan and its read of what is in flight; deterministic: the interleaving is injected), and
the producer said blocked on the budget only while the spool is over it."""

from __future__ import annotations

import threading
import time

from dflash.common.contract.spool import Spool
from dflash.common.target.data import DataConfig
from dflash.producer.config import ProducerConfig, Worker
from dflash.producer.writers import Counters, ShardWriters

BUDGET = 1_000
SHARD = 5_000  # far past the budget, as in the spool-full test


class _RacingSpool:
    """A spool whose byte total is driven by the test. The first budget check returns while the other
    thread's shard (SHARD bytes, in flight) is still too small to count; then, before this thread can
    look at what is in flight, that shard is published: it lands in ready/ and leaves the in-flight
    reservation."""

    def __init__(self, writers: ShardWriters):
        self.writers, self.total, self.checks = writers, 0, 0

    def wait_for_budget(self, budget_bytes, *, should_stop=None, waiting=None):
        self.checks += 1
        if self.checks == 1:  # saw the other shard's tmp dir nearly empty: under budget
            self.publish_other()
            return True
        while self.total > budget_bytes:  # afterwards the spool stays full: only stopping ends the wait
            if should_stop():
                return False
            time.sleep(0.01)
        return True

    def total_bytes(self):
        return self.total

    def publish_other(self):
        with self.writers._inflight_lock:
            self.writers._inflight -= SHARD
        self.total = SHARD


def test_a_shard_published_during_the_budget_check_still_counts(tmp_path):
    Spool(tmp_path / "spool")
    cfg = ProducerConfig(model="unused", data=DataConfig(dataset="unused"))
    worker = Worker(producer_id="p0", spool=str(tmp_path / "spool"), budget_bytes=BUDGET)
    stop = threading.Event()
    writers = ShardWriters(cfg, worker, {}, Counters(), stop)
    writers._inflight = SHARD  # the other writer thread's shard, admitted and being written
    spool = _RacingSpool(writers)

    admitted: list[bool] = []
    t = threading.Thread(target=lambda: admitted.append(writers._admit(spool, SHARD)), daemon=True)
    t.start()
    # a correct admission checks the budget again and keeps waiting (the spool holds a shard past it);
    # the wrong one returns at once, admitted. The deadline only guards against a hang.
    deadline = time.monotonic() + 60
    while spool.checks < 2 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.is_alive() and not admitted, f"admitted {admitted} while the first shard filled the spool"
    stop.set()
    t.join(timeout=60)
    assert admitted == [False] and spool.checks >= 2


class _HeldSpool:
    """A spool holding ``total`` bytes until the test changes it; its budget wait is the real one."""

    wait_for_budget = Spool.wait_for_budget

    def __init__(self, total: int, on_scan=None):
        self.total, self.on_scan = total, on_scan

    def total_bytes(self):
        if self.on_scan is not None:
            self.on_scan()
        return self.total


def test_a_producer_is_blocked_on_the_budget_only_while_the_spool_is_over_it(tmp_path):
    """Under the budget a shard is admitted and the producer never looks blocked (a consumer would pack
    short streams, dflash-plan would discount its time); over it, it is blocked until the spool drains."""
    cfg = ProducerConfig(model="unused", data=DataConfig(dataset="unused"))
    worker = Worker(producer_id="p0", spool=str(tmp_path / "spool"), budget_bytes=BUDGET)
    writers = ShardWriters(cfg, worker, {}, Counters(), threading.Event())
    seen: list[bool] = []
    under = _HeldSpool(0, on_scan=lambda: seen.append(writers.budget_blocked))
    assert writers._admit(under, SHARD)
    assert seen and not any(seen) and not writers.budget_blocked
    writers._inflight = 0  # that shard was written

    full = _HeldSpool(SHARD)
    admitted: list[bool] = []
    t = threading.Thread(target=lambda: admitted.append(writers._admit(full, SHARD)), daemon=True)
    t.start()
    deadline = time.monotonic() + 60  # guards a hang only
    while not writers.budget_blocked and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writers.budget_blocked and t.is_alive() and not admitted
    full.total = 0  # the consumers trained and acked what the spool held
    t.join(timeout=60)
    assert admitted == [True] and not writers.budget_blocked
