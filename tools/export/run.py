"""``dflash-export``: one training checkpoint (weights and meta.json only, verified) -> a HF-style drafter
folder in the public DFlash format (common/drafter/hf_format.py writes it); ``--check FOLDER`` validates a
folder against the serving loaders (common/drafter/serving_check.py).

Tokenizer files: copied from the target folder (``--target``, else the checkpoint's recorded
``train.target``). When that is not a readable folder here (a hub id, a path of the training machine), the
export says so in one line and is written without them: the weights and config are what serving needs, and
failing would make a remote checkpoint unexportable from a machine without the target.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash.common.checkpoints.layout import STEP_DIR, CheckpointError
from dflash.common.checkpoints.load import load_checkpoint_weights
from dflash.common.checkpoints.store import CheckpointStoreError
from dflash.common.cli.exits import EXIT_USAGE, fail
from dflash.common.cli.logs import log_to_console
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.hf_format import TOKENIZER_FILES, ExportError, export_drafter
from dflash.common.drafter.serving_check import check_folder
from dflash.tools.export.config import PROG, ExportConfig

log = logging.getLogger(__name__)


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_checkpoint_url(url: str, *, run: str | None, step: int | None) -> tuple[str, str, int | None]:
    """(store url, run, step) from the CLI: with --run, `url` is the store; without, `url` ends in the run
    (`<store>/<run>`) or in a step directory (`<store>/<run>/step-<n>`)."""
    if run is not None:
        return url, run, step
    parts = url.rstrip("/").rsplit("/", 1)
    if len(parts) != 2 or not parts[1] or parts[0].endswith(":/"):
        raise ExportError(f"{url}: expected <store>/<run> or <store>/<run>/step-<n> (or pass --run)")
    head, last = parts
    match = STEP_DIR.match(last)
    if match is None:
        return head, last, step
    if step is not None and step != int(match.group(1)):
        raise ExportError(f"--step {step} contradicts the step directory {last}")
    store_url, _, run_name = head.rpartition("/")
    if not store_url or not run_name or store_url.endswith(":/"):
        raise ExportError(f"{url}: a step directory url needs <store>/<run>/step-<n>")
    return store_url, run_name, int(match.group(1))


def checkpoint_drafter_config(meta: dict, run: str) -> DrafterConfig:
    """The drafter's shape as a checkpoint's meta.json records it (``config.drafter``)."""
    saved = meta.get("config") or {}
    if not isinstance(saved.get("drafter"), dict):
        raise ExportError(
            f"checkpoint {run} step {meta.get('step')}: meta.json config has no 'drafter' entry"
        )
    try:
        return DrafterConfig.from_dict(saved["drafter"])
    except (TypeError, ValueError) as err:
        raise ExportError(f"checkpoint {run} step {meta.get('step')}: bad drafter config: {err}") from None


def tokenizer_source(target: str | None) -> Path | None:
    """The target folder to copy tokenizer files from, or None (said in one line) when it is not readable."""
    if not target:
        log.warning("no target recorded in the checkpoint and no --target: tokenizer files not copied")
        return None
    path = Path(target)
    if not path.is_dir() or not any((path / name).is_file() for name in TOKENIZER_FILES):
        log.warning(
            "target %s is not a readable folder with tokenizer files here: tokenizer files not copied "
            "(pass --target DIR)",
            target,
        )
        return None
    return path


def export_checkpoint(
    store_url: str,
    run: str,
    out_dir: str | Path,
    *,
    step: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
    target: str | None = None,
) -> Path:
    """Export one training checkpoint (the drafter config is the one recorded in its meta.json); the
    tokenizer files come from ``target`` (default: the checkpoint's recorded target)."""
    model_state, meta = load_checkpoint_weights(store_url, run, step)
    config = checkpoint_drafter_config(meta, run)
    recorded = ((meta.get("config") or {}).get("train") or {}).get("target")
    metadata = {"dflash_run": run, "dflash_step": str(meta.get("step"))}
    if recorded:
        metadata["dflash_target"] = str(recorded)
    return export_drafter(
        model_state,
        config,
        out_dir,
        dtype=dtype,
        metadata=metadata,
        overwrite=overwrite,
        tokenizer_dir=tokenizer_source(target or recorded),
    )


def run(cfg: ExportConfig) -> int:
    """Export, print the folder; exit 2 with one line on a user or input error."""
    log_to_console("export")
    try:
        store_url, run_name, step = parse_checkpoint_url(cfg.checkpoint, run=cfg.run, step=cfg.step)
        out = export_checkpoint(
            store_url,
            run_name,
            cfg.out_dir,
            step=step,
            dtype=DTYPES[cfg.dtype],
            overwrite=cfg.overwrite,
            target=cfg.target,
        )
    except (ExportError, CheckpointError, CheckpointStoreError, ValueError, OSError) as err:
        fail(PROG, err)
    print(out)
    return 0


def run_check(cfg: ExportConfig) -> int:
    """``--check FOLDER [--target DIR]``: print the findings and each loader's verdict; 0 when every loader
    would load the folder as trained, 2 (the usage/input-error code) when not."""
    for flag, folder in (("--check", cfg.check), ("--target", cfg.target)):
        if folder is not None and not Path(folder).is_dir():
            fail(PROG, f"{flag} {folder}: no such folder")
    try:
        report = check_folder(cfg.check, cfg.target)
    except OSError as err:
        fail(PROG, err)
    print(report.render())
    return 0 if report.ok else EXIT_USAGE
