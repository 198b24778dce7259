"""dflash-spool: look at a spool or a shard, and clean up after runs.

    dflash-spool stats DIR [--json]     shards and bytes per state x bucket, claims per consumer,
                                        process heartbeats with their counters and rates, DONE producers
    dflash-spool inspect SHARD [--json] a shard's metadata, sample/token counts, codec, bytes on disk
                                        and compression ratio (raw array bytes / bytes on disk)

    dflash-spool prepare DIR --run NAME [--fresh]
                                        before a launch (ops/run_all.sh, holding the spool's launch lock):
                                        refuse a spool of another run or one a live process uses; discard
                                        what a previous launch left in the flow (see docs/reliability.md)
    dflash-spool free DIR               after a launch stopped or failed (ops/run_all.sh does it): discard
                                        its shards, the RAM a spool holds; keep its records
    dflash-spool gc [ROOT] [--dry-run]  remove the abandoned spools under ROOT (/dev/shm/dflash): no live
                                        process, nothing touched for --min-idle-s

stats and inspect are read-only (``Spool(create=False)``), so they are safe on a live run. User errors
print one line on stderr and exit with status 2, like argparse's own errors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.common.cli.exits import EXIT_USAGE, fail
from dflash.common.cli.flags import add_flags, flag
from dflash.common.cli.help import DefaultsHelpFormatter
from dflash.common.contract.spool import Spool, SpoolError
from dflash.common.contract.spool_records import LOCK_PREFIX, describe_run
from dflash.common.metrics import format_bytes
from dflash.tools.ledger_audit import audit, exactly_once, format_report

PROG = "dflash-spool"
_DTYPE_BYTES = {"bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "bfloat16": 2, "float16": 2}
_DTYPE_BYTES |= {"uint32": 4, "int32": 4, "float32": 4, "uint64": 8, "int64": 8, "float64": 8}


class UserError(Exception):
    """Printed as one line ``dflash-spool: error: ...``; exit status 2."""


def fmt_num(x: float) -> str:
    if isinstance(x, int) or float(x).is_integer():
        return f"{int(x)}"
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def _table(rows: list[list[str]], *, right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]


# ---- stats ----


def spool_stats(root: str) -> dict[str, Any]:
    try:
        return Spool(root, create=False).stats()
    except SpoolError as e:
        raise UserError(str(e)) from None
    except OSError as e:  # e.g. permission denied
        raise UserError(f"cannot read spool {root}: {e.strerror or e}") from None


def format_stats(st: dict[str, Any]) -> str:
    states = st["states"]
    buckets = sorted({b for row in states.values() for b in row["buckets"] if b != "other"})
    has_other = any("other" in row["buckets"] for row in states.values())
    head = ["state", "shards", "bytes"] + [f"b{b}" for b in buckets] + (["other"] if has_other else [])
    rows = [head]
    for state, row in states.items():
        cells = [state, str(row["shards"]), format_bytes(row["bytes"])]
        for b in buckets + (["other"] if has_other else []):
            cell = row["buckets"].get(b)
            cells.append(f"{cell['shards']} / {format_bytes(cell['bytes'])}" if cell else "-")
        rows.append(cells)
    prod = st["producers"]
    done = "drained" if st.get("drained") else ("producers done" if st["producers_done"] else "producing")
    out = [
        f"spool {st['root']}",
        f"total {format_bytes(st['total_bytes'])} in tmp+ready+claimed; "
        f"producers {len(prod['done'])}/{len(prod['registered'])} done ({done})",
        "",
        *_table(rows, right=set(range(1, len(head)))),
    ]
    if buckets:
        out.append("(bucket cells: shards / bytes)")
    if st["claimed_by"]:
        claims = ", ".join(
            f"{c}: {v['shards']} ({format_bytes(v['bytes'])})" for c, v in sorted(st["claimed_by"].items())
        )
        out += ["", f"claimed by  {claims}"]
    if st["processes"]:
        rows = [["role", "id", "pid", "host", "alive", "heartbeat", "counters (rate/s)"]]
        for p in sorted(st["processes"], key=lambda p: (str(p["role"]), str(p["id"]))):
            counters = []
            for k, v in p["counters"].items():
                rate = p["rates"].get(k)
                counters.append(
                    f"{k}={fmt_num(v) if isinstance(v, int | float) else v}"
                    + (f" ({fmt_num(rate)}/s)" if rate is not None else "")
                )
            age = p["age_s"]
            rows.append(
                [str(p["role"]), str(p["id"]), str(p["pid"]), str(p["host"]), "yes" if p["alive"] else "no",
                 f"{age:.1f}s ago" if math.isfinite(age) else "?", "  ".join(counters) or "-"]
            )  # fmt: skip
        out += ["", *_table(rows, right={2})]
    if prod["registered"]:
        pending = sorted(set(prod["registered"]) - set(prod["done"]))
        out += [
            "",
            f"producers registered: {' '.join(prod['registered'])}"
            + (f"; not done: {' '.join(pending)}" if pending else ""),
        ]
    return "\n".join(out)


# ---- inspect ----


def shard_info(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise UserError(f"{path}: no such shard")
    # zarr only for `inspect`: `stats` and `prepare` answer without it
    from dflash.common.contract.shard import ShardFormatError
    from dflash.common.contract.shard_reader import read_shard_meta

    try:
        meta = read_shard_meta(p)
    except ShardFormatError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"cannot read shard {path}: {e.strerror or e}") from None
    arrays = meta.get("arrays", {})
    raw_total = 0
    for name, a in arrays.items():
        raw = math.prod(a["shape"]) * _DTYPE_BYTES.get(a["dtype"], 0)
        a["raw_bytes"] = raw
        a["disk_bytes"] = _tree_bytes(p / name)
        raw_total += raw
    disk = int(meta["nbytes"])
    return {
        "path": str(p.absolute()),
        "meta": {k: v for k, v in meta.items() if k not in ("arrays", "nbytes")},
        "arrays": arrays,
        "num_samples": meta.get("num_samples", arrays.get("sample_index", {}).get("shape", [None])[0]),
        "num_tokens": meta.get("num_tokens", arrays.get("input_ids", {}).get("shape", [None])[0]),
        "codec": meta.get("codec"),
        "raw_bytes": raw_total,
        "disk_bytes": disk,
        "compression_ratio": raw_total / disk if disk else None,
    }


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        total += sum(os.lstat(os.path.join(dirpath, f)).st_size for f in files)
    return total


def format_inspect(info: dict[str, Any]) -> str:
    meta = info["meta"]
    ratio = info["compression_ratio"]
    out = [
        f"shard {info['path']}",
        *(f"  {k}: {json.dumps(v) if isinstance(v, list | dict) else v}" for k, v in meta.items()),
        f"samples {info['num_samples']}, tokens {info['num_tokens']}, codec {info['codec']}",
        f"bytes on disk {format_bytes(info['disk_bytes'])}, raw {format_bytes(info['raw_bytes'])}, "
        f"compression ratio {f'{ratio:.2f}x' if ratio else '?'}",
        "",
    ]
    rows = [["array", "shape", "dtype", "chunks", "raw", "on disk", "ratio"]]
    for name, a in info["arrays"].items():
        r = a["raw_bytes"] / a["disk_bytes"] if a["disk_bytes"] else None
        rows.append(
            [name, "x".join(map(str, a["shape"])), a["dtype"], "x".join(map(str, a["chunks"])),
             format_bytes(a["raw_bytes"]), format_bytes(a["disk_bytes"]), f"{r:.2f}x" if r else "-"]
        )  # fmt: skip
    out += _table(rows, right={4, 5, 6})
    return "\n".join(out)


# ---- prepare (the one command that writes) ----


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
        before = _tree_bytes(spool.root)
        gone = spool.discard_flow()
        freed = before - _tree_bytes(spool.root)
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
        size = _tree_bytes(d)
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


# ---- entry point ----


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
        fail(PROG, e, EXIT_USAGE)
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `dflash-spool stats DIR | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
