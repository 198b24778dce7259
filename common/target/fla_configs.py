"""fla's Triton kernels tuned once per process, their choice reused at every token count.

Why: several of flash-linear-attention's kernels autotune on a key that moves with the batch's token count,
not only with the model's shape constants: the q/k L2 norm of the gated delta rule keys on ``NB``, one
class per 65,536 rows of heads x tokens (at the 27B hybrid's 48 heads, a new class every ~1,400 tokens of
a batch), and the chunk cumsum on the batch's row count. Each new class benchmarks every candidate config
(25 for the norm, each a fresh Triton compile): seconds per class, at every new batch size, over the whole
run. A producer's batches come in many token counts, so the hybrid producer spent most of its time
autotuning (3.5 K tok/s over an 883 K-token run against 8.3 K for the same forward once every class had
been seen; docs/benchmarks.md).

fla has the switch for it: ``FLA_CACHE_MODE=fuzzy`` makes its ``CachedAutotuner`` look up a config in
``$FLA_CONFIG_DIR/<kernel>.json`` first and accept an entry whose key differs in numbers only. So the
producer points fla at a config folder of its own before fla is imported (`reuse_tuned_configs`), lets
its warm-up autotune each kernel once on a full-size batch, then writes what was tuned into that folder
(`save_tuned_configs`): every later token count compiles the chosen config once (no benchmarking). The
folder is per process: fuzzy matching ignores the shape constants too, so configs of another model (other
head dims) must never be found there. Across restarts, exact keys come from Triton's own autotune cache
(fla turns ``cache_results`` on).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

MODE_ENV, DIR_ENV = "FLA_CACHE_MODE", "FLA_CONFIG_DIR"
FUZZY = "fuzzy"


def reuse_tuned_configs() -> Path | None:
    """Before fla is imported: ask it to reuse tuned configs from a fresh folder of this process (removed at
    exit). Returns that folder; None when fla is imported already (its mode is read at import) or the user
    chose a mode or folder of their own (kept, said in one line)."""
    if os.environ.get(MODE_ENV) or os.environ.get(DIR_ENV):
        mode, folder = os.environ.get(MODE_ENV), os.environ.get(DIR_ENV)
        log.info("fla: %s=%s %s=%s set by the user: kept", MODE_ENV, mode, DIR_ENV, folder)
        return None
    if "fla" in sys.modules:
        return None
    folder = Path(tempfile.mkdtemp(prefix="dflash-fla-configs-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ[MODE_ENV], os.environ[DIR_ENV] = FUZZY, str(folder)
    return folder


def _config_entry(config) -> dict:
    """A triton.Config as fla's config files hold it (``CachedAutotuner.maybe_load_cached_config`` reads
    kwargs, num_warps, num_stages, and num_ctas / maxnreg / ir_override on Triton >= 3.5.1)."""
    entry = {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages}
    for name in ("num_ctas", "maxnreg", "ir_override"):
        entry[name] = getattr(config, name, None)
    entry["num_ctas"] = entry["num_ctas"] or 1
    return entry


def _key_hash(key: list) -> str:
    """fla's hash of an autotune key (``AutotuneKey.key_hash``), so an exact lookup finds the entry too."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def tuned_autotuners() -> dict[str, dict]:
    """kernel name -> {autotune key: config} of every fla autotuner that has tuned something in this
    process (fla's ``CachedAutotuner`` objects: a ``kernel_name`` and Triton's ``cache`` of key -> config)."""
    found: dict[str, dict] = {}
    for name, module in list(sys.modules.items()):
        if not (name == "fla" or name.startswith("fla.")) or module is None:
            continue
        for obj in list(vars(module).values()):
            for _ in range(3):  # through Triton's wrappers (``triton.heuristics`` holds the autotuner as .fn)
                cache, kernel = getattr(obj, "cache", None), getattr(obj, "kernel_name", None)
                if isinstance(cache, dict) and isinstance(kernel, str):
                    if cache:
                        found.setdefault(kernel, {}).update(cache)
                    break
                obj = getattr(obj, "fn", None)
    return found


def save_tuned_configs(folder: Path | None = None) -> int:
    """Write what fla's autotuners chose so far as its config files in ``folder`` (default: this process's
    `reuse_tuned_configs` folder); returns the kernels written, 0 when fla is not in fuzzy mode here."""
    if folder is None:
        if os.environ.get(MODE_ENV) != FUZZY or not os.environ.get(DIR_ENV):
            return 0
        folder = Path(os.environ[DIR_ENV])
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for kernel, cache in tuned_autotuners().items():
        entries = {}
        for key, config in cache.items():
            key_list = json.loads(json.dumps(list(key), default=str))
            entries[_key_hash(key_list)] = {"autotune_key": key_list, "config": _config_entry(config)}
        tmp = folder / f".{kernel}.json.tmp"
        tmp.write_text(json.dumps({"kernel_name": kernel, "autotune_entries": entries}, indent=1))
        os.replace(tmp, folder / f"{kernel}.json")
        written += 1
    return written
