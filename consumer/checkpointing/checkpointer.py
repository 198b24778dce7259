"""The consumer's checkpoints: ``Checkpointer`` is handed the state it saves (``state.TrainState``) and the
cadence, and decides when to save; it resumes the run, saves in the background, says every save's outcome
and stops training when the store refuses checkpoints past the outage bound (``outage.py``).

Why a save never stalls training: the state is copied to host memory on the compute stream and written
and uploaded by a background thread (background.py); training stalls only for the copy.
"""

from __future__ import annotations

import logging
import time

import torch

from dflash.common.checkpoints.load import load_latest_good
from dflash.common.checkpoints.save import capture_rng_state, save_checkpoint
from dflash.common.checkpoints.store import CheckpointStore, CheckpointStoreError, open_store
from dflash.common.contract.sample_set import SampleSet
from dflash.common.metrics import MetricsLog
from dflash.common.redact import redact
from dflash.consumer import distributed as D
from dflash.consumer.checkpointing.background import AsyncCheckpointer, SaveOutcome
from dflash.consumer.checkpointing.outage import OutagePolicy, fallback_store, has_state, with_retries
from dflash.consumer.checkpointing.resume import check_resumable, restore, upload_fallback
from dflash.consumer.checkpointing.state import TrainState
from dflash.consumer.config import CheckpointConfig
from dflash.consumer.optim import MasterAdamW

log = logging.getLogger(__name__)


class StoreOutageError(CheckpointStoreError):
    """Training stopped because the store refused checkpoints; the message says where the state is."""


class Checkpointer:
    """Resume, periodic and final saves of one consumer process (see the module docstring). Without
    ``--checkpoint`` every method is a no-op: ``enabled`` is False."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        state: TrainState,
        *,
        run: str,
        run_dir: str | None = None,
        run_config: dict | None = None,
        dist: D.DistInfo,
        device: torch.device,
        metrics: MetricsLog | None = None,
    ) -> None:
        self.cfg, self.state, self.dist = cfg, state, dist
        self.run = run
        """The run's folder under the store."""
        self.run_config = run_config or {}
        """The run's whole config, recorded in every checkpoint (``config.train``: export reads the target)."""
        self.metrics = metrics
        """Where each save's event goes (``report_to``: the run's metrics file opens after the resume)."""
        self.store: CheckpointStore | None = None
        self.writer = AsyncCheckpointer(device)
        self.last_save_stall_s: float | None = None
        self._have_checkpoint = False  # a good checkpoint of this run exists (resumed, or saved since)
        self._fatal_error: str | None = None  # a save failed with no checkpoint to fall back on
        self._outage_stop: str | None = None  # why the store's outage stops training (outage.py)
        self._last_error: str | None = None
        self._saved_step: int | None = None
        self.outage = OutagePolicy(cfg.outage_saves, cfg.outage_minutes)
        self.fallback = fallback_store(cfg.fallback_dir, run_dir)
        if cfg.store:
            self._open_store()

    def report_to(self, metrics: MetricsLog | None) -> None:
        """Each save's event goes to ``metrics`` from now on (opened once the run is resumed: no file of
        this launch is written before the store is proven writable)."""
        self.metrics = metrics

    @property
    def enabled(self) -> bool:
        return self.store is not None

    @property
    def stop_reason(self) -> str | None:
        """Why training must stop now (a save failed with no checkpoint yet, or the outage bound passed)."""
        return self._fatal_error or self._outage_stop

    def _open_store(self) -> None:
        """Open the store and prove it takes checkpoints before the first step (rank 0 writes, reads back and
        deletes a probe; every rank learns the outcome): a folder or bucket that refuses writes would
        otherwise be found out at the first save, after the run's first steps, or never."""
        self.store = open_store(self.cfg.store)
        error = None
        if self.dist.is_main:
            try:
                self.store.probe_writable(self.run)
            except CheckpointStoreError as err:
                error = f"{err}; no checkpoint could be saved: fix it, or pass another --checkpoint"
                if has_state(self.fallback, self.run):
                    error += f" (the run's latest state waits in {self.fallback.url_for(self.run)})"
        error = D.broadcast_object(error, self.dist)
        if error is not None:
            raise CheckpointStoreError(error)

    def resume(self) -> None:
        """``--resume auto``: the run's latest good checkpoint into the state (every rank loads the same
        files), after a store outage's local state has gone to the store."""
        if self.store is None or self.cfg.resume != "auto":
            return
        upload_fallback(self.store, self.fallback, self.run, keep_last=self.cfg.keep_last, dist=self.dist)
        ckpt = load_latest_good(self.store, self.run)
        if ckpt is None:
            log.info("no checkpoint under %s/%s: starting fresh", redact(self.cfg.store), self.run)
            return
        changes = check_resumable(ckpt, self.state.drafter_config, run=self.run, meant=self.cfg.meant_changes)
        restore(ckpt, self.state, self.dist.rank)
        if changes and self.dist.is_main:
            log.warning("resuming with %s (--resume-changes)", "; ".join(changes))
        self._have_checkpoint = True
        progress = self.state.progress
        log.info("resumed from step %d (%d samples already trained)", progress.step, len(progress.trained))

    def prepare(self) -> None:
        """The host buffers of a save, allocated in the background (after the first step: memory settled)."""
        if self.store is not None and self.dist.is_main:
            self.writer.prepare(self._device_state())

    def poll(self) -> None:
        """Each finished background save said at once; an outage past its bound stops training (rank 0)."""
        if not self.dist.is_main or self.store is None:
            return
        self.report(self.writer.collect())
        if self._outage_stop is None and (why := self.outage.exceeded()) is not None:
            self._outage_stop = f"{self._last_error or 'checkpoint saves failed'}; {why}"

    def report_finished(self) -> None:
        """The saves that finished since the last look, said (rank 0; before a log line)."""
        if self.dist.is_main:
            self.report(self.writer.collect())

    def save_if_due(self) -> None:
        """A periodic save every ``--save-every`` steps."""
        if self.store is not None and self.state.progress.step % self.cfg.save_every == 0:
            self.save()

    def save(self, *, final: bool = False) -> None:
        """Checkpoint the group's state (rank 0 writes, every rank takes part in merging the trained sets).

        The state is copied to host memory on the compute stream and written in the background
        (``background.py``): training stalls only for that copy. A periodic checkpoint the store refuses
        (S3 outage longer than the retries, lost permissions, full disk) is ONE error line when its write
        ends, and training goes on within the outage bound (``outage.py``: then the state goes to local
        disk and training stops): ``latest`` still names the previous good checkpoint and the next save
        tries again. The ``final`` save (data drained, SIGTERM) waits for its write; if it failed, the state
        goes to local disk and every rank raises ``StoreOutageError``: exiting 0 without it would throw away
        the run's tail without anyone noticing.
        """
        if self.store is None:
            return
        if not (
            final and self._saved_step == self.state.progress.step
        ):  # else the last periodic save wrote it
            self._submit()
        if final:
            error = None
            if self.dist.is_main:
                self.report(self.writer.wait())
                error = self._last_error  # the newest save's outcome: this step's
            error = D.broadcast_object(error, self.dist)  # every rank knows the outcome
            if error is not None:  # the run's tail is only in memory: to local disk, and stop saying so
                self.stop_to_fallback(error)

    def stop_to_fallback(self, reason: str | None) -> None:
        """Every rank: write the state to the local fallback folder and raise ``StoreOutageError`` with one
        line saying why, where the state is and how to go on (the same command). Nothing trained is lost."""
        reason = D.broadcast_object(reason, self.dist)
        if self.dist.is_main:
            self.report(self.writer.wait())  # a save in flight ends first (its outcome said)
        trained, rng_states = self._merged_state()
        error = None
        if self.dist.is_main:
            write = self._write_job(self.fallback, trained, rng_states, keep_last=1)
            self.writer.snapshot_and_write(self.state.progress.step, self._device_state(), write)
            error = next((o.error for o in self.writer.wait() if o.error), None)
        error = D.broadcast_object(error, self.dist)
        where = self.fallback.url_for(self.run)
        if error is not None:
            raise StoreOutageError(
                f"{reason}; the local copy failed too ({redact(error)}): steps since the store's latest are lost"
            )
        raise StoreOutageError(
            f"{reason}; stopped at step {self.state.progress.step}, its state saved in {where}: run the same "
            "command once the store takes writes (it resumes from there and uploads it)"
        )

    def _merged_state(self) -> tuple[SampleSet, list]:
        """Every rank: the merged trained set (frozen at this step) and every rank's RNG state."""
        progress = self.state.progress
        for blob in D.all_gather_bytes(progress.trained.to_bytes(), self.dist):
            progress.trained.update(SampleSet.from_bytes(blob))  # in place: the feed skips from this set
        trained = SampleSet.from_bytes(
            progress.trained.to_bytes()
        )  # frozen at this step; the live set grows on
        trained.epoch = progress.epoch  # recorded in the checkpoint (the merged set: equal on every rank)
        return trained, D.all_gather_object(capture_rng_state(), self.dist)

    def _write_job(self, store: CheckpointStore, trained: SampleSet, rng_states: list, *, keep_last: int):
        """The background write of this step's checkpoint into ``store`` (tried again once on failure)."""
        step, scheduler_state = self.state.progress.step, self.state.schedule.state_dict()
        config = {"train": self.run_config, "drafter": self.state.drafter_config.to_dict()}

        def write(host: dict) -> str:
            return with_retries(
                store=store,
                write=lambda: save_checkpoint(
                    store,
                    self.run,
                    step,
                    model_state=host["model"],
                    optimizer_state=host["optimizer"],
                    scheduler_state=scheduler_state,
                    rng_state=dict(enumerate(rng_states)),
                    trained=trained,
                    config=config,
                    keep_last=keep_last,
                ),
            )

        return write

    def _submit(self) -> None:
        trained, rng_states = self._merged_state()
        self._saved_step = self.state.progress.step
        if not self.dist.is_main:
            return
        write = self._write_job(self.store, trained, rng_states, keep_last=self.cfg.keep_last)
        self.writer.snapshot_and_write(self._saved_step, self._device_state(), write)
        self.poll()

    def _device_state(self) -> dict:
        """The trainable weights (fp32 masters for mixed precision: what every precision stores, so a run
        resumes in any) and the optimizer's state, on the device."""
        model, optimizer = self.state.model, self.state.optimizer
        if isinstance(optimizer, MasterAdamW):
            model_state = {n: optimizer.master_of(p) for n, p in model.named_parameters() if p.requires_grad}
        else:
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            model_state = {k: v for k, v in model.state_dict().items() if k in trainable}
        return {"model": model_state, "optimizer": optimizer.state_dict()}

    def report(self, outcomes: list[SaveOutcome]) -> None:
        """One log line (and metrics event) per finished save, oldest first."""
        for out in outcomes:
            stall = out.waited_s + out.copy_s
            self.last_save_stall_s = stall
            self._last_error = None
            if out.error is not None:
                event = self._failed(out)
            else:
                log.info(
                    "checkpoint step %d -> %s (%.1f GB; training stalled %.2fs, written in %.1fs in the background)",
                    out.step,
                    redact(out.url),
                    out.snapshot_gb,
                    stall,
                    out.write_s,
                )
                self._have_checkpoint = True
                self.outage.saved()
                event = {"event": "checkpoint", "step": out.step, "url": redact(out.url)}
            if self.metrics:
                self.metrics.write(
                    {
                        **event,
                        "stall_s": stall,
                        "write_s": out.write_s,
                        "gb": out.snapshot_gb,
                        "time": time.time(),
                    }
                )

    def _failed(self, out: SaveOutcome) -> dict:
        """A failed save: one error line; the first failure before any checkpoint exists stops training."""
        error = f"checkpoint step {out.step} failed: {redact(out.error)}"
        self._last_error = error
        self.outage.save_failed()
        if self._have_checkpoint:
            log.error(
                "%s; training goes on, latest still names the previous checkpoint (%d of --outage-saves "
                "%d failed in a row)",
                error,
                self.outage.failed,
                self.outage.max_failed_saves,
            )
        else:  # training on would lose every step if the process died: stop now and say so
            self._fatal_error = (
                f"{error}; no checkpoint of run {self.run!r} exists yet, so training on would lose every step"
            )
            log.error("%s: stopping", self._fatal_error)
        return {"event": "checkpoint_failed", "step": out.step, "error": error}
