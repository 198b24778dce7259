"""Claimed shards -> fixed-size packed context streams for the training step.

A background thread claims shards from the spool and decodes them (zstd decoding releases the GIL and
never touches compiled code), so the training loop only packs samples that are already in memory. FP8
shards stay FP8 here (values and scales: half the bytes to decode, pack and copy); the input pipeline's
copy to the device dequantizes them there. The shard's attributes say its codec: no flag.
Packing is best-fit over a pool of loaded samples (``pool_streams`` streams' worth) into exactly
``context_tokens`` tokens, which keeps step shapes constant and padding low: a pool of one or two streams
left 16 % of the slots empty on real length distributions, eight fill them to ~99 %.

Several packed steps may be in flight at once (the trainer's input pipeline packs step n+1 while step n
runs): ``commit()`` commits the OLDEST packed step, so steps must be committed in the order they were
packed. ``next_packed`` (pipeline thread) and ``commit`` (training loop) may run on different threads.

Delivery accounting: a shard is acked only after every one of its samples was used by a *committed*
optimizer step (``commit``); samples listed in ``skip`` (already trained before a restart) are dropped on
load, so a shard re-delivered after a crash never trains a checkpointed sample twice.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.common.contract.sample_set import SampleSet
from dflash.common.contract.shard import ShardFormatError
from dflash.common.contract.shard_reader import read_shard, read_shard_meta
from dflash.common.contract.spool import Spool
from dflash.common.drafter.batch import PackedSamples, pack_samples
from dflash.consumer.config import FeedConfig
from dflash.consumer.data_clock import FEED_STAGES, PIPELINE_STAGES, StageClock
from dflash.consumer.heartbeat import ConsumerHeartbeat, dead_producers_phrase
from dflash.consumer.input_pipeline import put_until_stopped
from dflash.consumer.packing import Sample, best_fit, lowest_epoch

log = logging.getLogger(__name__)


@dataclass
class _ShardLedger:
    outstanding: int  # samples of this shard not yet in a committed step
    path: Path


@dataclass
class FeedCounters:
    shards_claimed: int = 0
    shards_acked: int = 0
    shards_quarantined: int = 0
    samples_quarantined: int = 0  # samples of quarantined shards (when their metadata still says how many)
    samples_duplicate: int = 0  # copies of a sample this feed already holds or trained, refused
    samples_loaded: int = 0
    samples_skipped: int = 0
    samples_truncated: int = 0
    tokens_packed: int = 0
    slots_packed: int = 0


_END = object()
WAITING_LOG_S = 30.0  # an empty spool: one "waiting for producers" line this often


class ShardFeed:
    """Claims shards for one consumer and packs them into fixed-shape streams (defaults: FeedConfig's)."""

    def __init__(
        self,
        spool: Spool,
        consumer_id: str,
        *,
        context_tokens: int,
        skip: SampleSet | None = None,
        bucket: int | str | None = None,
        prefetch_shards: int = 2,
        pool_streams: int = FeedConfig.pool_streams,
        min_split_tokens: int | None = FeedConfig.min_split_tokens,
        fill_wait_s: float = FeedConfig.fill_wait_s,
        pin_memory: bool = False,
        poll_s: float = 0.05,
        heartbeat_timeout_s: float = FeedConfig.heartbeat_timeout_s,
        expected_layer_ids: list[int] | None = None,
        heartbeat: ConsumerHeartbeat | None = None,
        clock: StageClock | None = None,
        packing_clock: StageClock | None = None,
    ) -> None:
        self.clock = clock or StageClock(FEED_STAGES)
        """The decode thread's time by stage (claim, decode, empty spool, handoff): the training loop
        charges its waits to them (consumer/data_clock.py)."""
        self.packing_clock = packing_clock or StageClock(PIPELINE_STAGES)
        """The clock of the thread calling ``next_packed``: its time blocked on decoded shards counts as
        its ``wait_shards``."""
        self.expected_layer_ids = expected_layer_ids
        self.spool = spool
        self.consumer_id = consumer_id
        self.context_tokens = context_tokens
        self.skip = skip
        self._seen = SampleSet(epoch=skip.epoch if skip is not None else 0)
        """Samples this feed accepted in this life (held in the pool, in a step, or trained): a second copy
        (a leftover shard and its re-produced twin) is refused. Only the decode thread touches it."""
        self.bucket = bucket
        self.poll_s = poll_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.counters = FeedCounters()
        self.pool_tokens_target = max(2, pool_streams) * context_tokens
        self.pin_memory = pin_memory
        self.min_split_tokens = min_split_tokens
        self.fill_wait_s = fill_wait_s
        self._starved_since: float | None = None
        self._owns_heartbeat = heartbeat is None
        self.heartbeat = heartbeat or ConsumerHeartbeat(spool, consumer_id, timeout_s=heartbeat_timeout_s)
        """This consumer's heartbeat: the feed's counters go into its beats, and it says whether a producer
        still produces (the trainer hands its own; a feed alone keeps one of its own)."""
        self.heartbeat.add_source(self.heartbeat_counters)
        self._pool: list[Sample] = []
        self._pool_tokens = 0
        self._ledger: dict[str, _ShardLedger] = {}
        self._in_flight: deque[list[Sample]] = deque()  # packed steps not yet committed, oldest first
        self._loaded: queue.Queue = queue.Queue(maxsize=prefetch_shards)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._end_seen = False
        self._lock = threading.Lock()
        self._start_threads()

    def _start_threads(self) -> None:
        """The shard-deletion thread, then the decode thread."""
        name = self.consumer_id
        self._thread = threading.Thread(target=self._prefetch_loop, name=f"feed-{name}", daemon=True)
        self._trash: queue.SimpleQueue = queue.SimpleQueue()
        self._trash_thread = threading.Thread(target=self._trash_loop, name=f"trash-{name}", daemon=True)
        self._trash_thread.start()
        self._thread.start()

    @property
    def producers_producing(self) -> int:
        """Live producers not done and not blocked on the spool budget, as the heartbeat's last scan saw
        them: while one is, a stream short of samples waits for more (``next_packed``)."""
        return self.heartbeat.producers_producing

    def _trash_loop(self) -> None:
        while (trash := self._trash.get()) is not None:
            try:
                self.spool.remove_trash(trash)
            except OSError as err:
                log.warning("could not remove acked shard %s: %s", trash.name, err)

    def heartbeat_counters(self) -> dict:
        """What this feed lost or refused, for every heartbeat (dflash-status shows quarantine losses)."""
        c = self.counters
        return {
            "shards_quarantined": c.shards_quarantined,
            "samples_quarantined": c.samples_quarantined,
            "samples_duplicate": c.samples_duplicate,
        }

    # ---------------------------------------------------------------- background: claim + decode
    def _prefetch_loop(self) -> None:
        last_recover = 0.0
        idle_since: float | None = None  # when claims started coming back empty
        last_wait_log = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                with self.clock.stage("claim"):
                    if now - last_recover > min(5.0, self.heartbeat_timeout_s / 4):
                        self.spool.recover_dead_claims(heartbeat_timeout_s=self.heartbeat_timeout_s)
                        last_recover = now
                    path = self.spool.claim(self.consumer_id, bucket=self.bucket)
                if path is None:
                    with self.clock.stage("spool_empty"):
                        # Our own claims are in the pool already, so "drained" here ignores claimed/.
                        if self.spool.producers_done() and self._nothing_claimable():
                            put_until_stopped(self._loaded, _END, self._stop)
                            return
                        idle_since = idle_since or now
                        if now - idle_since >= WAITING_LOG_S and now - last_wait_log >= WAITING_LOG_S:
                            self._log_waiting(now - idle_since)
                            last_wait_log = now
                        time.sleep(self.poll_s)
                    continue
                idle_since = None
                self.counters.shards_claimed += 1
                with self.clock.stage("decode"):
                    samples = self._decode(path)
                if samples is not None:
                    with self.clock.stage("handoff"):
                        put_until_stopped(self._loaded, (path, samples), self._stop)
        except BaseException as err:  # surfaced to the training loop by next_packed
            self._error = err
            put_until_stopped(self._loaded, _END, self._stop)

    def _log_waiting(self, idle_s: float) -> None:
        registered = self.spool.registered_producers()
        if not registered:
            log.info(
                "waiting for producers (%.0f s without a shard): none has registered on this spool yet",
                idle_s,
            )
            return
        done = len(set(self.spool.done_producers()) & set(registered))
        dead = dead_producers_phrase(self.spool, timeout_s=self.heartbeat_timeout_s)
        (log.warning if dead else log.info)(
            "waiting for producers (%.0f s without a shard): %d of %d registered producers done%s",
            idle_s,
            done,
            len(registered),
            dead,
        )

    def _nothing_claimable(self) -> bool:
        return not any(self.spool.ready_dir.iterdir()) and not any(self.spool.tmp_dir.iterdir())

    def _decode(self, path: Path) -> list[Sample] | None:
        try:
            shard = read_shard(path)
        except FileNotFoundError:
            # Another consumer took the claim back (we looked dead to it): it is theirs to train now.
            log.warning("claimed shard %s vanished before decoding; skipping it", path.name)
            return None
        except ShardFormatError as err:
            try:  # the attributes often survive a corrupt array: say how many samples are lost
                n = int(read_shard_meta(path).get("num_samples", 0))
            except (ShardFormatError, OSError, ValueError, TypeError):
                n = 0
            if self.spool.quarantine(path, str(err), say=False) == path:
                return None  # taken back meanwhile (we looked dead): the spool's warning said so
            # one line per shard: what was lost and why (the spool's own line would repeat it)
            log.error("quarantining %s (%s samples lost to this launch): %s", path.name, n or "unknown", err)
            self.counters.shards_quarantined += 1
            self.counters.samples_quarantined += n
            return None
        if self.expected_layer_ids is not None and list(shard.meta.layer_ids) != self.expected_layer_ids:
            self.spool.release(path)
            raise ValueError(
                f"shard {path.name} holds target layers {list(shard.meta.layer_ids)} but the drafter was built "
                f"for {self.expected_layer_ids}: start dflash-consume with the producers' layer ids"
            )
        cu = shard.cu_seqlens.tolist()
        samples: list[Sample] = []
        skipped = duplicate = 0
        accepted: set[int] = set()
        for i, idx in enumerate(shard.sample_index.tolist()):
            if self.skip is not None and idx in self.skip:
                skipped += 1
                continue
            if idx in self._seen or idx in accepted:  # a copy of a sample held or trained in this life
                duplicate += 1
                continue
            accepted.add(idx)
            a, b = cu[i], cu[i + 1]
            if b - a > self.context_tokens:
                b = a + self.context_tokens
                self.counters.samples_truncated += 1
            samples.append(
                Sample(
                    input_ids=shard.input_ids[a:b].to(torch.int64),
                    loss_mask=shard.loss_mask[a:b].to(torch.bool),
                    hidden=shard.hidden[a:b],
                    sample_index=int(idx),
                    shard=path,
                    epoch=shard.meta.epoch,
                    hidden_scales=None if shard.hidden_scales is None else shard.hidden_scales[a:b],
                )
            )
        self.counters.samples_skipped += skipped
        self._seen.add(sorted(accepted))
        self.counters.samples_duplicate += duplicate
        if duplicate:
            log.warning("%s: refused %d samples this consumer already holds or trained", path.name, duplicate)
        self.counters.samples_loaded += len(samples)
        return samples

    # ---------------------------------------------------------------- foreground: pack / commit
    def _drain_loaded(self, block_s: float) -> bool:
        """Move decoded shards into the pool; return False once the source is exhausted and empty."""
        if self._end_seen:
            return False
        deadline = time.monotonic() + block_s
        alive = True
        while True:
            timeout = max(0.0, deadline - time.monotonic())
            try:
                with self.packing_clock.stage("wait_shards"):
                    item = self._loaded.get(timeout=timeout) if timeout > 0 else self._loaded.get_nowait()
            except queue.Empty:
                return alive
            if item is _END:
                if self._error is not None:
                    raise RuntimeError(f"shard feed failed: {self._error}") from self._error
                self._end_seen = True
                return False
            path, samples = item
            if not samples:
                self.spool.ack(path)  # every sample was already trained before the restart
                self.counters.shards_acked += 1
                continue
            with self._lock:
                self._ledger[path.name] = _ShardLedger(outstanding=len(samples), path=path)
            self._pool.extend(samples)
            self._pool_tokens += sum(s.num_tokens for s in samples)
            if self._pool_tokens >= self.pool_tokens_target:
                return alive

    def next_packed(self, *, wait_s: float = 1.0) -> PackedSamples | None:
        """Pack the next context stream; None when no sample arrived within ``wait_s``.

        Call ``commit()`` after the optimizer step that used the returned samples (steps packed earlier
        first). Only one thread may call this.
        """
        if self._pool_tokens < self.pool_tokens_target:
            self._drain_loaded(wait_s)
        if not self._pool:
            return None
        # A stream is packed from a full pool (``pool_streams`` streams' worth: best-fit needs the choice
        # to fill a stream to the last slot), from the run's last samples, at an epoch's end (a stream
        # holds one epoch: once a later epoch's samples arrive, the earlier one is complete here), when no
        # producer can give more soon (each is done, gone, or blocked on the spool budget, which the
        # samples held here count against: waiting would deadlock), or after ``fill_wait_s`` (a safety
        # net for a stale view of the producers). Waiting while producers produce costs no throughput
        # (the consumer is ahead of them); a stream packed short, or from a pool with little choice, costs
        # a full step for part of one: packing whatever had come after 2 s made 5 % of a real one-GPU run's
        # slots padding (RESULTS.md; ops/bench/fill_sim.py reproduces it).
        epoch = lowest_epoch(self._pool)
        epoch_ends = any(s.epoch != epoch for s in self._pool)
        if self._pool_tokens < self.pool_tokens_target and not self._end_seen and not epoch_ends:
            now = time.monotonic()
            self._starved_since = self._starved_since or now
            if self.producers_producing and now - self._starved_since < self.fill_wait_s:
                return None
        self._starved_since = None
        chosen = self._best_fit()
        with self._lock:
            self._in_flight.append(chosen)
        tokens = sum(s.num_tokens for s in chosen)
        self._pool_tokens -= tokens
        self.counters.tokens_packed += tokens
        self.counters.slots_packed += self.context_tokens
        samples = [(s.input_ids, s.loss_mask, s.hidden, s.sample_index) for s in chosen]
        scales = [s.hidden_scales for s in chosen]
        return pack_samples(
            samples,
            context_tokens=self.context_tokens,
            pin_memory=self.pin_memory,
            position_offsets=[s.start for s in chosen],
            epoch=epoch,
            hidden_scales=scales if any(sc is not None for sc in scales) else None,
        )

    def _best_fit(self) -> list[Sample]:
        """The pool's next stream (consumer/packing.py: ``best_fit``); the rest stays in the pool."""
        chosen, self._pool = best_fit(self._pool, self.context_tokens, self.min_split_tokens)
        return chosen

    def commit(self) -> list[int]:
        """Mark the oldest packed step as trained: ack finished shards, return its sample indices."""
        with self._lock:
            if not self._in_flight:
                raise RuntimeError("commit() without a packed step in flight")
            step = self._in_flight.popleft()
            finished = []
            for s in step:
                if not s.last_piece:
                    continue
                ledger = self._ledger[s.shard.name]
                ledger.outstanding -= 1
                if ledger.outstanding == 0:
                    finished.append(ledger.path)
                    del self._ledger[s.shard.name]
        for path in finished:
            trash = self.spool.ack(path, delete=False)  # acked here; the pages are freed in the background
            if trash is not None:
                self._trash.put(trash)
            self.counters.shards_acked += 1
        return [s.sample_index for s in step if s.last_piece]

    @property
    def in_flight(self) -> int:
        """Packed steps not yet committed."""
        return len(self._in_flight)

    def exhausted(self) -> bool:
        """True when the spool is drained and every loaded sample was packed."""
        return self._end_seen and not self._pool

    def close(self) -> None:
        """Stop the decode and deletion threads; a heartbeat of the feed's own says its last word."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._trash.put(None)
        self._trash_thread.join(timeout=30.0)
        if self._owns_heartbeat:
            self.heartbeat.close()
