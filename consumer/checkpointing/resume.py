"""Where a consumer's run starts: the latest good checkpoint of the run, after the state a store outage
left on local disk has gone back to the store (``outage.py``).

Every rank loads the same files; a checkpoint of another drafter (another block size, mask token, target
layers, target, draft layers or shape: ``check_resumable``) is one clear line rather than a silently
different model or torch's error, unless ``--resume-changes`` says the change is meant.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class DrafterSetting:
    """One setting that defines the drafter or its inputs, as a resume compares it with the checkpoint's."""

    name: str
    """How ``--resume-changes`` names it (``RESUME_CHANGES``); the unloadable ones are never named there."""
    flag: str
    """What the user gives to set it."""
    fields: tuple[str, ...]
    """The ``DrafterConfig`` fields it is."""
    loads: bool
    """The checkpoint's weights load into a drafter with another value (a change can be meant)."""


DRAFTER_SETTINGS = (
    DrafterSetting("drafter-arch", "--drafter-arch", ("arch",), loads=False),
    DrafterSetting("num-layers", "--num-layers", ("num_layers",), loads=False),
    DrafterSetting("hidden-size", "--target (its hidden size)", ("hidden_size",), loads=False),
    DrafterSetting(
        "target-shape",
        "--target (its attention heads, head size, MLP width)",
        ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"),
        loads=False,
    ),
    DrafterSetting(
        "target-layer-count", "--target-layer-ids (how many)", ("num_context_layers",), loads=False
    ),
    DrafterSetting(
        "draft-layer-types",
        "--draft-layer-types/--sliding-window",
        ("layer_types", "sliding_window"),
        loads=True,
    ),
    DrafterSetting("block-size", "--block-size", ("block_size",), loads=True),
    DrafterSetting("mask-token-id", "--mask-token-id", ("mask_token_id",), loads=True),
    DrafterSetting("target-layer-ids", "--target-layer-ids", ("target_layer_ids",), loads=True),
    DrafterSetting("target", "--target (its vocabulary)", ("vocab_size",), loads=True),
    DrafterSetting("target", "--target (its weights' fingerprint)", ("target_fingerprint",), loads=True),
)
"""Every setting a resume compares, the ones whose weights cannot load first (a change there is never
meant: another drafter). Old checkpoints that lack a field are not compared on it."""


def _compared(recorded: dict) -> dict:
    """A drafter's recorded fields in the terms the settings compare: the context-layer count derived,
    and a checkpoint from before sliding layers existed (no ``layer_types``) read as all full attention."""
    out = dict(recorded)
    if "target_layer_ids" in recorded:
        out["num_context_layers"] = len(recorded["target_layer_ids"])
    if "num_layers" in recorded:
        out["layer_types"] = recorded.get("layer_types") or ["full_attention"] * int(recorded["num_layers"])
        out["sliding_window"] = recorded.get("sliding_window")
        out["arch"] = recorded.get("arch", "dflash")  # checkpoints from before DFlash2 are DFlash
    return out


def _value(values: dict, fields: tuple[str, ...]) -> Any:
    return values[fields[0]] if len(fields) == 1 else {f: values[f] for f in fields}


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_show(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ",".join(str(v) for v in value) if all(isinstance(v, int) for v in value) else str(value)
    text = str(value)
    return text[:12] + "…" if len(text) > 24 else text


def check_resumable(
    ckpt: LoadedCheckpoint, drafter: DrafterConfig, *, run: str, meant: frozenset[str]
) -> list[str]:
    """Compare every setting that defines the drafter or its inputs with the checkpoint's: a difference
    is ``ValueError`` (one line naming the setting, the checkpoint's value and the given one) unless its
    weights load and ``meant`` (``--resume-changes``) names it; the meant ones come back as phrases for
    the log. Why: a resume under another block size, mask token, target layers or target trains on
    silently as another drafter, and one that cannot load ended in a raw torch error."""
    saved = (ckpt.config or {}).get("drafter") or {}
    if not saved:
        return []
    was = _compared(saved)
    now = _compared(drafter.to_dict())
    where = f"checkpoint step {ckpt.step} of run {run!r}"
    accepted = []
    for s in DRAFTER_SETTINGS:
        if not all(f in was and f in now for f in s.fields):
            continue  # not recorded by an older checkpoint
        if s.fields == ("target_fingerprint",) and not (
            was["target_fingerprint"] and now["target_fingerprint"]
        ):
            continue  # unknown on one side: nothing to compare
        old, new = _value(was, s.fields), _value(now, s.fields)
        if old == new:
            continue
        change = f"{where} was trained with {s.flag} {_show(old)}, this run gives {_show(new)}"
        if not s.loads:
            raise ValueError(
                f"{change}: its weights cannot load into this drafter; give the checkpoint's value to "
                "resume it, or --resume none (or another --run) to start over"
            )
        if s.name not in meant:
            raise ValueError(
                f"{change}: give the checkpoint's value to resume it, --resume-changes {s.name} if the "
                "change is meant (the next checkpoint records the new value), or --resume none (or another "
                "--run) to start over"
            )
        accepted.append(f"{s.flag} {_show(old)} -> {_show(new)}")
    return accepted


def restore(ckpt: LoadedCheckpoint, state: TrainState, rank: int) -> None:
    """Weights, optimizer, schedule, this rank's RNG, the step and the trained set from ``ckpt`` (checked
    first with ``check_resumable``; a checkpoint without a recorded drafter that still does not fit is
    one line too, never torch's multi-line error)."""
    model, optimizer = state.model, state.optimizer
    try:
        missing, unexpected = model.load_state_dict(ckpt.model_state, strict=False)
    except RuntimeError as err:  # a size mismatch: torch lists every tensor, one per line
        first = next((ln.strip() for ln in str(err).splitlines()[1:] if ln.strip()), str(err))
        raise ValueError(f"checkpoint step {ckpt.step} does not fit this drafter: {first}") from None
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
                store=store,
                write=lambda: save_checkpoint(
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
                ),
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
