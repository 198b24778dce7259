"""``dflash-demo``'s command line: flags from DemoConfig (tools/demo/config.py), parsed before anything heavy is
imported; the demo itself is tools/demo/demo.py."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from dflash.common.cli.exits import EXIT_FAILURE, EXIT_INTERRUPTED, fail
from dflash.common.cli.flags import add_flags, from_args
from dflash.common.cli.help import DefaultsHelpFormatter
from dflash.tools.demo.config import PROG, DemoConfig
from dflash.tools.demo.summary import print_summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="The whole pipeline on the CPU from an embedded default, no downloads.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_flags(p, DemoConfig, defaults={"run_dir": None})
    p.add_argument("--json", default=None, help="also write the summary as JSON here")
    args = p.parse_intermixed_args(argv)
    run_dir = Path(args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the demo as Ctrl-C does
    try:
        from dflash.tools.demo.demo import DemoStopped, run_demo  # torch, boto3: only once the flags parsed

        try:
            summary = run_demo(from_args(DemoConfig, args, run_dir=run_dir))
        except DemoStopped as stopped:
            print(f"{PROG}: {stopped}", file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # outside the pipeline (set-up, evaluation): nothing to save
        print(f"{PROG}: stopped", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except (RuntimeError, OSError, ValueError) as err:  # the pipeline failed, or could not start
        fail(PROG, " ".join(str(err).split()), EXIT_FAILURE)
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
