"""``dflash-export``'s configuration, the single source of its flags (dflash.common.cli.flags). Standard
library only: the CLI imports this before parsing."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash.common.cli.flags import flag

DTYPE_NAMES = ("bfloat16", "float16", "float32")
"""--dtype choices: the keys of dflash.tools.export.run.DTYPES (a test keeps the two equal)."""


@dataclass(kw_only=True)
class ExportConfig:
    """One export: which checkpoint, where to, in which dtype."""

    checkpoint: str = field(metadata=flag(positional=True, metavar="CHECKPOINT"))
    """checkpoint url (see below)"""
    out_dir: str = field(metadata=flag(positional=True, metavar="OUT_DIR"))
    """folder to write (config.json + model.safetensors)"""
    run: str | None = None
    """run name; CHECKPOINT is then the store url (default: CHECKPOINT's last part)"""
    step: int | None = None
    """step to export (default: the run's latest)"""
    dtype: str = field(default="bfloat16", metadata=flag(choices=DTYPE_NAMES))
    """dtype of the exported weights"""
    overwrite: bool = False
    """replace OUT_DIR if it exists"""
