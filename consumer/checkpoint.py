"""Checkpoints of the drafter's training state in a :mod:`dflash.common.checkpoint_store` store.

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

``best`` and ``evals/`` are written only by ``dflash-eval --watch`` (consumer/eval_watch.py), never by
the trainer; the trainer only reads ``best``: pruning keeps the step it names (docs/checkpoints.md).
A checkpoint is complete, for every reader, once its ``meta.json`` exists (it is uploaded after the data).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import re
import socket
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.common.checkpoint_store import (
    CheckpointStore,
    CheckpointStoreError,
    StoreKeyNotFoundError,
    open_store,
    redact,
    redact_config,
)
from dflash.common.sample_set import SampleSet, SampleSetFormatError

log = logging.getLogger(__name__)

FORMAT = "dflash-checkpoint"
VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
TRAINED_FILE = "trained.bin"
META_FILE = "meta.json"
LATEST_FILE = "latest"
BEST_FILE = "best"
BEST_RECORD_FILE = "best.json"
EVALS_DIR = "evals"
DATA_FILES = (MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE, TRAINED_FILE)
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message is one line."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files are missing, truncated or do not match the sha256 in meta.json."""


class CheckpointNotFoundError(CheckpointError):
    """An explicitly requested step does not exist."""


@dataclass(kw_only=True)
class LoadedCheckpoint:
    step: int
    epoch: int
    url: str
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict
    scheduler_state: dict
    rng_state: dict
    trained: SampleSet
    config: dict
    """The config as saved (credentials redacted)."""
    meta: dict


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _as_store(store: CheckpointStore | str | Path) -> CheckpointStore:
    return store if isinstance(store, CheckpointStore) else open_store(store)


def _check_run(run: str) -> None:
    if not isinstance(run, str) or not _RUN_NAME.match(run):
        raise ValueError(f"run name {run!r}: use letters, digits, '.', '_' and '-' (no '/')")


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


def restore_rng_state(state: dict) -> None:
    """Inverse of :func:`capture_rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npst = state["numpy"]
    keys = npst["keys"].numpy().astype(np.uint32)
    np.random.set_state(
        (npst["bit_generator"], keys, npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if len(cuda) != count:
            log.warning(
                "checkpoint has CUDA RNG states for %d devices, this process sees %d", len(cuda), count
            )
        for i, s in enumerate(cuda[:count]):
            torch.cuda.set_rng_state(s.cpu(), i)


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


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
    store = _as_store(store)
    _check_run(run)
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
    try:
        latest = _read_latest_name(store, run)
    except CheckpointCorruptError:
        latest = None
    if latest != name and store.list(step_dir + "/"):
        log.info("removing leftovers of an unfinished checkpoint in %s", store.url_for(step_dir))
        store.delete_prefix(step_dir + "/")

    from safetensors.torch import save_file

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dflash-ckpt-") as tmp:
        local = {f: Path(tmp, f) for f in DATA_FILES}
        save_file(tensors, str(local[MODEL_FILE]), metadata={"format": "pt"})
        torch.save(optimizer_state, local[OPTIMIZER_FILE])
        torch.save(scheduler_state, local[SCHEDULER_FILE])
        torch.save(rng_state, local[RNG_FILE])
        local[TRAINED_FILE].write_bytes(trained.to_bytes())
        files = {}
        for fname, path in local.items():
            files[fname] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
            store.put_file(f"{step_dir}/{fname}", path)
    meta = {
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
    store.put_bytes(f"{step_dir}/{META_FILE}", json.dumps(meta, indent=2, sort_keys=True).encode())
    store.put_bytes(f"{run}/{LATEST_FILE}", (name + "\n").encode())
    total = sum(f["bytes"] for f in files.values())
    log.info(
        "saved checkpoint %s (%.1f MB in %.1fs)",
        store.url_for(step_dir),
        total / 1e6,
        time.monotonic() - started,
    )
    _prune(store, run, step, keep_last)
    return store.url_for(step_dir)


def _prune(store: CheckpointStore, run: str, step: int, keep_last: int) -> None:
    """Keep the ``keep_last`` newest finished step dirs up to ``step`` (the new one included).

    Deleted: older dirs beyond that, older unfinished dirs (no meta.json: failed uploads, which would
    otherwise count towards k), and every dir ABOVE ``step``: those belong to a timeline this run abandoned
    when it resumed from an older checkpoint, and no fallback must ever land on them.
    The step that ``best`` names (dflash-eval --watch) is kept too, unless it is above ``step``.
    """
    try:
        steps, finished = _scan_steps(store, run)
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
    best = None if name is None else int(_STEP_DIR.match(name).group(1))
    return {best} if best is not None and best <= step else set()


# ----------------------------------------------------------------------------------------------------------
# Best (written by dflash-eval --watch)


def read_best_name(store: CheckpointStore | str, run: str) -> str | None:
    """The step dir ``<run>/best`` names, None if there is none; CheckpointCorruptError if garbage."""
    return _read_pointer(_as_store(store), run, BEST_FILE)


def write_best(store: CheckpointStore | str, run: str, step: int, record: dict) -> None:
    """Point ``best`` at ``step``: ``best.json`` (``record`` plus step and step_dir) first, then ``best``,
    the name pruning reads, last (each is one atomic put, as ``latest``)."""
    store = _as_store(store)
    _check_run(run)
    name = step_dir_name(step)
    body = {**record, "step": step, "step_dir": name}
    store.put_bytes(f"{run}/{BEST_RECORD_FILE}", json.dumps(body, indent=2, sort_keys=True).encode())
    store.put_bytes(f"{run}/{BEST_FILE}", (name + "\n").encode())


# ----------------------------------------------------------------------------------------------------------
# Load


def _scan_steps(store: CheckpointStore, run: str) -> tuple[list[int], set[int]]:
    """(every step that has a step dir, ascending; the steps whose dir has a meta.json)."""
    steps, finished = set(), set()
    for key in store.list(f"{run}/"):
        parts = key[len(run) + 1 :].split("/")
        match = _STEP_DIR.match(parts[0]) if len(parts) > 1 else None
        if match:
            steps.add(int(match.group(1)))
            if parts[1:] == [META_FILE]:
                finished.add(int(match.group(1)))
    return sorted(steps), finished


def list_steps(store: CheckpointStore | str, run: str) -> list[int]:
    """Steps that have a step directory (finished or not), ascending."""
    store = _as_store(store)
    _check_run(run)
    return _scan_steps(store, run)[0]


def finished_steps(store: CheckpointStore | str, run: str) -> list[int]:
    """Steps whose directory has a ``meta.json`` (uploaded after every data file: complete), ascending."""
    store = _as_store(store)
    _check_run(run)
    return sorted(_scan_steps(store, run)[1])


def _read_pointer(store: CheckpointStore, run: str, fname: str) -> str | None:
    """The step dir ``<run>/<fname>`` names, None if absent; CheckpointCorruptError if garbage."""
    try:
        raw = store.get_bytes(f"{run}/{fname}")
    except StoreKeyNotFoundError:
        return None
    name = raw.decode("utf-8", errors="replace").strip()
    if not _STEP_DIR.match(name):
        raise CheckpointCorruptError(
            f"{store.url_for(run + '/' + fname)}: does not name a step dir: {name[:40]!r}"
        )
    return name


def _read_latest_name(store: CheckpointStore, run: str) -> str | None:
    """The step dir ``latest`` names, None if there is no ``latest``; CheckpointCorruptError if garbage."""
    return _read_pointer(store, run, LATEST_FILE)


def _read_meta(store: CheckpointStore, run: str, name: str) -> dict:
    url = store.url_for(f"{run}/{name}")
    try:
        meta = json.loads(store.get_bytes(f"{run}/{name}/{META_FILE}"))
    except StoreKeyNotFoundError:
        raise CheckpointCorruptError(
            f"checkpoint {url}: {META_FILE} is missing (upload did not finish?)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointCorruptError(f"checkpoint {url}: {META_FILE} is not valid JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointCorruptError(f"checkpoint {url}: {META_FILE} is not a {FORMAT} file")
    if meta.get("version") != VERSION:
        raise CheckpointCorruptError(
            f"checkpoint {url}: format version {meta.get('version')!r}, this code reads {VERSION}"
        )
    files = meta.get("files")
    missing = [f for f in DATA_FILES if not isinstance(files, dict) or f not in files]
    if missing:
        raise CheckpointCorruptError(f"checkpoint {url}: {META_FILE} lists no {', '.join(missing)}")
    return meta


def read_checkpoint_meta(store: CheckpointStore | str, run: str, step: int) -> dict:
    """The checked meta.json of one step (CheckpointCorruptError when missing or not ours): small, so
    watchers can poll it (the model file's sha256 in it identifies the checkpoint's weights)."""
    store = _as_store(store)
    _check_run(run)
    return _read_meta(store, run, step_dir_name(step))


def _fetch_verified(store: CheckpointStore, run: str, name: str, fname: str, meta: dict, dest: Path) -> Path:
    url = store.url_for(f"{run}/{name}/{fname}")
    try:
        store.get_file(f"{run}/{name}/{fname}", dest)
    except StoreKeyNotFoundError:
        raise CheckpointCorruptError(f"checkpoint file {url} is missing") from None
    expected = meta["files"][fname]
    size = dest.stat().st_size
    if size != expected.get("bytes"):
        raise CheckpointCorruptError(
            f"checkpoint file {url}: {size} bytes, meta.json says {expected.get('bytes')}"
        )
    digest = _sha256(dest)
    if digest != expected.get("sha256"):
        raise CheckpointCorruptError(
            f"checkpoint file {url}: sha256 {digest[:12]}… does not match meta.json {str(expected.get('sha256'))[:12]}…"
        )
    return dest


def _torch_load(path: Path, url: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # sha matched, so this is a file written by an incompatible writer
        raise CheckpointCorruptError(
            f"checkpoint file {url}: cannot be loaded: {redact(str(err)).splitlines()[0]}"
        ) from None


def _load_dir(store: CheckpointStore, run: str, name: str) -> LoadedCheckpoint:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    meta = _read_meta(store, run, name)
    url = store.url_for(f"{run}/{name}")
    with tempfile.TemporaryDirectory(prefix="dflash-ckpt-") as tmp:
        paths = {f: _fetch_verified(store, run, name, f, meta, Path(tmp, f)) for f in DATA_FILES}
        try:
            model_state = load_file(str(paths[MODEL_FILE]))
        except SafetensorError as err:
            raise CheckpointCorruptError(f"checkpoint file {url}/{MODEL_FILE}: {err}") from None
        try:
            trained = SampleSet.from_bytes(paths[TRAINED_FILE].read_bytes())
        except SampleSetFormatError as err:
            raise CheckpointCorruptError(f"checkpoint file {url}/{TRAINED_FILE}: {err}") from None
        return LoadedCheckpoint(
            step=int(meta["step"]),
            epoch=int(meta["epoch"]),
            url=url,
            model_state=model_state,
            optimizer_state=_torch_load(paths[OPTIMIZER_FILE], f"{url}/{OPTIMIZER_FILE}"),
            scheduler_state=_torch_load(paths[SCHEDULER_FILE], f"{url}/{SCHEDULER_FILE}"),
            rng_state=_torch_load(paths[RNG_FILE], f"{url}/{RNG_FILE}"),
            trained=trained,
            config=meta.get("config", {}),
            meta=meta,
        )


def load_checkpoint(
    store: CheckpointStore | str, run: str, *, step: int | None = None
) -> LoadedCheckpoint | None:
    """Load ``step`` (default: the one ``latest`` names), verifying every file's size and sha256.

    Returns None when ``step`` is None and the run has no ``latest``. Raises CheckpointCorruptError for a
    missing/corrupt file, CheckpointNotFoundError for a ``step`` that has no directory, and
    CheckpointStoreError for storage failures (network, permissions), which are NOT a reason to fall back.
    """
    store = _as_store(store)
    _check_run(run)
    if step is None:
        name = _read_latest_name(store, run)
        if name is None:
            return None
    else:
        name = step_dir_name(step)
        if not store.list(f"{run}/{name}/"):
            raise CheckpointNotFoundError(f"no checkpoint {name} in {store.url_for(run)}")
    return _load_dir(store, run, name)


def _candidates(store: CheckpointStore, run: str) -> tuple[list[str], bool]:
    """Step dirs to try, best first, and whether a ``latest`` existed: latest, then older dirs descending.
    Dirs newer than latest are unfinished uploads and never candidates."""
    steps = list_steps(store, run)
    try:
        latest = _read_latest_name(store, run)
    except CheckpointCorruptError as err:
        log.error("%s; trying the step dirs newest first", redact(str(err)))
        return [step_dir_name(s) for s in reversed(steps)], True
    if latest is None:
        return [step_dir_name(s) for s in reversed(steps)], False
    latest_step = int(_STEP_DIR.match(latest).group(1))
    return [latest] + [step_dir_name(s) for s in reversed(steps) if s < latest_step], True


def _first_good(store: CheckpointStore, run: str, load: Any, what: str) -> Any:
    names, had_latest = _candidates(store, run)
    failures = []
    for i, name in enumerate(names):
        try:
            return load(name)
        except CheckpointCorruptError as err:
            failures.append(name)
            then = f"falling back to {names[i + 1]}" if i + 1 < len(names) else "no older checkpoint left"
            log.error("%s; %s", redact(str(err)), then)
    if not had_latest:
        if failures:
            log.warning(
                "run %s has only unfinished checkpoints (%s): starting fresh", run, ", ".join(failures)
            )
        return None
    raise CheckpointCorruptError(
        f"no usable checkpoint for {what} in {store.url_for(run)} (tried {', '.join(failures) or 'none'})"
    )


def load_latest_good(store: CheckpointStore | str, run: str) -> LoadedCheckpoint | None:
    """``--resume auto``: the newest checkpoint that verifies, trying ``latest`` and then older step dirs.

    None when the run has no finished checkpoint. CheckpointCorruptError when checkpoints were finished but
    none verifies (starting fresh would silently throw the run away).
    """
    store = _as_store(store)
    _check_run(run)
    return _first_good(store, run, lambda name: _load_dir(store, run, name), "resume")


def read_trained_set(
    store_url: CheckpointStore | str, run: str, *, full_verify: bool = False
) -> SampleSet | None:
    """The trained-sample set of the checkpoint ``load_latest_good`` would resume from (for producers).

    By default verifies meta.json, trained.bin's sha256 and the presence and size of the other files,
    without downloading the weights (GBs, once per producer). That catches unfinished and truncated
    uploads; a same-size corruption of another file is caught only with ``full_verify=True`` (which
    downloads and hashes everything, like the consumer). When a checkpoint is replaced while this reads
    it, the fallback is an older one, whose set is a subset: producers then re-produce a few trained
    samples, never skip untrained ones.
    """
    store = _as_store(store_url)
    _check_run(run)

    def load(name: str) -> SampleSet:
        meta = _read_meta(store, run, name)
        with tempfile.TemporaryDirectory(prefix="dflash-ckpt-") as tmp:
            for fname in DATA_FILES if full_verify else ():
                _fetch_verified(store, run, name, fname, meta, Path(tmp, fname))
            for fname in () if full_verify else DATA_FILES:
                key = f"{run}/{name}/{fname}"
                try:
                    size = store.size(key)
                except StoreKeyNotFoundError:
                    raise CheckpointCorruptError(f"checkpoint file {store.url_for(key)} is missing") from None
                if size != meta["files"][fname].get("bytes"):
                    raise CheckpointCorruptError(
                        f"checkpoint file {store.url_for(key)}: {size} bytes, meta.json says "
                        f"{meta['files'][fname].get('bytes')}"
                    )
            path = Path(tmp, TRAINED_FILE)
            if not full_verify:
                _fetch_verified(store, run, name, TRAINED_FILE, meta, path)
            try:
                return SampleSet.from_bytes(path.read_bytes())
            except SampleSetFormatError as err:
                raise CheckpointCorruptError(
                    f"checkpoint file {store.url_for(f'{run}/{name}')}: {err}"
                ) from None

    return _first_good(store, run, load, "the trained-sample set")
