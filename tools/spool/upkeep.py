"""The writing side of ``dflash-spool``: ``prepare`` a spool before a launch, ``free`` a stopped run's shards,
and ``gc`` the abandoned spools under a root. Each refuses a spool a live process uses.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from dflash.common.contract.spool import Spool, SpoolError
from dflash.common.contract.spool_records import LOCK_PREFIX, describe_run
from dflash.common.metrics import format_bytes
from dflash.tools.spool.view import UserError, tree_bytes


def prepare(root: str, run: str, *, fresh: bool) -> str:
    """Make ``root`` ready for a new launch of ``run``; returns the line to print. The caller holds
    ``lock-launch`` (ops/run_all.sh). Refuses (UserError) a spool bound to another run unless ``fresh``,
    and any spool a live producer or consumer uses.

    Why discard the leftovers rather than reuse them: a consumer of the new launch may train a leftover
    shard before a producer of the new launch has looked at the spool; the producer would then re-produce
    those samples (they are in no checkpoint yet) and a second consumer of the group could train them
    again. Starting from an empty flow, the checkpoint's trained set is the only thing both sides read,
    so each untrained sample is produced and trained once; the price is re-producing at most one spool
    budget."""
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    try:
        spool = Spool(path)
        _refuse_if_in_use(spool)
        rec = spool.read_run()
        if rec is not None and rec.get("run") != run and not fresh:
            raise UserError(
                f"spool {spool.root} belongs to {describe_run(rec)}; this launch is run {run!r}: use another "
                "--spool, or --fresh-spool to discard it"
            )
        if fresh:
            for e in list(os.scandir(spool.root)):
                if not e.name.startswith(LOCK_PREFIX):
                    p = Path(e.path)
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p)
                    else:
                        p.unlink()
            spool = Spool(path)
            spool.bind_run({"run": run})
            return f"spool {spool.root}: fresh, bound to run {run!r}"
        gone = spool.discard_flow()
        spool.bind_run({"run": run})
    except SpoolError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"cannot prepare spool {root}: {e.strerror or e}") from None
    if rec is None:
        return f"spool {spool.root}: new, bound to run {run!r}"
    return (
        f"spool {spool.root}: run {run!r} continues; discarded {gone['shards']} shards ({gone['samples']} "
        "samples) left by its previous launch: producers re-produce what the checkpoint has not trained"
    )


def _refuse_if_in_use(spool: Spool) -> None:
    """UserError when a live producer or consumer holds one of the spool's locks (the launch lock is the
    caller's own: ops/run_all.sh holds it while it prepares or frees the spool)."""
    live = {k: v for k, v in spool.live_locks().items() if k != "launch"}
    if live:
        name, who = next(iter(live.items()))
        raise UserError(f"spool {spool.root} is in use by a live process: {who} holds lock-{name}")


def free(root: str) -> str:
    """Discard the shards of a spool no process uses: what a stopped or failed run holds in RAM, and what
    the next launch would discard anyway (``prepare``). The run record, the held-out shards and the
    quarantine reasons stay. Returns the line to print."""
    try:
        spool = Spool(Path(root), create=False)
        _refuse_if_in_use(spool)
        before = tree_bytes(spool.root)
        gone = spool.discard_flow()
        freed = before - tree_bytes(spool.root)
    except SpoolError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"cannot free spool {root}: {e.strerror or e}") from None
    return (
        f"spool {spool.root}: freed {gone['shards']} shard(s) ({gone['samples']} samples, {format_bytes(freed)}); "
        "the next launch re-produces what the checkpoint has not trained"
    )


DEFAULT_SPOOL_ROOT = "/dev/shm/dflash"
"""Where spools live unless --spool says otherwise (ops/run_all.sh, dflash-produce: /dev/shm/dflash/<run>)."""


def abandoned(spool_dir: Path, *, min_idle_s: float) -> str | None:
    """Why ``spool_dir`` may go ("no live process, idle 3h"), or None when something may still use it: a
    live lock (a launch, a producer, a consumer), a live heartbeat, or activity in the last
    ``min_idle_s`` (a launch that is starting holds no lock yet)."""
    sp = Spool(spool_dir, create=False)
    if sp.live_locks():
        return None
    if any(p["alive"] for p in sp.stats(heartbeat_timeout_s=min_idle_s)["processes"]):
        return None
    idle = time.time() - _newest_mtime(spool_dir)
    if idle < min_idle_s:
        return None
    run = (sp.read_run() or {}).get("run", "?")
    return f"run {run!r}, no live process, idle {_age(idle)}"


def _newest_mtime(root: Path) -> float:
    """The latest modification time of anything in ``root`` (entries vanishing meanwhile are skipped)."""
    newest, stack = root.stat().st_mtime, [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    newest = max(newest, st.st_mtime)
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
        except (FileNotFoundError, NotADirectoryError):
            continue
    return newest


def _age(s: float) -> str:
    return f"{s / 3600:.1f}h" if s >= 3600 else f"{s / 60:.0f}m" if s >= 60 else f"{s:.0f}s"


def gc(root: str, *, dry_run: bool, min_idle_s: float) -> str:
    """Remove the abandoned spools under ``root`` (a crashed or stopped run keeps its shards in RAM until
    then); returns the lines to print. Only folders that are spools are looked at."""
    base = Path(root)
    if not base.is_dir():
        return f"no spools: {root} does not exist"
    lines, gone, size_gone = [], 0, 0
    for d in sorted(p for p in base.iterdir() if p.is_dir() and not p.is_symlink()):
        try:
            why = abandoned(d, min_idle_s=min_idle_s)
        except SpoolError:
            continue  # not a spool
        size = tree_bytes(d)
        if why is None:
            lines.append(
                f"kept          {d}  {format_bytes(size)}  (in use or active in the last {_age(min_idle_s)})"
            )
            continue
        if not dry_run:
            shutil.rmtree(d, ignore_errors=True)
        gone, size_gone = gone + 1, size_gone + size
        lines.append(f"{'would remove' if dry_run else 'removed':<13} {d}  {format_bytes(size)}  ({why})")
    if not lines:
        return f"no spools under {root}"
    verb = "would free" if dry_run else "freed"
    return "\n".join([*lines, f"{gone} abandoned spool(s), {verb} {format_bytes(size_gone)}"])
