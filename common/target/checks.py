"""Is a target model there, and complete? One line naming what is missing, before anything loads it.

Why: left to transformers, a path that does not exist reads as a malformed hub id ("Repo id must be in the
form 'repo_name' or 'namespace/repo_name'"), and a folder with only config.json loads a tokenizer from the
config's defaults and fails much later ("tokenizer has no chat template"). Neither says what to fix.
"""

from __future__ import annotations

import os
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def looks_like_path(target: str) -> bool:
    """A local path rather than a hub id (``namespace/name``): absolute, relative with ./ or ../, ~, or
    more than one '/'."""
    return (
        target.startswith(("/", "./", "../", "~"))
        or target.count("/") > 1
        or os.sep != "/"
        and os.sep in target
    )


def check_target(target: str, *, tokenizer: bool = True, weights: bool = True, what: str = "target") -> None:
    """ValueError (one line) when ``target`` is a local path that does not exist, or a folder without
    config.json, tokenizer files (``tokenizer``) or weights (``weights``). A hub id is left to the hub."""
    path = Path(os.path.expanduser(target))
    if not path.exists():
        if looks_like_path(target):
            raise ValueError(
                f"{what} {target}: no such folder (give a model folder, or a hub id like Qwen/Qwen3-8B)"
            )
        return
    if not path.is_dir():
        raise ValueError(f"{what} {target}: is a file, not a model folder (config.json, tokenizer, weights)")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("no config.json")
    if tokenizer and not any((path / f).is_file() for f in TOKENIZER_FILES):
        missing.append(f"no tokenizer ({', '.join(TOKENIZER_FILES[:2])})")
    if weights and not any((path / f).is_file() for f in WEIGHT_FILES):
        missing.append(f"no weights ({', '.join(WEIGHT_FILES[:2])})")
    if missing:
        raise ValueError(f"{what} folder {target} is incomplete: {'; '.join(missing)}")
