"""Where a consumer's run starts: the latest good checkpoint of the run, after the state a store outage
left on local disk has gone back to the store (``outage.py``).

Every rank loads the same files; a checkpoint whose draft layers differ from this run's, or whose weights
do not fit this drafter, is one clear error rather than a silently different model.
"""

from __future__ import annotations

import logging

from dflash.common.checkpoints.layout import LoadedCheckpoint
from dflash.common.checkpoints.load import finished_steps, load_latest_good, restore_rng_state
from dflash.common.checkpoints.save import save_checkpoint
from dflash.common.checkpoints.store import CheckpointStore, CheckpointStoreError, LocalStore
from dflash.common.drafter.config import DrafterConfig
from dflash.common.redact import redact
from dflash.consumer import distributed as D
from dflash.consumer.checkpointing.outage import has_state, with_retries
from dflash.consumer.checkpointing.state import TrainState
from dflash.consumer.optim import MasterAdamW

log = logging.getLogger(__name__)


def check_layout(ckpt: LoadedCheckpoint, drafter: DrafterConfig) -> None:
    """The checkpoint's draft layers (full / sliding, the window) are this run's, else ``ValueError``."""
    saved = (ckpt.config or {}).get("drafter") or {}
    layout = {"layer_types": drafter.layer_types, "sliding_window": drafter.sliding_window}
    was = {  # checkpoints from before sliding layers existed: all full attention
        "layer_types": saved.get("layer_types") or ["full_attention"] * drafter.num_layers,
        "sliding_window": saved.get("sliding_window"),
    }
    if saved and was != layout:
        raise ValueError(
            f"checkpoint step {ckpt.step} was trained with draft layers {was['layer_types']} (window "
            f"{was['sliding_window']}), this run asks for {layout['layer_types']} (window "
            f"{layout['sliding_window']}): give the same --draft-layer-types/--sliding-window, or --resume none"
        )


def restore(ckpt: LoadedCheckpoint, state: TrainState, rank: int) -> None:
    """Weights, optimizer, schedule, this rank's RNG, the step and the trained set from ``ckpt``."""
    check_layout(ckpt, state.drafter_config)
    model, optimizer = state.model, state.optimizer
    missing, unexpected = model.load_state_dict(ckpt.model_state, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if trainable & set(missing) or unexpected:
        raise ValueError(
            f"checkpoint step {ckpt.step} does not fit this drafter: missing {sorted(trainable & set(missing))[:3]}"
            f" unexpected {sorted(unexpected)[:3]}"
        )
    optimizer.load_state_dict(ckpt.optimizer_state)
    if isinstance(optimizer, MasterAdamW):  # the checkpoint's fp32 weights are the masters
        for name, p in model.named_parameters():
            if p.requires_grad:
                optimizer.set_master(p, ckpt.model_state[name])
    state.schedule.load_state_dict(ckpt.scheduler_state)
    rng = ckpt.rng_state.get(rank) if isinstance(ckpt.rng_state, dict) else None
    if rng is not None:
        restore_rng_state(rng)
    state.progress.step = ckpt.step
    state.progress.trained = ckpt.trained


def upload_fallback(
    store: CheckpointStore, fallback: LocalStore, run: str, *, keep_last: int, dist: D.DistInfo
) -> None:
    """The state a store outage left on local disk (newer than the store's latest) goes to the store
    before training resumes (rank 0 writes; every rank learns the outcome, then loads from the store);
    the local copy is removed once ``latest`` names it."""
    error = None
    local = None
    if dist.is_main and has_state(fallback, run):
        local = load_latest_good(fallback, run)
        steps = finished_steps(store, run)
        if local is not None and steps and steps[-1] >= local.step:  # the store caught up: stale copy
            log.warning(
                "%s holds step %d, the store step %d: the local copy is not used",
                local.url,
                local.step,
                steps[-1],
            )
            local = None
    if local is not None:
        log.info(
            "the state of step %d waits in %s (a store outage stopped the last launch): uploading it",
            local.step,
            local.url,
        )
        try:
            url = with_retries(
                lambda: save_checkpoint(
                    store,
                    run,
                    local.step,
                    model_state=local.model_state,
                    optimizer_state=local.optimizer_state,
                    scheduler_state=local.scheduler_state,
                    rng_state=local.rng_state,
                    trained=local.trained,
                    config=local.config,
                    keep_last=keep_last,
                )
            )
            fallback.delete_prefix(f"{run}/")
            log.info("checkpoint step %d -> %s; %s removed", local.step, redact(url), local.url)
        except CheckpointStoreError as err:
            error = (
                f"{redact(err)}; the store still refuses checkpoints: the state of step {local.step} stays "
                f"in {local.url}; run the same command once the store takes writes"
            )
    error = D.broadcast_object(error, dist)
    if error is not None:
        raise CheckpointStoreError(error)
