"""Reading checkpoints: the latest good one (falling back past corrupt ones, every file checked against the
sha256 in meta.json), a given step, the steps a store holds, the trained-sample set producers skip, and
one checkpoint's weights alone (export, eval --watch)."""

from __future__ import annotations

import json
import logging
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dflash.common.checkpoints.layout import (
    DATA_FILES,
    FORMAT,
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    STEP_DIR,
    TRAINED_FILE,
    VERSION,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    LoadedCheckpoint,
    as_store,
    check_run,
    file_sha256,
    read_latest_name,
    scan_steps,
    step_dir_name,
)
from dflash.common.checkpoints.store import CheckpointStore, StoreKeyNotFoundError
from dflash.common.contract.sample_set import SampleSet, SampleSetFormatError
from dflash.common.redact import redact

log = logging.getLogger(__name__)


def load_checkpoint_weights(store_url: str, run: str, step: int | None = None) -> tuple[dict, dict]:
    """(model_state, meta) of one checkpoint, downloading and verifying ONLY model.safetensors and meta.json
    (the optimizer state is twice the weights' size and export does not need it). Default step: `latest`.
    No fallback to an older checkpoint: an export must be of exactly the checkpoint asked for."""

    store = as_store(store_url)
    check_run(run)
    if step is None:
        name = read_latest_name(store, run)
        if name is None:
            raise CheckpointNotFoundError(f"no checkpoint in {store.url_for(run)} (no 'latest')")
    else:
        name = step_dir_name(step)
    meta = _read_meta(store, run, name)
    with tempfile.TemporaryDirectory(prefix="dflash-export-") as tmp:
        path = _fetch_verified(store, run, name, MODEL_FILE, meta, Path(tmp, MODEL_FILE))
        return load_file(str(path)), meta


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


def list_steps(store: CheckpointStore | str, run: str) -> list[int]:
    """Steps that have a step directory (finished or not), ascending."""
    store = as_store(store)
    check_run(run)
    return scan_steps(store, run)[0]


def finished_steps(store: CheckpointStore | str, run: str) -> list[int]:
    """Steps whose directory has a ``meta.json`` (uploaded after every data file: complete), ascending."""
    store = as_store(store)
    check_run(run)
    return sorted(scan_steps(store, run)[1])


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
    store = as_store(store)
    check_run(run)
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
    digest = file_sha256(dest)
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
    store = as_store(store)
    check_run(run)
    if step is None:
        name = read_latest_name(store, run)
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
        latest = read_latest_name(store, run)
    except CheckpointCorruptError as err:
        log.error("%s; trying the step dirs newest first", redact(str(err)))
        return [step_dir_name(s) for s in reversed(steps)], True
    if latest is None:
        return [step_dir_name(s) for s in reversed(steps)], False
    latest_step = int(STEP_DIR.match(latest).group(1))
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
    store = as_store(store)
    check_run(run)
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
    store = as_store(store_url)
    check_run(run)

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
