"""``dflash-export``'s command line: flags from ExportConfig (tools/export/config.py), parsed before torch is
imported (``--help`` and flag errors must not pay for it, seconds on a loaded box). The export itself is
``dflash.tools.export.run.run``; ``--check`` is ``dflash.tools.export.run.run_check``."""

from __future__ import annotations

import argparse

from dflash.common.cli.flags import add_flags, from_args
from dflash.common.cli.help import DefaultsHelpFormatter
from dflash.tools.export.config import PROG, ExportConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Export a dflash-consume checkpoint as a HF-style DFlash drafter folder (remote code "
        "included: AutoModel.from_pretrained(OUT_DIR, trust_remote_code=True)), or --check any drafter folder "
        "against what vLLM, SGLang and transformers read.",
        epilog="CHECKPOINT: <store>/<run> (its latest step), <store>/<run>/step-<n>, or <store> with --run; "
        "<store> is s3://bucket/prefix or a local folder, as given to dflash-consume --checkpoint.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_flags(p, ExportConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        cfg = from_args(ExportConfig, parser.parse_intermixed_args(argv))
    except ValueError as err:
        parser.error(str(err))  # one line, exit 2
    if cfg.check is not None:
        from dflash.tools.export.run import run_check  # torch: only once the flags parsed

        return run_check(cfg)
    from dflash.tools.export.run import run

    return run(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
