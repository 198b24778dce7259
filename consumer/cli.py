"""``dflash-consume``: one drafter-training process on one GPU (or the CPU).

Several consumers form one torch.distributed group when started with the env:// variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), e.g. by ``torchrun`` or ``ops/run_all.sh``.

Exit status (README "Errors and exit codes"): 0 when the spool is drained (or --max-steps reached) and the
final checkpoint is saved; 2 for a user or input error (bad flag, no GPU, a spool of another run or in use,
no S3 credentials, unreachable endpoint, no usable checkpoint), one line; 1 for a runtime failure, one line
(traceback with --log-level DEBUG); 130 when stopped by SIGINT/SIGTERM (after its stop checkpoint).

The flags are ConsumeConfig's fields (consumer/config.py); they are parsed into one ``ConsumeConfig`` and
validated before anything is touched, then consumer/launch.py places the process (device, spool bound and
locked) and the trainer runs. torch and the trainer are imported only after the flags parsed: ``--help``
and a bad flag answer at once, and a bad flag leaves the spool and the checkpoint store as they were.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from dflash.common.cli.exits import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, fail, one_line
from dflash.common.cli.flags import add_flags
from dflash.common.cli.help import DefaultsHelpFormatter, plain_text
from dflash.common.fault import fault_point
from dflash.common.target.checks import check_target
from dflash.consumer.config import PROG, ProcessConfig, add_train_flags, config_of
from dflash.consumer.launch import Launched, launch

log = logging.getLogger(PROG)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=plain_text(__doc__), formatter_class=DefaultsHelpFormatter
    )
    add_flags(p, ProcessConfig)
    add_train_flags(p)
    return p


def _build_trainer(launched: Launched):
    """The Trainer, or one line and the documented exit code for what stops it at start-up."""
    from dflash.common.checkpoints.layout import CheckpointCorruptError, CheckpointError
    from dflash.common.checkpoints.store import CheckpointStoreError
    from dflash.common.contract.spool import SpoolError
    from dflash.consumer.trainer import Trainer

    try:
        return Trainer(launched.train, device=launched.device)
    except CheckpointCorruptError as err:
        log.debug("traceback", exc_info=True)
        fail(
            PROG, f"{one_line(err)}; no usable checkpoint: fix or remove it, or start over with --resume none"
        )
    except (ValueError, SpoolError, OSError, CheckpointStoreError, CheckpointError) as err:
        log.debug("traceback", exc_info=True)
        fail(PROG, err)
    except KeyboardInterrupt:
        fail(PROG, "interrupted", EXIT_INTERRUPTED)
    except Exception as err:  # noqa: BLE001 - a runtime failure at start-up (e.g. the group's rendezvous)
        log.debug("traceback", exc_info=True)
        fail(PROG, f"{type(err).__name__}: {one_line(err)}", EXIT_FAILURE)


def _train(trainer) -> dict:
    """Run the training loop; how the run ended goes into its metrics (dflash-status reads it)."""
    try:
        summary = trainer.train()
        trainer.record_end({"event": "end", "stopped": trainer.stop_requested, **summary})
        return summary
    except KeyboardInterrupt:
        trainer.record_end({"event": "end", "stopped": True, "step": trainer.step})
        fail(PROG, "interrupted", EXIT_INTERRUPTED)
    except Exception as err:  # noqa: BLE001 - a runtime failure: one line; the traceback with DEBUG only
        log.debug("training failed", exc_info=True)
        error = f"{type(err).__name__}: {one_line(err)}"
        trainer.record_end({"event": "failed", "error": error, "step": trainer.step})
        fail(PROG, f"{type(err).__name__}: {one_line(err)}", EXIT_FAILURE)
    finally:
        trainer.close()


def _report(summary: dict, summary_json: str | None, stopped: bool) -> int:
    summary.pop("history", None)
    if summary_json:
        with open(summary_json.replace("{rank}", str(summary.get("rank", 0))), "w") as f:
            json.dump(summary, f, indent=2)
    log.info("done: %s", json.dumps(summary))
    lost = summary.get("samples_quarantined") or 0
    if lost:
        log.warning(
            "%d samples of %d quarantined shards were not trained (quarantine/ in the spool says why); "
            "the next launch of this run (the same command) produces and trains them",
            lost,
            summary.get("shards_quarantined", 0),
        )
    if stopped:
        print(
            f"{PROG}: stopped by a signal at step {summary.get('steps')} (checkpoint saved)", file=sys.stderr
        )
        return EXIT_INTERRUPTED
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    try:
        cfg = config_of(args)
    except ValueError as err:
        fail(PROG, err, EXIT_USAGE)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=cfg.process.log_level.upper(),
        format=f"%(asctime)s consumer[{rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:  # a missing or incomplete target folder is answered before the spool is bound
        check_target(cfg.train.target, tokenizer=False, what="--target")
    except ValueError as err:
        fail(PROG, err, EXIT_USAGE)
    fault_point(f"consumer{rank}", "start")
    launched = launch(cfg, rank)
    trainer = _build_trainer(launched)
    fault_point(f"consumer{rank}", "ready")  # the group joined, resumed, its feed claiming
    summary = _train(trainer)
    return _report(summary, cfg.process.summary_json, trainer.stop_requested)


if __name__ == "__main__":
    sys.exit(main())
