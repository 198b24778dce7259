"""``dflash-eval``'s command line, apart from consumer/evaluate.py: ``--help`` and flag errors must not
pay for importing torch (seconds on a loaded box). The evaluation itself is
``dflash.consumer.evaluate.run_cli``."""

from __future__ import annotations

import argparse

from dflash.common.cli_help import DefaultsHelpFormatter

PROG = "dflash-eval"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Greedy DFlash speculative decoding: acceptance and speed.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--target", required=True, help="target model folder or hub id (with tokenizer)")
    p.add_argument("--drafter", required=True, help="dflash-export folder")
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dflash.consumer.evaluate import run_cli  # torch: only once the flags parsed

    return run_cli(args)


if __name__ == "__main__":
    raise SystemExit(main())
