"""``dflash-consume``: one drafter-training process on one GPU (or the CPU).

Several consumers form one torch.distributed group when started with the env:// variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), e.g. by ``torchrun`` or ``ops/run_all.sh``.

Exit status (README "Errors and exit codes"): 0 when the spool is drained (or --max-steps reached) and the
final checkpoint is saved; 2 for a user or input error (bad flag, no GPU, a spool of another run or in use,
no S3 credentials, unreachable endpoint, no usable checkpoint), one line; 1 for a runtime failure, one line
(traceback with --log-level DEBUG); 130 when stopped by SIGINT/SIGTERM (after its stop checkpoint).

The flags are TrainConfig's fields (consumer/config.py) plus the three below. torch, the spool and the
trainer are imported only after the flags parsed: ``--help`` and a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass

from dflash.common.cli.exits import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, fail, one_line
from dflash.common.cli.flags import add_flags, from_args
from dflash.common.cli.help import DefaultsHelpFormatter, plain_text
from dflash.common.contract.spool_records import RUN_FILE
from dflash.common.target.checks import check_target
from dflash.consumer.config import TrainConfig

PROG = "dflash-consume"
log = logging.getLogger(PROG)


@dataclass(kw_only=True)
class ProcessFlags:
    """What this process is, beyond the training config."""

    gpu: str
    """GPU index (e.g. 5), or 'cpu'"""
    log_level: str = "INFO"
    """logging level (DEBUG adds tracebacks to errors)"""
    summary_json: str | None = None
    """write a JSON summary of the run here at the end ({rank} is replaced by the rank; default: none)"""
    spool_wait_s: float = 600.0
    """seconds to wait for the spool (and, without --run, its run record) to appear when the consumer
    starts before its producers; past it, exit 2 (0: do not wait)"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=plain_text(__doc__), formatter_class=DefaultsHelpFormatter
    )
    add_flags(p, ProcessFlags)
    add_flags(p, TrainConfig, defaults={"run": None})  # None: the spool's run (see _bind_spool)
    return p


def _device(gpu: str) -> str:
    """'cpu' or 'cuda:0' with CUDA_VISIBLE_DEVICES set to the one GPU this process owns."""
    if gpu == "cpu":
        return "cpu"
    if not gpu.isdigit():
        fail(PROG, f"--gpu must be a GPU index or 'cpu', got {gpu!r}")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before torch: nothing in this process can touch the others
    import torch

    if not torch.cuda.is_available():
        fail(PROG, f"--gpu {gpu}: no CUDA device is visible (use --gpu cpu)")
    return "cuda:0"


def await_spool(
    spool_dir: str,
    need_run: bool,
    wait_s: float,
    *,
    sleep=time.sleep,
    clock=time.monotonic,
    every_s: float = 30.0,
) -> None:
    """Return once ``spool_dir`` exists; when it did not at the call, also its run record when
    ``need_run`` (a consumer without --run takes the run the producers record, never a guess). Exit 2
    with one line after ``wait_s``.

    Why: processes may start in any order (a consumer GPU free before the producers'); waiting says so
    once and then every ``every_s``, so the wait is never silent."""

    if os.path.isdir(spool_dir):
        return  # there before us: bound as it is (a spool no producer bound yet takes --run or "default")

    def ready() -> bool:
        if not os.path.isdir(spool_dir):
            return False
        return not need_run or os.path.isfile(os.path.join(spool_dir, "state", RUN_FILE))

    t0 = said = clock()
    if wait_s > 0:
        what = "the spool" + (" and its run record" if need_run else "")
        log.info(
            "waiting for %s at %s (start dflash-produce; --spool-wait-s %g ends the wait)",
            what,
            spool_dir,
            wait_s,
        )
        while not ready() and clock() - t0 < wait_s:
            sleep(min(1.0, max(0.0, wait_s - (clock() - t0))))
            if clock() - said >= every_s and not ready():
                said = clock()
                log.info("still waiting for %s at %s (%.0f s of %g)", what, spool_dir, said - t0, wait_s)
    if not os.path.isdir(spool_dir):
        waited = f" after waiting {wait_s:g} s" if wait_s > 0 else ""
        fail(
            PROG,
            f"--spool {spool_dir}: no such directory{waited} (start the producers first, or create it; --spool-wait-s)",
        )
    if not ready():
        fail(
            PROG,
            f"--spool {spool_dir}: no run recorded after waiting {wait_s:g} s (no producer bound it; pass --run)",
        )


def _bind_spool(spool_dir: str, run: str | None, rank: str):
    """(run name, lock): the spool's run (or ours, checked against it) and this rank's launch lock, held
    until the process exits (one consumer group per spool at a time)."""
    from dflash.common.contract.spool import Spool, SpoolError
    from dflash.common.contract.spool_records import SpoolBusyError

    try:
        spool = Spool(spool_dir)
        run = run or (spool.read_run() or {}).get("run") or "default"
        spool.bind_run({"run": run}, who="this consumer")
        return run, spool.acquire_lock(f"consumer-r{rank}", f"dflash-consume rank {rank} of run {run!r}")
    except SpoolBusyError as err:
        fail(PROG, f"{err}; this is run {run!r}")
    except (ValueError, SpoolError, OSError) as err:
        fail(PROG, err)


def _build_trainer(cfg: TrainConfig):
    """The Trainer, or one line and the documented exit code for what stops it at start-up."""
    from dflash.common.checkpoints.layout import CheckpointCorruptError, CheckpointError
    from dflash.common.checkpoints.store import CheckpointStoreError
    from dflash.common.contract.spool import SpoolError
    from dflash.consumer.trainer import Trainer

    try:
        return Trainer(cfg)
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
    """Run the training loop; the run's end goes into the metrics (quarantine losses included)."""
    try:
        summary = trainer.train()
        if trainer.metrics is not None:  # dflash-status reads how each rank ended: finished or stopped
            stopped = bool(getattr(trainer, "_stop_requested", False))
            trainer.metrics.write(
                {"event": "end", "time": time.time(), "stopped": stopped, **{k: v for k, v in summary.items() if k != "history"}}
            )  # fmt: skip
        return summary
    except KeyboardInterrupt:
        _say_ended(trainer, {"event": "end", "stopped": True})
        fail(PROG, "interrupted", EXIT_INTERRUPTED)
    except Exception as err:  # noqa: BLE001 - a runtime failure: one line; the traceback with DEBUG only
        log.debug("training failed", exc_info=True)
        _say_ended(trainer, {"event": "failed", "error": f"{type(err).__name__}: {one_line(err)}"})
        fail(PROG, f"{type(err).__name__}: {one_line(err)}", EXIT_FAILURE)
    finally:
        trainer.close()


def _say_ended(trainer, event: dict) -> None:
    """The metrics event of an end without a summary (dflash-status shows the rank as failed or stopped)."""
    if getattr(trainer, "metrics", None) is not None:
        try:
            trainer.metrics.write({**event, "time": time.time(), "step": trainer.step})
        except OSError:
            pass  # the run dir itself may be what failed


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
            lost, summary.get("shards_quarantined", 0),
        )  # fmt: skip
    if stopped:
        print(
            f"{PROG}: stopped by a signal at step {summary.get('steps')} (checkpoint saved)", file=sys.stderr
        )
        return EXIT_INTERRUPTED
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s consumer[{rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    device = _device(args.gpu)
    await_spool(args.spool, need_run=args.run is None, wait_s=args.spool_wait_s)
    run, _lock = _bind_spool(args.spool, args.run, rank)
    try:
        cfg = from_args(TrainConfig, args, run=run, device=device)
        check_target(cfg.target, tokenizer=False, what="--target")
    except ValueError as err:
        fail(PROG, err, EXIT_USAGE)
    trainer = _build_trainer(cfg)
    summary = _train(trainer)
    return _report(summary, args.summary_json, getattr(trainer, "_stop_requested", False))


if __name__ == "__main__":
    sys.exit(main())
