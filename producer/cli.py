"""`dflash-produce`: start one producer process per GPU (or N CPU workers) and watch them.

    dflash-produce --gpus 0-3 --model Qwen/Qwen3-8B --dataset data.jsonl --spool /dev/shm/dflash/run1

The parent checks what it can up front (model config, tokenizer chat template, dataset columns, layer
ids) so that user errors are one clear line before any GPU is touched, registers the producer ids in the
spool (consumers then know how many DONE markers to wait for), spawns the workers and prints progress.
Exit status (the convention of every dflash CLI, README "Errors and exit codes"): 0 when every worker
finished; 2 for a user or input error (bad flag, missing GPU, a dataset with no trainable row, a spool of
another run or in use by a live launch), one line; 1 for a runtime failure, one line naming the failed
worker(s) (traceback only with --log-level DEBUG); 130 when stopped by SIGINT/SIGTERM (no DONE markers).
A launch refused (exit 2) after it made its spool, with nothing produced, removes that spool.

The flags are the fields of LaunchConfig, DataConfig, BucketConfig, ProducerConfig and TrunkCompileConfig
(producer/config.py); they are parsed into one ``ProduceConfig``, the only thing the launch reads. The
launch (transformers, datasets, the spool) is imported only after the flags are parsed and the model folder
checked: ``--help``, a bad flag and a missing model answer at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

from dflash.common.cli.exits import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, error_line, fail, one_line
from dflash.common.cli.flags import command_parser, from_args
from dflash.common.target.checks import check_target
from dflash.common.target.data import DataConfig
from dflash.producer.buckets import BucketConfig
from dflash.producer.config import (
    PROG,
    LaunchConfig,
    ProduceConfig,
    ProducerConfig,
    TrunkCompileConfig,
    UsageError,
)

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    return command_parser(
        PROG,
        "Run a frozen target over a chat dataset and spool K layers' hidden states.",
        LaunchConfig,
        DataConfig,
        BucketConfig,
        ProducerConfig,
        TrunkCompileConfig,
    )


def config_of(args: argparse.Namespace) -> ProduceConfig:
    """The launch's one config from the parsed flags; ValueError (one line) on a bad value."""
    launch = from_args(LaunchConfig, args)
    producer = from_args(
        ProducerConfig,
        args,
        data=from_args(DataConfig, args, min_loss_tokens=2 * launch.block_size),
        buckets=from_args(BucketConfig, args),
        compile_options=from_args(TrunkCompileConfig, args),
    )
    return ProduceConfig(launch=launch, producer=producer)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_intermixed_args(argv)
    try:
        cfg = config_of(args)
    except ValueError as err:
        fail(PROG, err, EXIT_USAGE)
    logging.basicConfig(level=cfg.launch.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # a missing or incomplete model folder is answered before torch and transformers load (seconds)
        check_target(args.model, what="--model")
    except ValueError as err:
        fail(PROG, f"cannot load target {args.model!r}: {one_line(err)}")
    spool_was_new = not os.path.lexists(cfg.launch.spool_dir)
    try:
        from dflash.producer.launch import prepare
        from dflash.producer.supervisor import supervise

        prepared = prepare(cfg)
        code = supervise(prepared, cfg.launch)
    except UsageError as err:
        fail(PROG, err)
    except KeyboardInterrupt:
        fail(PROG, "interrupted", EXIT_INTERRUPTED)
    except Exception as err:  # noqa: BLE001 - a runtime failure: one line, the traceback with DEBUG only
        log.debug("traceback", exc_info=True)
        fail(PROG, error_line(err), EXIT_FAILURE)
    if code == EXIT_USAGE and spool_was_new:  # refused after binding the spool (its lock still held)
        remove_unused_spool(cfg.launch.spool_dir)
    sys.exit(code)


SHARD_DIRS = ("tmp", "ready", "claimed", "acked", "quarantine", "eval")


def remove_unused_spool(spool_dir: str) -> None:
    """A launch refused as a user error (a dataset with nothing to train, found once the workers tokenized)
    leaves no spool it made itself: that spool would keep the refused launch's plan, and the corrected
    command on it would be refused as another plan. Only a spool that holds no shard in any state and no
    consumer's heartbeat (nobody else uses it) goes, with one line; anything else is left as it is."""
    root = Path(spool_dir)
    if any(f.is_file() for d in SHARD_DIRS for f in (root / d).rglob("*")):
        return
    if any((root / "state").glob("consumer-*")):
        return
    shutil.rmtree(root, ignore_errors=True)
    print(f"{PROG}: removed the spool {root} this launch made (nothing was produced)", file=sys.stderr)


if __name__ == "__main__":
    main()
