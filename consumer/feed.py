"""Claimed shards -> fixed-size packed context streams for the training step.

A background thread claims shards from the spool and decodes them (zstd decoding releases the GIL and
never touches compiled code), so the training loop only packs samples that are already in memory.
Packing is best-fit over a pool of loaded samples into exactly ``context_tokens`` tokens, which keeps
step shapes constant and padding low.

Delivery accounting: a shard is acked only after every one of its samples was used by a *committed*
optimizer step (``commit``); samples listed in ``skip`` (already trained before a restart) are dropped on
load, so a shard re-delivered after a crash never trains a checkpointed sample twice.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.common.sample_set import SampleSet
from dflash.common.shard import ShardFormatError, read_shard
from dflash.common.spool import Spool
from dflash.consumer.batching import PackedSamples, pack_samples

log = logging.getLogger(__name__)


@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [L]
    loss_mask: torch.Tensor  # bool [L]
    hidden: torch.Tensor  # bf16 [L, K*H]
    sample_index: int
    shard: Path

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class _ShardLedger:
    outstanding: int  # samples of this shard not yet in a committed step
    path: Path


@dataclass
class FeedCounters:
    shards_claimed: int = 0
    shards_acked: int = 0
    shards_quarantined: int = 0
    samples_loaded: int = 0
    samples_skipped: int = 0
    samples_truncated: int = 0
    tokens_packed: int = 0
    slots_packed: int = 0


_END = object()


class ShardFeed:
    """Claims shards for one consumer and packs their samples into fixed-shape context streams."""

    def __init__(
        self,
        spool: Spool,
        consumer_id: str,
        *,
        context_tokens: int,
        skip: SampleSet | None = None,
        bucket: int | str | None = None,
        prefetch_shards: int = 2,
        poll_s: float = 0.05,
        heartbeat_timeout_s: float = 60.0,
        expected_layer_ids: list[int] | None = None,
    ) -> None:
        self.expected_layer_ids = expected_layer_ids
        self.spool = spool
        self.consumer_id = consumer_id
        self.context_tokens = context_tokens
        self.skip = skip
        self.bucket = bucket
        self.poll_s = poll_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.counters = FeedCounters()
        self._pool: list[Sample] = []
        self._ledger: dict[str, _ShardLedger] = {}
        self._in_step: list[Sample] = []  # samples packed into the step not yet committed
        self._loaded: queue.Queue = queue.Queue(maxsize=prefetch_shards)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._end_seen = False
        self._lock = threading.Lock()
        self.heartbeat_counters: dict = {}
        """Counters the trainer updates; written to the spool's state/ by a heartbeat thread, so a long
        first compile never makes this consumer look dead to the others (they would take its claims)."""
        self._heartbeat_every_s = max(0.5, min(5.0, heartbeat_timeout_s / 4))
        self._thread = threading.Thread(target=self._prefetch_loop, name=f"feed-{consumer_id}", daemon=True)
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name=f"hb-{consumer_id}", daemon=True)
        self.spool.heartbeat("consumer", self.consumer_id, dict(self.heartbeat_counters))
        self._hb_thread.start()
        self._thread.start()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._heartbeat_every_s):
            try:
                self.spool.heartbeat("consumer", self.consumer_id, dict(self.heartbeat_counters))
            except OSError as err:  # a full or vanished spool must not kill training
                log.warning("heartbeat failed: %s", err)

    # ---------------------------------------------------------------- background: claim + decode
    def _prefetch_loop(self) -> None:
        last_recover = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now - last_recover > min(5.0, self.heartbeat_timeout_s / 4):
                    self.spool.recover_dead_claims(heartbeat_timeout_s=self.heartbeat_timeout_s)
                    last_recover = now
                path = self.spool.claim(self.consumer_id, bucket=self.bucket)
                if path is None:
                    # Our own claims are in the pool already, so "drained" here ignores claimed/.
                    if self.spool.producers_done() and self._nothing_claimable():
                        self._put(_END)
                        return
                    time.sleep(self.poll_s)
                    continue
                self.counters.shards_claimed += 1
                samples = self._decode(path)
                if samples is not None:
                    self._put((path, samples))
        except BaseException as err:  # surfaced to the training loop by next_packed
            self._error = err
            self._put(_END)

    def _nothing_claimable(self) -> bool:
        return not any(self.spool.ready_dir.iterdir()) and not any(self.spool.tmp_dir.iterdir())

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._loaded.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _decode(self, path: Path) -> list[Sample] | None:
        try:
            shard = read_shard(path)
        except FileNotFoundError:
            # Another consumer took the claim back (we looked dead to it): it is theirs to train now.
            log.warning("claimed shard %s vanished before decoding; skipping it", path.name)
            return None
        except ShardFormatError as err:
            log.error("quarantining %s: %s", path.name, err)
            self.spool.quarantine(path, str(err))
            self.counters.shards_quarantined += 1
            return None
        if self.expected_layer_ids is not None and list(shard.meta.layer_ids) != self.expected_layer_ids:
            self.spool.release(path)
            raise ValueError(
                f"shard {path.name} holds target layers {list(shard.meta.layer_ids)} but the drafter was built "
                f"for {self.expected_layer_ids}: start dflash-consume with the producers' layer ids"
            )
        cu = shard.cu_seqlens.tolist()
        samples: list[Sample] = []
        skipped = 0
        for i, idx in enumerate(shard.sample_index.tolist()):
            if self.skip is not None and idx in self.skip:
                skipped += 1
                continue
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
                )
            )
        self.counters.samples_skipped += skipped
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
            self._ledger[path.name] = _ShardLedger(outstanding=len(samples), path=path)
            self._pool.extend(samples)
            if sum(s.num_tokens for s in self._pool) >= 2 * self.context_tokens:
                return alive

    def next_packed(self, *, wait_s: float = 1.0) -> PackedSamples | None:
        """Pack the next context stream; None when no sample arrived within ``wait_s``.

        Call ``commit()`` after the optimizer step that used the returned samples.
        """
        assert not self._in_step, "commit() the previous step before packing the next"
        pool_tokens = sum(s.num_tokens for s in self._pool)
        if pool_tokens < 2 * self.context_tokens:
            self._drain_loaded(wait_s if not self._pool else 0.0)
        if not self._pool:
            return None
        chosen = self._best_fit()
        self._in_step = chosen
        self.counters.tokens_packed += sum(s.num_tokens for s in chosen)
        self.counters.slots_packed += self.context_tokens
        return pack_samples(
            [(s.input_ids, s.loss_mask, s.hidden, s.sample_index) for s in chosen],
            context_tokens=self.context_tokens,
        )

    def _best_fit(self) -> list[Sample]:
        """Greedy first-fit-decreasing into one stream; the oldest sample always goes first (no starvation)."""
        room = self.context_tokens
        chosen = [self._pool.pop(0)]
        room -= chosen[0].num_tokens
        for s in sorted(self._pool, key=lambda s: -s.num_tokens):
            if s.num_tokens <= room:
                chosen.append(s)
                room -= s.num_tokens
        picked = {id(s) for s in chosen}
        self._pool = [s for s in self._pool if id(s) not in picked]
        return chosen

    def commit(self) -> list[int]:
        """Mark the packed step as trained: ack finished shards, return the trained sample indices."""
        trained = [s.sample_index for s in self._in_step]
        for s in self._in_step:
            ledger = self._ledger[s.shard.name]
            ledger.outstanding -= 1
            if ledger.outstanding == 0:
                self.spool.ack(ledger.path)
                self.counters.shards_acked += 1
                del self._ledger[s.shard.name]
        self._in_step = []
        return trained

    def exhausted(self) -> bool:
        """True when the spool is drained and every loaded sample was packed."""
        return self._end_seen and not self._pool

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._hb_thread.join(timeout=5.0)
