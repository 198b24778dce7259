"""The trainer's checkpoint half: resume from the latest good checkpoint, save in the background, report
every save's outcome (a mixin of ``Trainer``: it reads and writes the trainer's model, optimizer, schedule,
step and trained-sample set, which is all a checkpoint is).

Why a save never stalls training: the state is copied to host memory on the compute stream and written
and uploaded by a background thread (async_checkpoint.py); training stalls only for the copy.
"""

from __future__ import annotations

import logging
import time

import torch
import torch._dynamo  # noqa: F401  first import in the main thread: concurrent first imports from threads crash

from dflash.common.checkpoints.load import finished_steps, load_latest_good, restore_rng_state
from dflash.common.checkpoints.save import capture_rng_state, save_checkpoint
from dflash.common.checkpoints.store import CheckpointStore, CheckpointStoreError, open_store
from dflash.common.contract.sample_set import SampleSet
from dflash.common.redact import redact
from dflash.consumer import distributed as D
from dflash.consumer.optim import MasterAdamW
from dflash.consumer.store_outage import OutagePolicy, fallback_store, has_state, with_retries

log = logging.getLogger(__name__)


class StoreOutageError(CheckpointStoreError):
    """Training stopped because the store refused checkpoints; the message says where the state is."""


class CheckpointingMixin:
    """``Trainer``'s resume and save (see the module docstring)."""

    # ------------------------------------------------------------------------------ resume / save
    def _open_store(self) -> None:
        """Open the store and prove it takes checkpoints before the first step (rank 0 writes, reads back and
        deletes a probe; every rank learns the outcome): a folder or bucket that refuses writes would
        otherwise be found out at the first save, after the run's first steps, or never."""
        self.store = open_store(self.cfg.checkpoint)
        self._have_checkpoint = False  # a good checkpoint of this run exists (resumed, or saved since)
        self._fatal_save_error: str | None = None
        self._outage_stop: str | None = None  # why the store's outage stops training (store_outage.py)
        self.outage = OutagePolicy(self.cfg.outage_saves, self.cfg.outage_minutes)
        self.fallback = fallback_store(self.cfg.fallback_dir, self.cfg.run_dir)
        error = None
        if self.dist.is_main:
            try:
                self.store.probe_writable(self.cfg.run)
            except CheckpointStoreError as err:
                error = f"{err}; no checkpoint could be saved: fix it, or pass another --checkpoint"
                if has_state(self.fallback, self.cfg.run):
                    error += f" (the run's latest state waits in {self.fallback.url_for(self.cfg.run)})"
        error = D.broadcast_object(error, self.dist)
        if error is not None:
            raise CheckpointStoreError(error)

    def _resume(self) -> None:
        self._upload_fallback()  # a store outage's state first goes to the store: every rank loads from it
        ckpt = load_latest_good(self.store, self.cfg.run)
        if ckpt is None:
            log.info("no checkpoint under %s/%s: starting fresh", redact(self.cfg.checkpoint), self.cfg.run)
            return
        saved = (ckpt.config or {}).get("drafter") or {}
        layout = {"layer_types": self.drafter_config.layer_types, "sliding_window": self.drafter_config.sliding_window}
        was = {  # checkpoints from before sliding layers existed: all full attention
            "layer_types": saved.get("layer_types") or ["full_attention"] * self.drafter_config.num_layers,
            "sliding_window": saved.get("sliding_window"),
        }
        if saved and was != layout:
            raise ValueError(
                f"checkpoint step {ckpt.step} was trained with draft layers {was['layer_types']} (window "
                f"{was['sliding_window']}), this run asks for {layout['layer_types']} (window "
                f"{layout['sliding_window']}): give the same --draft-layer-types/--sliding-window, or --resume none"
            )
        missing, unexpected = self.model.load_state_dict(ckpt.model_state, strict=False)
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        if trainable & set(missing) or unexpected:
            raise ValueError(
                f"checkpoint step {ckpt.step} does not fit this drafter: missing {sorted(trainable & set(missing))[:3]}"
                f" unexpected {sorted(unexpected)[:3]}"
            )
        self.optimizer.load_state_dict(ckpt.optimizer_state)
        if isinstance(self.optimizer, MasterAdamW):  # the checkpoint's fp32 weights are the masters
            for name, p in self.model.named_parameters():
                if p.requires_grad:
                    self.optimizer.set_master(p, ckpt.model_state[name])
        self.scheduler.load_state_dict(ckpt.scheduler_state)
        rng = ckpt.rng_state.get(self.dist.rank) if isinstance(ckpt.rng_state, dict) else None
        if rng is not None:
            restore_rng_state(rng)
        self.step = ckpt.step
        self.trained = ckpt.trained
        self._have_checkpoint = True
        log.info("resumed from step %d (%d samples already trained)", self.step, len(self.trained))

    def _upload_fallback(self) -> None:
        """The state a store outage left on local disk (newer than the store's latest) goes to the store
        before training resumes (rank 0 writes; every rank learns the outcome, then loads from the store);
        the local copy is removed once ``latest`` names it."""
        error = None
        local = None
        if self.dist.is_main and has_state(self.fallback, self.cfg.run):
            local = load_latest_good(self.fallback, self.cfg.run)
            steps = finished_steps(self.store, self.cfg.run)
            if local is not None and steps and steps[-1] >= local.step:  # the store caught up: stale copy
                log.warning("%s holds step %d, the store step %d: the local copy is not used", local.url, local.step, steps[-1])  # fmt: skip
                local = None
        if local is not None:
            log.info("the state of step %d waits in %s (a store outage stopped the last launch): uploading it", local.step, local.url)  # fmt: skip
            try:
                url = with_retries(lambda: save_checkpoint(
                    self.store, self.cfg.run, local.step, model_state=local.model_state,
                    optimizer_state=local.optimizer_state, scheduler_state=local.scheduler_state,
                    rng_state=local.rng_state, trained=local.trained, config=local.config, keep_last=self.cfg.keep_last,
                ))  # fmt: skip
                self.fallback.delete_prefix(f"{self.cfg.run}/")
                log.info("checkpoint step %d -> %s; %s removed", local.step, redact(url), local.url)
            except CheckpointStoreError as err:
                error = (
                    f"{redact(err)}; the store still refuses checkpoints: the state of step {local.step} stays "
                    f"in {local.url}; run the same command once the store takes writes"
                )
        error = D.broadcast_object(error, self.dist)
        if error is not None:
            raise CheckpointStoreError(error)

    def _poll_saves(self) -> None:
        """Each finished background save said at once; an outage past its bound stops training (rank 0)."""
        if not self.dist.is_main or self.store is None:
            return
        self._report_saves(self.checkpointer.collect())
        if self._outage_stop is None and (why := self.outage.exceeded()) is not None:
            self._outage_stop = f"{self._last_save_error or 'checkpoint saves failed'}; {why}"

    def _stop_to_fallback(self, reason: str | None) -> None:
        """Every rank: write the state to the local fallback folder and raise ``StoreOutageError`` with one
        line saying why, where the state is and how to go on (the same command). Nothing trained is lost."""
        reason = D.broadcast_object(reason, self.dist)
        if self.dist.is_main:
            self._report_saves(self.checkpointer.wait())  # a save in flight ends first (its outcome said)
        trained, rng_states = self._save_state()
        error = None
        if self.dist.is_main:
            self.checkpointer.snapshot_and_write(
                self.step, self._device_state(), self._writer(self.fallback, trained, rng_states, keep_last=1)
            )
            error = next((o.error for o in self.checkpointer.wait() if o.error), None)
        error = D.broadcast_object(error, self.dist)
        where = self.fallback.url_for(self.cfg.run)
        if error is not None:
            raise StoreOutageError(f"{reason}; the local copy failed too ({redact(error)}): steps since the store's latest are lost")  # fmt: skip
        raise StoreOutageError(
            f"{reason}; stopped at step {self.step}, its state saved in {where}: run the same command once the "
            "store takes writes (it resumes from there and uploads it)"
        )

    def save(self, *, final: bool = False) -> None:
        """Checkpoint the group's state (rank 0 writes, every rank takes part in merging the trained sets).

        The state is copied to host memory on the compute stream and written in the background
        (``async_checkpoint.py``): training stalls only for that copy. A periodic checkpoint the store refuses
        (S3 outage longer than the retries, lost permissions, full disk) is ONE error line when its write
        ends, and training goes on within the outage bound (``store_outage.py``: then the state goes to local
        disk and training stops): ``latest`` still names the previous good checkpoint and the next save
        tries again. The ``final`` save (data drained, SIGTERM) waits for its write; if it failed, the state
        goes to local disk and every rank raises ``StoreOutageError``: exiting 0 without it would throw away
        the run's tail without anyone noticing.
        """
        if self.store is None:
            return
        if not (final and self._saved_step == self.step):  # else the last periodic save wrote this step
            self._submit_save()
        if final:
            error = None
            if self.dist.is_main:
                self._report_saves(self.checkpointer.wait())
                error = self._last_save_error  # the newest save's outcome: this step's
            error = D.broadcast_object(error, self.dist)  # every rank knows the outcome
            if error is not None:  # the run's tail is only in memory: to local disk, and stop saying so
                self._stop_to_fallback(error)

    def _save_state(self) -> tuple[SampleSet, list]:
        """Every rank: the merged trained set (frozen at this step) and every rank's RNG state."""
        for blob in D.all_gather_bytes(self.trained.to_bytes(), self.dist):
            self.trained.update(SampleSet.from_bytes(blob))  # in place: the feed skips from this set
        trained = SampleSet.from_bytes(self.trained.to_bytes())  # frozen at this step; the live set grows on
        trained.epoch = self._step_epoch  # recorded in the checkpoint (the merged set: equal on every rank)
        return trained, D.all_gather_object(capture_rng_state(), self.dist)

    def _writer(self, store: CheckpointStore, trained: SampleSet, rng_states: list, *, keep_last: int):
        """The background write of this step's checkpoint into ``store`` (tried again once on failure)."""
        step, scheduler_state = self.step, self.scheduler.state_dict()
        config = {"train": self.cfg.to_dict(), "drafter": self.drafter_config.to_dict()}

        def write(host: dict) -> str:
            return with_retries(lambda: save_checkpoint(
                store, self.cfg.run, step, model_state=host["model"], optimizer_state=host["optimizer"],
                scheduler_state=scheduler_state, rng_state=dict(enumerate(rng_states)), trained=trained,
                config=config, keep_last=keep_last,
            ))  # fmt: skip

        return write

    def _submit_save(self) -> None:
        trained, rng_states = self._save_state()
        self._saved_step = self.step
        if not self.dist.is_main:
            return
        write = self._writer(self.store, trained, rng_states, keep_last=self.cfg.keep_last)
        self.checkpointer.snapshot_and_write(self.step, self._device_state(), write)
        self._poll_saves()

    def _device_state(self) -> dict:
        """The trainable weights (fp32 masters for mixed precision: what every precision stores, so a run
        resumes in any) and the optimizer's state, on the device."""
        if isinstance(self.optimizer, MasterAdamW):
            model_state = {n: self.optimizer.master_of(p) for n, p in self.model.named_parameters() if p.requires_grad}
        else:
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            model_state = {k: v for k, v in self.model.state_dict().items() if k in trainable}
        return {"model": model_state, "optimizer": self.optimizer.state_dict()}

    def _report_saves(self, outcomes) -> None:
        """One log line (and metrics event) per finished save, oldest first."""
        for out in outcomes:
            stall = out.waited_s + out.copy_s
            self.last_save_stall_s = stall
            self._last_save_error = None
            if out.error is not None:
                error = f"checkpoint step {out.step} failed: {redact(out.error)}"
                self._last_save_error = error
                self.outage.save_failed()
                if self._have_checkpoint:
                    log.error(
                        "%s; training goes on, latest still names the previous checkpoint (%d of --outage-saves "
                        "%d failed in a row)", error, self.outage.failed, self.outage.max_failed_saves,
                    )  # fmt: skip
                else:  # training on would lose every step if the process died: stop now and say so
                    self._fatal_save_error = (
                        f"{error}; no checkpoint of run {self.cfg.run!r} exists yet, so training on would "
                        "lose every step"
                    )
                    log.error("%s: stopping", self._fatal_save_error)
                event = {"event": "checkpoint_failed", "step": out.step, "error": error}
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
                    {**event, "stall_s": stall, "write_s": out.write_s, "gb": out.snapshot_gb, "time": time.time()}
                )
