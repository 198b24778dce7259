"""The checkpoint layout in a store: file names, step directory names, the ``latest`` and ``best``
pointers, errors, and the helpers every reader and writer of it shares (docs/checkpoints.md)."""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.common.checkpoints.store import (
    CheckpointStore,
    StoreKeyNotFoundError,
    open_store,
)
from dflash.common.contract.sample_set import SampleSet

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


STEP_DIR = re.compile(r"^step-(\d{8,})$")


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


def as_store(store: CheckpointStore | str | Path) -> CheckpointStore:
    return store if isinstance(store, CheckpointStore) else open_store(store)


def check_run(run: str) -> None:
    if not isinstance(run, str) or not _RUN_NAME.match(run):
        raise ValueError(f"run name {run!r}: use letters, digits, '.', '_' and '-' (no '/')")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


def read_best_name(store: CheckpointStore | str, run: str) -> str | None:
    """The step dir ``<run>/best`` names, None if there is none; CheckpointCorruptError if garbage."""
    return _read_pointer(as_store(store), run, BEST_FILE)


def scan_steps(store: CheckpointStore, run: str) -> tuple[list[int], set[int]]:
    """(every step that has a step dir, ascending; the steps whose dir has a meta.json)."""
    steps, finished = set(), set()
    for key in store.list(f"{run}/"):
        parts = key[len(run) + 1 :].split("/")
        match = STEP_DIR.match(parts[0]) if len(parts) > 1 else None
        if match:
            steps.add(int(match.group(1)))
            if parts[1:] == [META_FILE]:
                finished.add(int(match.group(1)))
    return sorted(steps), finished


def _read_pointer(store: CheckpointStore, run: str, fname: str) -> str | None:
    """The step dir ``<run>/<fname>`` names, None if absent; CheckpointCorruptError if garbage."""
    try:
        raw = store.get_bytes(f"{run}/{fname}")
    except StoreKeyNotFoundError:
        return None
    name = raw.decode("utf-8", errors="replace").strip()
    if not STEP_DIR.match(name):
        raise CheckpointCorruptError(
            f"{store.url_for(run + '/' + fname)}: does not name a step dir: {name[:40]!r}"
        )
    return name


def read_latest_name(store: CheckpointStore, run: str) -> str | None:
    """The step dir ``latest`` names, None if there is no ``latest``; CheckpointCorruptError if garbage."""
    return _read_pointer(store, run, LATEST_FILE)
