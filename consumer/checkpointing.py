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

from dflash.common.checkpoints.load import load_latest_good, restore_rng_state
from dflash.common.checkpoints.save import capture_rng_state, save_checkpoint
from dflash.common.checkpoints.store import CheckpointStoreError, open_store
from dflash.common.contract.sample_set import SampleSet
from dflash.common.redact import redact
from dflash.consumer import distributed as D
from dflash.consumer.optim import MasterAdamW

log = logging.getLogger(__name__)


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
        error = None
        if self.dist.is_main:
            try:
                self.store.probe_writable(self.cfg.run)
            except CheckpointStoreError as err:
                error = f"{err}; no checkpoint could be saved: fix it, or pass another --checkpoint"
        error = D.broadcast_object(error, self.dist)
        if error is not None:
            raise CheckpointStoreError(error)

    def _resume(self) -> None:
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

    def save(self, *, final: bool = False) -> None:
        """Checkpoint the group's state (rank 0 writes, every rank takes part in merging the trained sets).

        The state is copied to host memory on the compute stream and written in the background
        (``async_checkpoint.py``): training stalls only for that copy. A periodic checkpoint the store refuses
        (S3 outage longer than the retries, lost permissions, full disk) is ONE error line when its write
        ends, and training goes on: ``latest`` still names the previous good checkpoint and the next save
        tries again; losing a checkpoint costs at most redoing its steps after a crash, stopping would cost
        the run. The ``final`` save (data drained, SIGTERM) waits for its write and raises on every rank if
        it failed: exiting 0 without it would throw away the run's tail without anyone noticing.
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
            if error is not None:
                raise CheckpointStoreError(error)

    def _submit_save(self) -> None:
        for blob in D.all_gather_bytes(self.trained.to_bytes(), self.dist):
            self.trained.update(SampleSet.from_bytes(blob))  # in place: the feed skips from this set
        trained = SampleSet.from_bytes(self.trained.to_bytes())  # frozen at this step; the live set grows on
        trained.epoch = self._step_epoch  # recorded in the checkpoint (the merged set: equal on every rank)
        rng_states = D.all_gather_object(capture_rng_state(), self.dist)
        self._saved_step = self.step
        if not self.dist.is_main:
            return
        step, scheduler_state = self.step, self.scheduler.state_dict()
        config = {"train": self.cfg.to_dict(), "drafter": self.drafter_config.to_dict()}

        def write(host: dict) -> str:
            return save_checkpoint(
                self.store,
                self.cfg.run,
                step,
                model_state=host["model"],
                optimizer_state=host["optimizer"],
                scheduler_state=scheduler_state,
                rng_state=dict(enumerate(rng_states)),
                trained=trained,
                config=config,
                keep_last=self.cfg.keep_last,
            )

        self.checkpointer.snapshot_and_write(step, self._device_state(), write)
        self._report_saves(self.checkpointer.collect())

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
                if self._have_checkpoint:
                    log.error("%s; training goes on, latest still names the previous checkpoint", error)
                else:  # training on would lose every step if the process died: stop now and say so
                    self._fatal_save_error = (
                        f"{error}; no checkpoint of run {self.cfg.run!r} exists yet, so training on would "
                        "lose every step: stopping (fix the store and run the same command again)"
                    )
                    log.error("%s", self._fatal_save_error)
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
                event = {"event": "checkpoint", "step": out.step, "url": redact(out.url)}
            if self.metrics:
                self.metrics.write(
                    {**event, "stall_s": stall, "write_s": out.write_s, "gb": out.snapshot_gb, "time": time.time()}
                )
