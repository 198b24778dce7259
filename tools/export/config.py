"""``dflash-export``'s configuration, the single source of its flags (dflash.common.cli.flags). Standard
library only: the CLI imports this before parsing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from dflash.common.cli.flags import check_choices, flag

ExportDtype = Literal["bfloat16", "float16", "float32"]
DTYPE_NAMES = get_args(ExportDtype)
"""--dtype choices: the keys of dflash.tools.export.run.DTYPES (a test keeps the two equal)."""


PROG = "dflash-export"
"""The program name every error line of this tool starts with."""


@dataclass(kw_only=True)
class ExportConfig:
    """One export: which checkpoint, where to, in which dtype (or, with --check, one folder to validate)."""

    checkpoint: str | None = field(
        default=None, metadata=flag(positional=True, metavar="CHECKPOINT", nargs="?")
    )
    """checkpoint url (see below)"""
    out_dir: str | None = field(default=None, metadata=flag(positional=True, metavar="OUT_DIR", nargs="?"))
    """folder to write (config.json, model.safetensors, dflash.py, the target's tokenizer files)"""
    run: str | None = None
    """run name; CHECKPOINT is then the store url (default: CHECKPOINT's last part)"""
    step: int | None = None
    """step to export (default: the run's latest)"""
    dtype: ExportDtype = "bfloat16"
    """dtype of the exported weights"""
    overwrite: bool = False
    """replace OUT_DIR if it exists"""
    target: str | None = field(default=None, metadata=flag(metavar="DIR"))
    """target folder to copy the tokenizer files from (default: the checkpoint's recorded --target; when it
    is not a readable folder here, the export says so in one line and goes on without them); with --check,
    the target to check the folder against (width, layers, vocabulary, its tokenizer's mask token)"""
    check: str | None = field(default=None, metadata=flag(metavar="FOLDER"))
    """instead of exporting: validate FOLDER (any DFlash drafter folder) against what vLLM, SGLang and
    transformers read; prints what each would miss, exit 0 when it passes, 2 when not"""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.check is not None:
            if self.checkpoint is not None or self.out_dir is not None:
                raise ValueError("--check FOLDER takes no CHECKPOINT / OUT_DIR")
        elif self.checkpoint is None or self.out_dir is None:
            raise ValueError("give CHECKPOINT and OUT_DIR (or --check FOLDER)")
