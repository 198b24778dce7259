"""``dflash-eval``'s command line: flags from EvalConfig and WatchConfig (tools/eval/config.py), parsed
before anything heavy is imported (``--help`` and flag errors must not pay for importing torch, seconds on
a loaded box). The evaluation itself is ``dflash.tools.eval.run.run``; ``--watch`` is tools/eval/watch.py."""

from __future__ import annotations

import argparse

from dflash.common.cli.exits import fail
from dflash.common.cli.flags import add_flags, from_args
from dflash.common.cli.help import DefaultsHelpFormatter
from dflash.tools.eval.config import PROG, EvalConfig, WatchConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="DFlash speculative decoding (greedy, or lossless sampling with --temperature): acceptance "
        "and speed. With --watch: every checkpoint of a training run as it lands, marking the best in the store.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_flags(p, EvalConfig)
    add_flags(p.add_argument_group("watch a checkpoint store (instead of --drafter)"), WatchConfig)
    return p


def check_mode(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exactly one of --drafter / --watch; the watch flags only with --watch (argparse error: exit 2)."""
    if (args.drafter is None) == (args.watch is None):
        p.error("give exactly one of --drafter DIR or --watch STORE")
    if args.watch is None:
        extra = [f for f, v in (("--run", args.run), ("--run-dir", args.run_dir)) if v is not None]
        if args.once:
            extra.append("--once")
        if extra:
            p.error(f"{', '.join(extra)} only with --watch")
        return
    if args.run is None:
        p.error("--watch needs --run RUN")
    if args.json is not None:
        p.error("--json is for one drafter; with --watch use --run-dir (metrics/eval.jsonl)")
    if not args.poll_s > 0:
        p.error(f"--poll-s must be > 0, got {args.poll_s}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    check_mode(parser, args)
    try:
        cfg, watch = from_args(EvalConfig, args), from_args(WatchConfig, args)
    except ValueError as err:
        fail(PROG, err)
    if watch.watch is not None:
        from dflash.tools.eval.watch import run_watch  # torch: only once the flags parsed

        return run_watch(cfg, watch)
    from dflash.tools.eval.run import run

    return run(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
