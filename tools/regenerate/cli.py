"""``dflash-regenerate``'s command line: flags from RegenerateConfig (tools/regenerate/config.py), parsed
before anything heavy is imported (``--help`` and flag errors must not pay for importing torch, seconds on
a loaded box). The regeneration itself is ``dflash.tools.regenerate.run.run``."""

from __future__ import annotations

import os
import signal
import sys

from dflash.common.cli.exits import EXIT_INTERRUPTED, fail
from dflash.common.cli.flags import command_parser, from_args
from dflash.tools.regenerate.config import PROG, RegenerateConfig


def build_parser():
    return command_parser(
        PROG,
        "A chat dataset's assistant turns written again by the target itself (turn by turn: each later turn "
        "sees the target's earlier answers), with its reasoning and tool calls, into a JSONL that "
        "dflash-produce reads as it is. The target runs here (--model) or behind an OpenAI-compatible "
        "server (--endpoint). Run the same command again to continue a stopped run or retry failed rows.",
        RegenerateConfig,
    )


def _sigterm(_signum, _frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = from_args(RegenerateConfig, args)
    except ValueError as err:
        fail(PROG, err)
    from dflash.tools.regenerate.run import run  # torch and transformers: only once the flags parsed

    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        code = run(cfg)
    finally:
        # main() called from Python (a test) leaves its caller as it was
        signal.signal(signal.SIGTERM, previous)
    if code == EXIT_INTERRUPTED:  # a batch being generated here (its pool's threads) would hold the exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
