"""Saving checkpoints of the drafter's training state in a :mod:`dflash.common.checkpoints.store` store.

Layout (docs/checkpoints.md)::

    <store>/<run>/step-<n:08d>/model.safetensors   trainable drafter weights only
                               optimizer.pt         torch.save(optimizer.state_dict())
                               scheduler.pt         torch.save(scheduler.state_dict())
                               rng.pt               python/numpy/torch/CUDA RNG states
                               trained.bin          SampleSet bytes: samples trained this epoch
                               meta.json            step, epoch, redacted config, time, sizes + sha256
    <store>/<run>/latest                            "step-<n:08d>", written LAST
    <store>/<run>/evals/step-<n:08d>.json           dflash-eval --watch: one record per evaluated checkpoint
    <store>/<run>/best.json                         {step, step_dir, tau, evaluated_at, ...} of the best one
    <store>/<run>/best                              "step-<n:08d>": the highest real τ, written after best.json

Why this order: ``latest`` only changes after every file of the step directory was uploaded, so a crash
or failed upload leaves the previous checkpoint as latest. Every file is checked against the sha256 in
``meta.json`` on load; ``load_latest_good`` falls back to older step directories when one is corrupt.
Every ``.pt`` file loads with ``torch.load(weights_only=True)``: save refuses objects that would not.

``best`` and ``evals/`` are written only by ``dflash-eval --watch`` (tools/eval/watch.py), never by
the trainer; the trainer only reads ``best``: pruning keeps the step it names (docs/checkpoints.md).
A checkpoint is complete, for every reader, once its ``meta.json`` exists (it is uploaded after the data).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import socket
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from dflash.common.checkpoints.layout import (
    BEST_FILE,
    BEST_RECORD_FILE,
    DATA_FILES,
    FORMAT,
    LATEST_FILE,
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    STEP_DIR,
    TRAINED_FILE,
    VERSION,
    CheckpointCorruptError,
    as_store,
    check_run,
    file_sha256,
    read_best_name,
    read_latest_name,
    scan_steps,
    step_dir_name,
)
from dflash.common.checkpoints.store import (
    CheckpointStore,
    CheckpointStoreError,
)
from dflash.common.contract.sample_set import SampleSet
from dflash.common.redact import redact, redact_config

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------
# RNG


def capture_rng_state() -> dict:
    """This process's python, numpy (legacy global), torch CPU and CUDA RNG states, weights_only-loadable."""
    bit_generator, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": str(bit_generator),
            "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": list(cuda),
    }


# ----------------------------------------------------------------------------------------------------------
# Save


_WEIGHTS_ONLY_LEAVES = {
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.Size,
}


def _weights_only_safe(obj: Any, where: str) -> Any:
    """``obj`` with numpy scalars turned into python ones; ValueError naming the first object that
    ``torch.load(weights_only=True)`` would still reject (checked before anything is written)."""
    kind = type(obj)
    if kind in _WEIGHTS_ONLY_LEAVES or kind in (torch.Tensor, torch.nn.Parameter):
        return obj
    if isinstance(obj, np.generic) and obj.shape == ():
        return obj.item()
    if kind in (dict, OrderedDict):
        return kind(
            (_weights_only_safe(k, f"{where} key {k!r}"), _weights_only_safe(v, f"{where}[{k!r}]"))
            for k, v in obj.items()
        )
    if kind in (list, tuple, set):
        return kind(_weights_only_safe(v, f"{where}[{i}]") for i, v in enumerate(obj))
    raise ValueError(
        f"{where}: a {kind.__module__}.{kind.__qualname__} cannot be loaded with torch.load(weights_only=True); "
        "store tensors or python scalars/containers instead"
    )


def _model_tensors(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model_state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"model_state[{name!r}] is a {type(tensor).__name__}, not a tensor")
        t = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share storage (e.g. tied weights): store a copy.
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def save_checkpoint(
    store: CheckpointStore | str,
    run: str,
    step: int,
    *,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict,
    scheduler_state: dict,
    rng_state: dict,
    trained: SampleSet,
    config: dict,
    keep_last: int = 3,
) -> str:
    """Write one checkpoint, then point ``latest`` at it, then delete old ones. Returns the step dir url.

    Call on one rank only (rank 0) with ranks' trained sets already merged. A failure raises
    (CheckpointStoreError) before ``latest`` changes, so the previous checkpoint stays the latest.
    """
    store = as_store(store)
    check_run(run)
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if not isinstance(trained, SampleSet):
        raise ValueError(f"trained must be a SampleSet, got {type(trained).__name__}")
    optimizer_state = _weights_only_safe(optimizer_state, "optimizer_state")
    scheduler_state = _weights_only_safe(scheduler_state, "scheduler_state")
    rng_state = _weights_only_safe(rng_state, "rng_state")
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    tensors = _model_tensors(model_state)

    name = step_dir_name(step)
    step_dir = f"{run}/{name}"
    _clear_unfinished(store, run, name)
    started = time.monotonic()
    files = _upload_files(store, step_dir, tensors, optimizer_state, scheduler_state, rng_state, trained)
    meta = _meta(run, step, trained, config, files)
    store.put_bytes(f"{step_dir}/{META_FILE}", json.dumps(meta, indent=2, sort_keys=True).encode())
    store.put_bytes(f"{run}/{LATEST_FILE}", (name + "\n").encode())
    total = sum(f["bytes"] for f in files.values())
    took = time.monotonic() - started
    log.info("saved checkpoint %s (%.1f MB in %.1fs)", store.url_for(step_dir), total / 1e6, took)
    _prune(store, run, step, keep_last)
    return store.url_for(step_dir)


def _meta(run: str, step: int, trained: SampleSet, config: dict, files: dict) -> dict:
    """The checkpoint's meta.json: what it is, where and when it was made, the run's (redacted) config
    and each file's size and checksum (a loader verifies them)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "run": run,
        "step": step,
        "epoch": trained.epoch,
        "num_trained_samples": len(trained),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "unix_time": time.time(),
        "host": socket.gethostname(),
        "torch_version": torch.__version__,
        "config": redact_config(config),
        "files": files,
    }


def _clear_unfinished(store: CheckpointStore, run: str, name: str) -> None:
    """Remove the files of an unfinished checkpoint of this step (a crash mid-upload), never the latest."""
    step_dir = f"{run}/{name}"
    try:
        latest = read_latest_name(store, run)
    except CheckpointCorruptError:
        latest = None
    if latest != name and store.list(step_dir + "/"):
        log.info("removing leftovers of an unfinished checkpoint in %s", store.url_for(step_dir))
        store.delete_prefix(step_dir + "/")


def _upload_files(store, step_dir, tensors, optimizer_state, scheduler_state, rng_state, trained) -> dict:
    """Serialise the step's data files into a temp folder and upload each: {file: {bytes, sha256}}."""
    with tempfile.TemporaryDirectory(prefix="dflash-ckpt-") as tmp:
        local = {f: Path(tmp, f) for f in DATA_FILES}
        save_file(tensors, str(local[MODEL_FILE]), metadata={"format": "pt"})
        torch.save(optimizer_state, local[OPTIMIZER_FILE])
        torch.save(scheduler_state, local[SCHEDULER_FILE])
        torch.save(rng_state, local[RNG_FILE])
        local[TRAINED_FILE].write_bytes(trained.to_bytes())
        files = {}
        for fname, path in local.items():
            files[fname] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
            store.put_file(f"{step_dir}/{fname}", path)
    return files


def _prune(store: CheckpointStore, run: str, step: int, keep_last: int) -> None:
    """Keep the ``keep_last`` newest finished step dirs up to ``step`` (the new one included).

    Deleted: older dirs beyond that, older unfinished dirs (no meta.json: failed uploads, which would
    otherwise count towards k), and every dir ABOVE ``step``: those belong to a timeline this run abandoned
    when it resumed from an older checkpoint, and no fallback must ever land on them.
    The step that ``best`` names (dflash-eval --watch) is kept too, unless it is above ``step``.
    """
    try:
        steps, finished = scan_steps(store, run)
    except CheckpointStoreError as err:  # `latest` already names the new checkpoint: pruning can wait
        log.warning("could not list checkpoints to delete old ones: %s", err)
        return
    best = _best_steps_to_keep(store, run, step)
    if best is None:
        return
    kept = set(sorted(s for s in finished if s <= step)[-keep_last:]) | best
    doomed = [s for s in steps if s not in kept and s != step]
    for s in doomed:
        try:
            store.delete_prefix(f"{run}/{step_dir_name(s)}/")
        except CheckpointStoreError as err:  # the new checkpoint is safe: a leftover is only wasted space
            log.warning("could not delete old checkpoint %s: %s", step_dir_name(s), err)
    if doomed:
        log.info("deleted checkpoints %s", ", ".join(step_dir_name(s) for s in doomed))


def _best_steps_to_keep(store: CheckpointStore, run: str, step: int) -> set[int] | None:
    """{the step ``best`` names} for pruning; empty without one, or for one above ``step`` (the abandoned
    timeline). None when ``best`` cannot be read (a store failure): prune nothing rather than the best."""
    try:
        name = read_best_name(store, run)
    except CheckpointCorruptError as err:
        log.warning("%s; pruning ignores it", redact(str(err)))
        return set()
    except CheckpointStoreError as err:
        log.warning("could not read %s/%s, not pruning this time: %s", run, BEST_FILE, err)
        return None
    best = None if name is None else int(STEP_DIR.match(name).group(1))
    return {best} if best is not None and best <= step else set()


# ----------------------------------------------------------------------------------------------------------
# Best (written by dflash-eval --watch)


def write_best(store: CheckpointStore | str, run: str, step: int, record: dict) -> None:
    """Point ``best`` at ``step``: ``best.json`` (``record`` plus step and step_dir) first, then ``best``,
    the name pruning reads, last (each is one atomic put, as ``latest``)."""
    store = as_store(store)
    check_run(run)
    name = step_dir_name(step)
    body = {**record, "step": step, "step_dir": name}
    store.put_bytes(f"{run}/{BEST_RECORD_FILE}", json.dumps(body, indent=2, sort_keys=True).encode())
    store.put_bytes(f"{run}/{BEST_FILE}", (name + "\n").encode())


# ----------------------------------------------------------------------------------------------------------
# Load
