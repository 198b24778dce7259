"""The data path in its own process: claims, decode, pack, anchors/labels, acks and shard deletion.

Why a process: on a GPU, py-spy showed the in-process data path (zarr decode threads, ``pack_samples``,
``sample_anchors``, the trash thread's rmtree; ~27 ms of CPU work per ~140 ms step) sharing the GIL with
the thread that launches the step's kernels, so the launches waited on it. Here a spawned worker process
(``spawn``: a CUDA process must never fork) owns the ``ShardFeed`` (its claim/decode, heartbeat and trash
threads) and builds each step's ``DraftBatch`` on the CPU with a generator seeded exactly as the trainer's
(``seed * 1000 + rank``), so the batches are exactly those of the in-process path. The training process
keeps the kernels, the host->device copy and its bookkeeping (trained set, ledger, checkpoints).

How a step travels: the trainer allocates a small ring of shared-memory CPU slots (every step has the same
shapes, so each slot is one fixed set of tensors) and passes them at spawn; the worker writes a finished
batch into a free slot and sends a small message over a pipe (slot id, tokens, weight, epoch, sample
indices, the samples the step completes, the feed's counters). The trainer copies the slot to the device on
a side stream (CUDA: the slots are page-locked with ``cudaHostRegister``, so the copy is a true DMA) and
gives the slot back only once the copy's event has completed. After each optimizer step the trainer sends
"commit": the worker calls ``feed.commit()`` (acks finished shards) and adds the step's samples to its copy
of the trained set (the duplicate filter). Pipes, not ``mp.Queue``: a queue is a named POSIX semaphore in
/dev/shm, leaked when the launch is SIGKILLed with its process group (producer/supervisor.py says the same).

Death: a worker killed (signal, OOM) is noticed by ``get()`` at once (its pipe closes) or within the poll
(``is_alive``). It claims under the trainer's consumer id, so the trainer returns exactly its claims to
the spool at once (``Spool.return_claims``, no 60 s heartbeat timeout), drops the steps it had not handed
out, and starts a new worker whose skip set is the trained set: nothing trained is trained again, nothing
is lost. After ``max_restarts`` restarts it stops with one line. An exception inside the worker is sent
back as its text and raised at once (it is the data's or the code's: a restart would meet it again).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass

import torch

from dflash.common.child_process import anonymous_library_locks, die_with_parent
from dflash.common.cli.exits import one_line
from dflash.common.contract.sample_set import SampleSet
from dflash.common.contract.spool import Spool
from dflash.common.drafter.batch import DraftBatch, build_draft_batch, empty_packed
from dflash.consumer.input_pipeline import StepInput

# Not imported here: the feed (zarr, numcodecs). A spawned child imports this module before its body runs,
# and numcodecs' blosc makes a multiprocessing lock (a named semaphore under spawn) when first used (today at
# the first decode, not at import): nothing of it may come before anonymous_library_locks().

log = logging.getLogger(__name__)

MAX_RESTARTS = 3


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker needs to rebuild the trainer's data path (picklable: it crosses the spawn)."""

    spool: str
    consumer_id: str  # the trainer's: its claims are the trainer's to return when the worker dies
    feed: dict  # ShardFeed keyword arguments (context_tokens, bucket, pool_streams, ...)
    batch: dict  # build_draft_batch keyword arguments (block_size, num_anchors, ...)
    seed: int  # the anchor generator's seed: the trainer's cfg.seed * 1000 + rank
    hidden_width: int  # K * H of the packed stream
    log_level: int = logging.INFO
    log_prefix: str = "consumer[0] data"
    poll_s: float = 0.2


def slot_layout(spec: WorkerSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor of a step's DraftBatch: the same for every step (fixed shapes)."""
    packed = empty_packed(spec.feed["context_tokens"], spec.hidden_width)
    batch = build_draft_batch(packed, generator=torch.Generator().manual_seed(0), **spec.batch)
    return {
        f.name: (tuple(getattr(batch, f.name).shape), getattr(batch, f.name).dtype)
        for f in dataclasses.fields(DraftBatch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }


# ------------------------------------------------------------------------------------ the worker process
def _send(conn, msg) -> bool:
    try:
        conn.send(msg)
        return True
    except (BrokenPipeError, OSError):  # the trainer is gone: nobody to tell
        return False


def _counters(feed) -> dict:
    return dataclasses.asdict(feed.counters) if feed is not None else {}


def worker_main(spec: WorkerSpec, skip_bytes: bytes, slots: list[dict[str, torch.Tensor]], conn, parent_pid: int) -> None:  # fmt: skip
    """The spawned process's body: serve steps until "stop", the trainer's end, or an error (sent back)."""
    die_with_parent(parent_pid)  # a trainer killed with SIGKILL takes its worker along
    anonymous_library_locks()
    # One intra-op thread: the work here is copies and small index ops, and two processes each running a
    # full OpenMP pool on the same cores spin against each other (measured on a 2-core CPU: 4,981 ms a
    # step against 666 ms in-process with torch's default threads here; zarr's decode keeps its own pool).
    torch.set_num_threads(1)
    # Ctrl-C reaches the whole process group: the trainer finishes its step, saves, then says "stop"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level, format=f"%(asctime)s {spec.log_prefix} %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    feed = None
    try:
        from dflash.consumer.feed import ShardFeed  # after anonymous_library_locks (see the imports above)

        skip = SampleSet.from_bytes(skip_bytes)
        feed = ShardFeed(Spool(spec.spool, create=False), spec.consumer_id, skip=skip, **spec.feed)
        _serve(feed, skip, spec, slots, conn)
    except BaseException as err:  # noqa: BLE001 - its text goes back to the trainer, which raises it
        log.debug("data worker failed", exc_info=True)
        text = one_line(err) if isinstance(err, RuntimeError) else f"{type(err).__name__}: {one_line(err)}"
        _send(conn, ("error", text))
    finally:
        if feed is not None:
            try:
                feed.close()
            except Exception as err:  # noqa: BLE001 - the trainer is told below; the exit code says the rest
                log.warning("closing the shard feed failed: %s", one_line(err))
        _send(conn, ("bye", _counters(feed), dict(feed.spool_summary) if feed is not None else {}))
        conn.close()


def _serve(feed, skip: SampleSet, spec: WorkerSpec, slots: list[dict[str, torch.Tensor]], conn) -> None:  # fmt: skip
    generator = torch.Generator().manual_seed(spec.seed)
    free = deque(range(len(slots)))
    ended = False
    while True:
        wait = 0.0 if free and not ended else spec.poll_s  # messages first; block only with nothing to build
        try:
            while conn.poll(wait):
                msg = conn.recv()
                if msg[0] == "stop":
                    return
                if msg[0] == "free":
                    free.append(msg[1])
                elif msg[0] == "commit":
                    skip.add(feed.commit())  # acks finished shards; the live duplicate filter grows
                    if msg[1]:
                        feed.heartbeat_counters.update(msg[1])
                elif msg[0] == "skip":  # the other ranks' trained samples (merged at a save)
                    skip.update(SampleSet.from_bytes(msg[1]))
                wait = 0.0
        except (EOFError, OSError):  # the trainer closed its end
            return
        if not free or ended:
            continue
        packed = feed.next_packed(wait_s=spec.poll_s)
        if packed is None:
            if feed.exhausted():
                _send(conn, ("end", _counters(feed), dict(feed.spool_summary)))
                ended = True
            continue
        completes = feed.newest_completions()
        batch = build_draft_batch(packed, generator=generator, **spec.batch)
        slot = free.popleft()
        for name, t in slots[slot].items():
            t.copy_(getattr(batch, name))
        meta = {
            "sample_index": list(batch.sample_index),
            "epoch": batch.epoch,
            "tokens": int((batch.doc_ids >= 0).sum()),
            "weight": float(batch.label_weights.sum(dtype=torch.float64)),
            "completes": completes,
        }
        _send(conn, ("step", slot, meta, _counters(feed), dict(feed.spool_summary)))


# ----------------------------------------------------------------------------------- the trainer's side
def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def _check_shm(nbytes: int, root: str = "/dev/shm") -> None:
    """Refuse at start-up, in one line, slots that /dev/shm cannot hold: its pages are allocated on first
    write, so a full /dev/shm would otherwise be a SIGBUS mid-run (a container's default is 64 MB)."""
    try:
        st = os.statvfs(root)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise RuntimeError(
            f"the data worker's input slots need {nbytes / 2**20:.0f} MiB of {root}, {free / 2**20:.0f} MiB "
            "free: give it more (docker --shm-size) or use --data-workers 0"
        )


class DataWorker:
    """The trainer's handle on its data worker: the interface of ``ShardFeed`` + ``InputPipeline`` that the
    training loop uses (``get``, ``commit``, ``exhausted``, ``close``, ``counters``, ``spool_summary``,
    ``heartbeat_counters``), over a worker process it restarts when it dies."""

    def __init__(
        self,
        spec: WorkerSpec,
        trained: SampleSet,
        *,
        device: torch.device,
        hidden_dtype: torch.dtype,
        slots: int = 3,
        max_restarts: int = MAX_RESTARTS,
    ) -> None:
        self.spec = spec
        self._trained = trained  # the trainer's live set: a restarted worker skips what it holds
        self.device = device
        self.hidden_dtype = hidden_dtype
        self.max_restarts = max_restarts
        self.restarts = 0
        from dflash.consumer.feed import FeedCounters  # the trainer imported it already

        self._counters_type = FeedCounters
        self.counters = FeedCounters()
        self.spool_summary: dict = {}
        self.heartbeat_counters: dict = {}  # the trainer's numbers for the worker's heartbeat (sent on commit)
        self._sent_hb: dict = {}
        self._spool = Spool(spec.spool, create=False)
        self._ctx = torch.multiprocessing.get_context("spawn")
        layout = slot_layout(spec)
        _check_shm(slots * sum(_nbytes(shape, dtype) for shape, dtype in layout.values()))
        self._slots = [
            {name: torch.empty(shape, dtype=dtype).share_memory_() for name, (shape, dtype) in layout.items()}
            for _ in range(slots)
        ]
        self._registered: list[int] = []
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self._copy_stream is not None:
            self._pin_slots()
        self._copying: deque[tuple[torch.cuda.Event, int]] = deque()  # slots whose device copy may still run
        self._handed: deque[list[int]] = deque()  # completions of steps handed out, not yet committed
        self._ended = False
        self._closed = False
        self._proc = None
        self._conn = None
        # A trainer that exits without close() (an error in its own start-up after this): the worker
        # ignores SIGTERM (multiprocessing's exit handler would terminate, then join it forever), so it is
        # killed here first (atexit runs this before multiprocessing's handler, registered earlier).
        atexit.register(self._kill_at_exit)
        self._start()

    def _pin_slots(self) -> None:
        """Page-lock the shared slots (once: they live as long as this object), so the host->device copy
        is an asynchronous DMA; unregistered memory still copies correctly, only synchronously."""
        cudart = torch.cuda.cudart()
        for slot in self._slots:
            for t in slot.values():
                nbytes = t.untyped_storage().nbytes()
                if nbytes and int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)) == 0:
                    self._registered.append(t.data_ptr())
                elif nbytes:
                    log.warning("could not page-lock a shared input slot: its host->device copies are synchronous")

    def _start(self) -> None:
        mine, theirs = self._ctx.Pipe(duplex=True)
        self._proc = self._ctx.Process(
            target=worker_main,
            args=(self.spec, self._trained.to_bytes(), self._slots, theirs, os.getpid()),
            name="data-worker",
            daemon=True,  # multiprocessing's exit handler ends it if the trainer exits without close()
        )
        t0 = time.monotonic()
        self._proc.start()
        theirs.close()  # only the worker holds its end: its death closes the pipe (EOF here)
        self._conn = mine
        self._sent_hb = {}  # a new worker has none of the trainer's heartbeat numbers yet
        log.debug("data worker pid %d spawned in %.2f s", self._proc.pid, time.monotonic() - t0)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ------------------------------------------------------------------ the training loop's interface
    def get(self, timeout: float) -> StepInput | None:
        """The next step's inputs on the device, or None if none came within ``timeout`` (check
        ``exhausted()``). Restarts a dead worker; raises what the worker raised."""
        if self._ended:
            return None
        self._release_copied()
        try:
            if not self._conn.poll(timeout):
                if not self._proc.is_alive():
                    self._on_death()
                return None
            msg = self._conn.recv()
        except (EOFError, OSError):
            self._on_death()
            return None
        kind = msg[0]
        if kind == "step":
            _, slot, meta, counters, summary = msg
            self._refresh(counters, summary)
            return self._stage(slot, meta)
        if kind == "end":
            self._refresh(msg[1], msg[2])
            self._ended = True
            return None
        if kind == "bye":  # it stopped without "end" or "error": its EOF comes next, and a restart
            self._refresh(msg[1], msg[2])
            return None
        if kind == "error":
            self._ended = True
            raise RuntimeError(f"data worker failed: {msg[1]}")
        raise RuntimeError(f"data worker sent an unknown message {kind!r}")

    def commit(self) -> list[int]:
        """The oldest handed-out step was trained: tell the worker (it acks finished shards) and return the
        sample indices the step completes (sent with the step: no round trip)."""
        if not self._handed:
            raise RuntimeError("commit() without a step in flight")
        hb = None
        if self.heartbeat_counters != self._sent_hb:
            hb = self._sent_hb = dict(self.heartbeat_counters)
        _send(self._conn, ("commit", hb))  # a dead worker: its claims go back on the next get()
        return self._handed.popleft()

    def update_skip(self, trained: SampleSet) -> None:
        """Add ``trained`` to the worker's skip set: what the in-process feed sees by reading the trainer's
        live set, which a save grows with the other ranks' samples."""
        _send(self._conn, ("skip", trained.to_bytes()))

    def exhausted(self) -> bool:
        """True once the worker said the spool is drained and every step it built was handed out."""
        return self._ended

    def close(self) -> None:
        """Stop the worker (it closes its feed: last acks, the trash, a final heartbeat), read its last
        counters, and free the slots. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._kill_at_exit)
        _send(self._conn, ("stop",))
        deadline = time.monotonic() + 60.0  # the feed's close waits up to 30 s for its trash thread
        try:
            while time.monotonic() < deadline and self._conn.poll(max(0.0, deadline - time.monotonic())):
                msg = self._conn.recv()
                if msg[0] in ("step", "end", "bye"):
                    self._refresh(msg[-2], msg[-1])
        except (EOFError, OSError):
            pass
        self._proc.join(timeout=max(1.0, deadline - time.monotonic()))
        if self._proc.is_alive():
            log.warning("data worker pid %d did not stop: killing it", self._proc.pid)
            self._proc.kill()
            self._proc.join(timeout=10.0)
        self._conn.close()
        for event, _ in self._copying:
            event.synchronize()
        self._copying.clear()
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered.clear()

    # ------------------------------------------------------------------ internals
    def _kill_at_exit(self) -> None:
        if not self._closed and self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10.0)

    def _refresh(self, counters: dict, summary: dict) -> None:
        if counters:
            self.counters = self._counters_type(**counters)
        if summary:
            self.spool_summary = summary

    def _stage(self, slot: int, meta: dict) -> StepInput:
        tensors = self._slots[slot]
        extra = {"sample_index": meta["sample_index"], "epoch": meta["epoch"]}
        if self._copy_stream is None:  # CPU: a private copy, and the slot is free at once
            moved = DraftBatch(
                **{k: v.clone() for k, v in tensors.items() if k != "hidden"},
                hidden=tensors["hidden"].to(self.hidden_dtype, copy=True),
                **extra,
            )
            _send(self._conn, ("free", slot))
            ready = None
        else:
            with torch.cuda.stream(self._copy_stream):
                moved = DraftBatch(**tensors, **extra).to(self.device, non_blocking=True, hidden_dtype=self.hidden_dtype)
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
            self._copying.append((ready, slot))  # the slot goes back once this copy has completed
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            for f in dataclasses.fields(moved):
                value = getattr(moved, f.name)
                if isinstance(value, torch.Tensor):
                    value.record_stream(stream)
        self._handed.append(meta["completes"])
        return StepInput(moved, meta["tokens"], meta["weight"], ready)

    def _release_copied(self) -> None:
        while self._copying and self._copying[0][0].query():
            _send(self._conn, ("free", self._copying.popleft()[1]))

    def _on_death(self) -> None:
        """Return the dead worker's claims, drop what it built but did not hand out, start a new one."""
        self._proc.join(timeout=10.0)
        code = self._proc.exitcode
        why = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
        if code == -signal.SIGBUS:
            why += ": is /dev/shm full? (--data-workers 0 needs none)"
        self._conn.close()
        for event, _ in self._copying:  # the slots are the new worker's: no copy may still read them
            event.synchronize()
        self._copying.clear()
        returned = self._spool.return_claims(self.spec.consumer_id)
        if self.restarts >= self.max_restarts:
            self._ended = True
            raise RuntimeError(
                f"the data worker died {self.restarts + 1} times (last: pid {self._proc.pid}, {why}); "
                f"giving up (its {returned} claimed shards are back in the spool)"
            )
        self.restarts += 1
        log.warning(
            "data worker pid %d died (%s): %d claimed shards returned to the spool; restarting it (%d of %d), "
            "skipping the %d samples trained",
            self._proc.pid, why, returned, self.restarts, self.max_restarts, len(self._trained),
        )  # fmt: skip
        self._start()
