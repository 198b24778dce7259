"""Everything a consumer process does between a valid ``ConsumeConfig`` and its trainer: the device it
owns, the spool waited for, bound to the run and locked for this rank.

The config is validated before anything here runs (consumer/cli.py), so a bad flag never binds a spool.
Each step that stops the launch says one line and exits 2 (``fail``): a GPU that is not there, a spool
that never appeared, a spool of another run or in use by another consumer group.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace

from dflash.common.cli.exits import fail
from dflash.common.contract.liveness import SpoolLock
from dflash.common.contract.spool import Spool, SpoolError
from dflash.common.contract.spool_records import RUN_FILE, SpoolBusyError
from dflash.consumer.config import DEFAULT_RUN, PROG, ConsumeConfig, TrainConfig

log = logging.getLogger(PROG)


@dataclass(frozen=True)
class Launched:
    """Where one consumer process stands once launched (runtime state, not flags): the training config
    with the run the spool records, the device it trains on, and its rank's lock on the spool."""

    train: TrainConfig
    device: str
    """'cpu', or 'cuda:0' with CUDA_VISIBLE_DEVICES naming the one GPU this process owns."""
    lock: SpoolLock
    """Held until the process exits: one consumer group per spool at a time."""


def select_device(gpu: str) -> str:
    """'cpu' or 'cuda:0' with CUDA_VISIBLE_DEVICES set to the one GPU this process owns (``gpu`` is a
    validated ``ProcessConfig.gpu``)."""
    if gpu == "cpu":
        return "cpu"
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before torch: nothing in this process can touch the others
    import torch  # not at the top: CUDA_VISIBLE_DEVICES must be set before torch initialises CUDA

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
            f"--spool {spool_dir}: no such directory{waited} (start the producers first, or create it; "
            "--spool-wait-s)",
        )
    if not ready():
        fail(
            PROG,
            f"--spool {spool_dir}: no run recorded after waiting {wait_s:g} s (no producer bound it; "
            "pass --run)",
        )


def bind_spool(spool_dir: str, run: str | None, rank: str) -> tuple[str, SpoolLock]:
    """(run name, lock): the spool's run (or ours, checked against it) and this rank's launch lock, held
    until the process exits (one consumer group per spool at a time)."""
    try:
        spool = Spool(spool_dir)
        run = run or (spool.read_run() or {}).get("run") or DEFAULT_RUN
        spool.bind_run({"run": run}, who="this consumer")
        return run, spool.acquire_lock(f"consumer-r{rank}", f"dflash-consume rank {rank} of run {run!r}")
    except SpoolBusyError as err:
        fail(PROG, f"{err}; this is run {run!r}")
    except (ValueError, SpoolError, OSError) as err:
        fail(PROG, err)


def launch(cfg: ConsumeConfig, rank: str) -> Launched:
    """The device, then the spool waited for, bound and locked: what the trainer starts from."""
    device = select_device(cfg.process.gpu)
    train = cfg.train
    await_spool(train.spool, need_run=train.run is None, wait_s=cfg.process.spool_wait_s)
    run, lock = bind_spool(train.spool, train.run, rank)
    return Launched(train=replace(train, run=run), device=device, lock=lock)
