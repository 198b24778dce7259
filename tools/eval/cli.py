"""``dflash-eval``'s command line, apart from common/drafter/decode.py: ``--help`` and flag errors must not
pay for importing torch (seconds on a loaded box). The evaluation itself is
``dflash.common.drafter.decode.run_cli``."""

from __future__ import annotations

import argparse

from dflash.common.cli.help import DefaultsHelpFormatter

PROG = "dflash-eval"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Greedy DFlash speculative decoding: acceptance and speed. With --watch: every checkpoint "
        "of a training run as it lands, marking the best in the store.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--target", required=True, help="target model folder or hub id (with tokenizer)")
    p.add_argument("--drafter", default=None, help="dflash-export folder (or --watch a checkpoint store)")
    p.add_argument(
        "--dataset", required=True, help="prompts: .jsonl/.json/.parquet file or folder, or hub name"
    )
    p.add_argument("--num-prompts", type=int, default=16, help="evaluate the first K usable rows")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate per prompt at most")
    p.add_argument("--max-prompt-tokens", type=int, default=4096, help="skip longer prompts")
    p.add_argument("--block-size", type=int, default=None, help="draft block size (default: the drafter's)")
    p.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda, cuda:N; auto: cuda when a CUDA device is available, else cpu",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--baseline", action="store_true", help="also run plain greedy: speedup + lossless check")
    p.add_argument(
        "--json", default=None, metavar="PATH", help="write the report as JSON ('-' = stdout; default: none)"
    )
    _add_watch_flags(p)
    return p


def _add_watch_flags(p: argparse.ArgumentParser) -> None:
    """--watch: evaluate every checkpoint of a training run as it lands (tools/eval/watch.py)."""
    g = p.add_argument_group("watch a checkpoint store (instead of --drafter)")
    g.add_argument(
        "--watch", default=None, metavar="STORE", help="checkpoint store (folder or s3://) to watch"
    )
    g.add_argument("--run", default=None, help="run name in the store (required with --watch)")
    g.add_argument("--poll-s", type=float, default=30.0, help="seconds between looks for new checkpoints")
    g.add_argument("--once", action="store_true", help="evaluate the checkpoints there now, then exit")
    g.add_argument(
        "--run-dir", default=None, help="append one line per evaluation to RUN_DIR/metrics/eval.jsonl"
    )


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
    args = parser.parse_args(argv)
    check_mode(parser, args)
    from dflash.tools.eval.run import run_cli  # torch: only once the flags parsed

    return run_cli(args)


if __name__ == "__main__":
    raise SystemExit(main())
