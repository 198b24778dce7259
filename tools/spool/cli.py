"""dflash-spool: look at a spool or a shard, and clean up after runs.

    dflash-spool stats DIR [--json]     shards and bytes per state x bucket, claims per consumer,
                                        process heartbeats with their counters and rates, DONE producers
    dflash-spool inspect SHARD [--json] a shard's metadata, sample/token counts, codec, bytes on disk
                                        and compression ratio (raw bytes with the hidden states as bf16
                                        / bytes on disk; an FP8 shard's ratio as stored beside it)

    dflash-spool prepare DIR --run NAME [--fresh]
                                        before a launch (ops/run_all.sh, holding the spool's launch lock):
                                        refuse a spool of another run or one a live process uses; discard
                                        what a previous launch left in the flow (see docs/reliability.md)
    dflash-spool free DIR               after a launch stopped or failed (ops/run_all.sh does it): discard
                                        its shards, the RAM a spool holds; keep its records
    dflash-spool gc [ROOT] [--dry-run]  remove the abandoned spools under ROOT (/dev/shm/dflash): no live
                                        process, nothing touched for --min-idle-s

stats and inspect are read-only (``Spool(create=False)``), so they are safe on a live run. User errors
print one line on stderr and exit with status 2, like argparse's own errors. This module is the command
line; the commands are view.py (stats, inspect), upkeep.py (prepare, free, gc) and
audit.py (audit).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflash.common.cli.exits import EXIT_USAGE, fail, print_error
from dflash.common.cli.flags import add_flags, flag
from dflash.common.cli.help import DefaultsHelpFormatter
from dflash.tools.spool.audit import audit, exactly_once, format_report
from dflash.tools.spool.upkeep import DEFAULT_SPOOL_ROOT, free, gc, prepare
from dflash.tools.spool.view import UserError, format_inspect, format_stats, shard_info, spool_stats

PROG = "dflash-spool"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line (argparse prints the usage too), exit 2
        fail(self.prog, message, EXIT_USAGE)


@dataclass(kw_only=True)
class StatsArgs:
    dir: str = field(metadata=flag(positional=True))
    """the spool directory (e.g. /dev/shm/dflash/<run>)"""
    json: bool = False
    """print Spool.stats() as JSON"""


@dataclass(kw_only=True)
class AuditArgs:
    run_dir: str = field(metadata=flag(positional=True))
    """the run directory (its metrics/ledger-r<rank>.jsonl)"""
    checkpoint: str | None = None
    """the checkpoint store, to check the final checkpoint's trained set against the ledgers (default:
    RUN_DIR/run.json 'checkpoint'; none: twice only)"""
    run: str | None = None
    """the run's name in the store (default: RUN_DIR/run.json 'run')"""
    json: bool = False
    """print the audit as JSON"""


@dataclass(kw_only=True)
class InspectArgs:
    shard: str = field(metadata=flag(positional=True))
    """a shard directory (<name>.zarr)"""
    json: bool = False
    """print the result as JSON"""


@dataclass(kw_only=True)
class GcArgs:
    root: str = field(default=DEFAULT_SPOOL_ROOT, metadata=flag(positional=True, nargs="?"))
    """the folder holding spools"""
    dry_run: bool = False
    """only list what would be removed"""
    min_idle_s: float = 600.0
    """a spool with activity this recent is kept (a launch that is starting holds no lock yet)"""


@dataclass(kw_only=True)
class FreeArgs:
    dir: str = field(metadata=flag(positional=True))
    """the spool directory"""


@dataclass(kw_only=True)
class PrepareArgs:
    dir: str = field(metadata=flag(positional=True))
    """the spool directory (created if missing)"""
    run: str
    """the run this launch belongs to"""
    fresh: bool = False
    """discard everything, whatever run it belonged to"""


COMMANDS = {
    "stats": (StatsArgs, "shards/bytes per state and bucket, processes, rates"),
    "inspect": (InspectArgs, "metadata, counts, codec and compression of one shard"),
    "prepare": (PrepareArgs, "before a launch: check the spool's run, discard leftovers"),
    "free": (FreeArgs, "after a run stopped: discard its shards (RAM), keep its records"),
    "gc": (GcArgs, "remove abandoned spools (no live process, idle), e.g. those of crashed runs"),
    "audit": (
        AuditArgs,
        "each sample trained once? the run's sample ledgers per launch and epoch (exit 1: no)",
    ),
}


def run_audit(args: AuditArgs) -> tuple[str, bool]:
    """The audit's text (or JSON) and whether every sample was trained once."""
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run dir {run_dir}: no such folder")
    try:
        recorded = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        recorded = {}
    store, run = args.checkpoint or recorded.get("checkpoint"), args.run or recorded.get("run")
    final_step = trained = None
    if store:
        if not run:
            raise UserError("--checkpoint needs --run (RUN_DIR/run.json names none)")
        from dflash.common.checkpoints.load import finished_steps, read_trained_set  # torch: only here

        try:
            steps = finished_steps(store, run)
            if steps:
                final_step, trained = steps[-1], set(read_trained_set(store, run).indices().tolist())
        except Exception as err:  # noqa: BLE001 - any store error is one line
            raise UserError(f"checkpoint store {store}, run {run!r}: {err}") from None
    try:
        report = audit(run_dir, final_step=final_step, trained=trained)
    except ValueError as err:
        raise UserError(str(err)) from None
    return (json.dumps(report, indent=2) if args.json else format_report(report)), exactly_once(report)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Look at a dflash spool or shard (read-only), or prepare a spool for a launch.",
        formatter_class=DefaultsHelpFormatter,
    )
    sub = p.add_subparsers(
        dest="cmd",
        required=True,
        parser_class=_Parser,
        help="what to do (dflash-spool <command> --help for its options)",
    )
    for name, (cls, text) in COMMANDS.items():
        add_flags(sub.add_parser(name, help=text, formatter_class=DefaultsHelpFormatter), cls)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "prepare":
            text = prepare(args.dir, args.run, fresh=args.fresh)
        elif args.cmd == "free":
            text = free(args.dir)
        elif args.cmd == "gc":
            text = gc(args.root, dry_run=args.dry_run, min_idle_s=args.min_idle_s)
        elif args.cmd == "audit":
            text, ok = run_audit(args)
            print(text)
            return 0 if ok else 1
        elif args.cmd == "stats":
            st = spool_stats(args.dir)
            text = json.dumps(st, indent=2, default=str) if args.json else format_stats(st)
        else:
            info = shard_info(args.shard)
            text = json.dumps(info, indent=2, default=str) if args.json else format_inspect(info)
    except UserError as e:
        print_error(PROG, e)
        return EXIT_USAGE
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `dflash-spool stats DIR | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
