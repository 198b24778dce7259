"""The HF-style drafter folder that DFlash inference code loads: writing it, reading it back, building a drafter.

The folder (docs/export-and-eval.md) holds ``config.json``, a Qwen3 config plus the DFlash fields the public
``DFlashDraftModel`` reads (``architectures``, ``num_target_layers``, ``block_size``,
``dflash_config: {target_layer_ids, mask_token_id, block_size}``), and ``model.safetensors`` with the draft
layers, ``fc``, ``hidden_norm`` and ``norm`` under the public parameter names. The target's embedding and
lm_head are NOT in it: inference borrows them from the target, as training did.

Why the checkpoint's weights can be written without renames: ``DFlashDrafter`` names its parameters like the
public model (dflash.common.drafter.model). Export still checks every name and shape against a drafter built from
the checkpoint's own config, so a checkpoint of another architecture fails here, not at inference.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.model import DFlashDrafter

# The command line lives in export_cli (no torch before parsing); main/build_parser stay importable here.

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Prefixes a wrapped module adds to parameter names (torch.compile, DDP); never part of the public names.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


class ExportError(ValueError):
    """A checkpoint or export folder that cannot be used; the message is one line."""

# ----------------------------------------------------------------------------------------------- config


def export_config(config: DrafterConfig, dtype: torch.dtype) -> dict:
    """config.json of an exported drafter: the Qwen3 config the public `DFlashDraftModel` loads.

    `block_size` is written both at the top level (where the public Qwen3 drafters have it) and inside
    `dflash_config` (where newer public configs have it; the public loader reads dflash_config first).
    `rope_theta`/`rope_scaling` duplicate `rope_parameters` for transformers-4 era readers; transformers 5
    takes `rope_parameters` when both are present.
    """
    out = config.to_qwen3_config().to_diff_dict()
    for key in ("transformers_version", "_name_or_path"):
        out.pop(key, None)
    out["dtype"] = str(dtype).removeprefix("torch.")
    out["block_size"] = config.block_size
    out["num_target_layers"] = config.num_target_layers
    if config.target_fingerprint:
        out["dflash_target_fingerprint"] = config.target_fingerprint
    out["dflash_config"] = {
        "target_layer_ids": list(config.target_layer_ids),
        "mask_token_id": config.mask_token_id,
        "block_size": config.block_size,
    }
    out["rope_parameters"] = config.rope_parameters
    out["rope_theta"] = config.rope_theta
    out["rope_scaling"] = dict(config.rope_scaling) if config.rope_scaling else None
    return dict(sorted(out.items()))


def drafter_config_from_export(cfg: dict) -> DrafterConfig:
    """Inverse of `export_config`; also reads the public DFlash drafters' config.json (transformers 4 or 5)."""
    dflash = cfg.get("dflash_config") or {}

    def field(name: str, default: Any = None) -> Any:
        value = dflash.get(name, cfg.get(name, default))
        if value is None:
            raise ExportError(f"config.json has no {name!r} (neither top level nor dflash_config)")
        return value

    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params and "rope_theta" not in params:
        params = params["full_attention"]
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        extra = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        extra = dict(cfg.get("rope_scaling") or {})
        if "type" in extra and "rope_type" not in extra:
            extra["rope_type"] = extra.pop("type")
    scaling = (
        None if set(extra) <= {"rope_type"} and extra.get("rope_type", "default") == "default" else extra
    )
    heads = int(field("num_attention_heads"))
    try:
        return DrafterConfig(
            hidden_size=int(field("hidden_size")),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            intermediate_size=int(field("intermediate_size")),
            vocab_size=int(field("vocab_size")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            num_layers=int(field("num_hidden_layers")),
            block_size=int(field("block_size", 16)),
            target_layer_ids=[int(i) for i in field("target_layer_ids")],
            num_target_layers=int(field("num_target_layers")),
            mask_token_id=int(field("mask_token_id")),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
            target_fingerprint=cfg.get("dflash_target_fingerprint"),
        )
    except ValueError as err:
        raise ExportError(f"config.json: {err}") from None


# ---------------------------------------------------------------------------------------------- weights


def expected_shapes(config: DrafterConfig) -> dict[str, torch.Size]:
    """Public parameter name -> shape, from a drafter built on the meta device (no memory, any size)."""
    with torch.device("meta"):
        model = DFlashDrafter(config)
    return {name: p.shape for name, p in model.named_parameters()}


def _public_state(model_state: dict[str, torch.Tensor], config: DrafterConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the public names, checked name by name and shape by shape."""
    state = {}
    for name, tensor in model_state.items():
        for prefix in _WRAPPER_PREFIXES:
            name = name.removeprefix(prefix)
        state[name] = tensor
    want = expected_shapes(config)
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    if missing or unexpected:
        raise ExportError(
            f"weights do not fit the drafter config: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for name, shape in want.items():
        if state[name].shape != shape:
            raise ExportError(f"{name}: shape {list(state[name].shape)}, the config implies {list(shape)}")
    return state


def export_drafter(
    model_state: dict[str, torch.Tensor],
    config: DrafterConfig,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    metadata: dict[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the export folder. It appears complete or not at all: files go to a temp folder beside
    `out_dir`, which is renamed into place last. `metadata` (str -> str) goes into the safetensors header."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise ExportError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    tensors = {
        name: t.detach().to("cpu", dtype).contiguous()
        for name, t in _public_state(model_state, config).items()
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(export_config(config, dtype), indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", **(metadata or {})})
        for path in tmp.iterdir():  # readable by a serving container or another user, whatever the umask
            os.chmod(path, 0o644)
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %d tensors (%s) to %s", len(tensors), dtype, out)
    return out


def read_export_config(path: str | Path) -> DrafterConfig:
    """The DrafterConfig of an export folder; ExportError if it is not one."""
    root = Path(path)
    for fname in (CONFIG_FILE, WEIGHTS_FILE):
        if not (root / fname).is_file():
            raise ExportError(f"{root}: no {fname} (not a dflash-export folder)")
    try:
        raw = json.loads((root / CONFIG_FILE).read_text())
    except json.JSONDecodeError as err:
        raise ExportError(f"{root / CONFIG_FILE}: invalid JSON ({err})") from None
    return drafter_config_from_export(raw)


# ------------------------------------------------------------------------------------------- checkpoint


# ----------------------------------------------------------------------------------------------------- CLI
