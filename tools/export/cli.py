"""``dflash-export``'s command line, apart from common/drafter/hf_format.py: ``--help`` and flag errors must not
pay for importing torch (seconds on a loaded box). The export itself is ``dflash.common.drafter.hf_format.run_cli``."""

from __future__ import annotations

import argparse

from dflash.common.cli.help import DefaultsHelpFormatter

PROG = "dflash-export"
DTYPE_NAMES = ("bfloat16", "float16", "float32")
"""--dtype choices: the keys of dflash.common.drafter.hf_format.DTYPES (a test keeps the two equal)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Export a dflash-consume checkpoint as a HF-style DFlash drafter folder.",
        epilog="CHECKPOINT: <store>/<run> (its latest step), <store>/<run>/step-<n>, or <store> with --run; "
        "<store> is s3://bucket/prefix or a local folder, as given to dflash-consume --checkpoint.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint url (see below)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (config.json + model.safetensors)")
    p.add_argument(
        "--run",
        default=None,
        help="run name; CHECKPOINT is then the store url (default: CHECKPOINT's last part)",
    )
    p.add_argument("--step", type=int, default=None, help="step to export (default: the run's latest)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES, help="dtype of the exported weights")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dflash.tools.export.run import run_cli  # torch: only once the flags parsed

    return run_cli(args)


if __name__ == "__main__":
    raise SystemExit(main())
