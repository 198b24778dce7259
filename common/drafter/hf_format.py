"""The HF-style drafter folder that DFlash inference code loads: writing it, reading it back, building a drafter.

The folder (docs/export-and-eval.md, "The folder"):

- ``config.json``: a Qwen3Config plus every DFlash field vLLM's and SGLang's loaders read (``architectures``,
  ``block_size`` at the top level and in ``dflash_config``, ``dflash_config.{target_layer_ids, mask_token_id}``,
  ``num_target_layers``, ``layer_types``, ``sliding_window`` + ``use_sliding_window`` when a layer slides)
  and ``auto_map {"AutoModel": "dflash.DFlashDraftModel"}``;
- ``model.safetensors``: the draft layers, ``fc``, ``hidden_norm`` and ``norm`` under the public names (no
  ``model.`` prefix; the target's embedding and lm_head are NOT in it: inference borrows them);
- ``dflash.py``: dflash.common.drafter.dflash, byte for byte: the remote code ``AutoModel`` runs, i.e. the
  very code that trained the drafter;
- the target's tokenizer files, when the target folder is readable (``copy_tokenizer_files``).

Why the checkpoint's weights can be written without renames: ``DFlashDrafter`` names its parameters like the
public model. Export still checks every name and shape against a drafter built from the checkpoint's own
config, so a checkpoint of another architecture fails here, not at inference.
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

from dflash.common.drafter import dflash as remote_code
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.layers import FULL, SLIDING
from dflash.common.drafter.model import DFlashDrafter

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CODE_FILE = "dflash.py"
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}
"""The public DFlash drafters' remote-code entry (z-lab HF repos: ``dflash.py``, class ``DFlashDraftModel``)."""
CLASS_NAMES = {"dflash": "DFlashDraftModel", "dflash2": remote_code.DFLASH2_CLASS}
"""``architectures[0]`` per drafter architecture; the remote-code class of the same name builds it."""
DFLASH2_FIELDS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
)
"""DFlash2's ``dflash_config`` fields beyond DFlash's (z-lab tests/fixtures/dflash2-config.json), with the
optional ``final_logit_softcapping``."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files AutoTokenizer reads from a folder (whichever of them the target has)."""
# Prefixes a wrapped module adds to parameter names (torch.compile, DDP); never part of the public names.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


class ExportError(ValueError):
    """A checkpoint or export folder that cannot be used; the message is one line."""


# ----------------------------------------------------------------------------------------------- config


def export_config(config: DrafterConfig, dtype: torch.dtype) -> dict:
    """config.json of an exported drafter: ``DrafterConfig.to_qwen3_config()`` (what the drafter is built
    from) plus what the serving loaders read (docs/export-and-eval.md, "What each loader reads").

    ``block_size`` goes both at the top level (transformers/MLX readers) and in ``dflash_config`` (SGLang
    reads it first); ``rope_theta``/``rope_scaling`` repeat ``rope_parameters`` for transformers-4 era
    readers (transformers 5 takes ``rope_parameters``). ``layer_types`` is always explicit, and
    ``use_sliding_window`` true exactly when a layer slides (Qwen3Config drops ``sliding_window``
    otherwise). No ``is_causal``: vLLM would apply it to every layer, overriding "sliding causal, full not"
    (for DFlash2 too: the public DFlash2 config's ``is_causal: false`` makes its sliding layers non-causal
    in the block, where ours are causal, as DFlash's).
    DFlash2 (``architectures: ["DFlash2DraftModel"]``) adds its ``dflash_config`` fields (``DFLASH2_FIELDS``).
    """
    out = config.to_qwen3_config().to_diff_dict()
    for key in ("transformers_version", "_name_or_path", "is_causal"):
        out.pop(key, None)
    sliding = SLIDING in config.layer_types
    arch = CLASS_NAMES[config.arch]
    dflash_config = {
        "target_layer_ids": list(config.target_layer_ids),
        "mask_token_id": config.mask_token_id,
        "block_size": config.block_size,
    }
    if config.arch == "dflash2":
        dflash_config |= {name: getattr(config, name) for name in DFLASH2_FIELDS}
        if config.final_logit_softcapping is not None:
            dflash_config["final_logit_softcapping"] = config.final_logit_softcapping
    if not config.block_causal:  # a public DFlash2 drafter's own rule, kept (never what we train)
        out["is_causal"] = False
    out.update(
        architectures=[arch],
        auto_map={"AutoModel": f"dflash.{arch}"},
        model_type="qwen3",
        hidden_act="silu",
        attention_bias=False,
        dtype=str(dtype).removeprefix("torch."),
        block_size=config.block_size,
        num_target_layers=config.num_target_layers,
        dflash_config=dflash_config,
        layer_types=list(config.layer_types),
        use_sliding_window=sliding,
        sliding_window=config.sliding_window if sliding else None,
        max_window_layers=config.num_layers,
        rope_parameters=config.rope_parameters,
        rope_theta=config.rope_theta,
        rope_scaling=dict(config.rope_scaling) if config.rope_scaling else None,
    )
    if config.target_fingerprint:
        out["dflash_target_fingerprint"] = config.target_fingerprint
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
    num_layers = int(field("num_hidden_layers"))
    layer_types = cfg.get("layer_types") or [FULL] * num_layers
    # transformers keeps `sliding_window` only with use_sliding_window; what a served drafter slides with
    window = cfg.get("sliding_window") if SLIDING in layer_types and cfg.get("use_sliding_window") else None
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
            num_layers=num_layers,
            block_size=int(field("block_size", 16)),
            target_layer_ids=[int(i) for i in field("target_layer_ids")],
            num_target_layers=int(field("num_target_layers")),
            mask_token_id=int(field("mask_token_id")),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
            layer_types=list(layer_types),
            sliding_window=None if window is None else int(window),
            target_fingerprint=cfg.get("dflash_target_fingerprint"),
            **_arch_fields(cfg),
        )
    except (ValueError, TypeError) as err:
        raise ExportError(f"config.json: {err}") from None


def _arch_fields(cfg: dict) -> dict[str, Any]:
    """``arch`` from ``architectures``, a DFlash2 config's ``dflash_config`` fields (DFLASH2_FIELDS), and
    ``is_causal: false`` (the public DFlash2 drafters': sliding layers see the whole block)."""
    causal = {"block_causal": cfg.get("is_causal") is not False}
    if CLASS_NAMES["dflash2"] not in (cfg.get("architectures") or []):
        return {"arch": "dflash", **causal}
    dflash = cfg.get("dflash_config") or {}
    names = (*DFLASH2_FIELDS, "final_logit_softcapping")
    return {"arch": "dflash2", **causal, **{k: dflash[k] for k in names if dflash.get(k) is not None}}


# ---------------------------------------------------------------------------------------------- weights


def expected_shapes(config: DrafterConfig) -> dict[str, torch.Size]:
    """Public parameter name -> shape, from a drafter built on the meta device (no memory, any size)."""
    with torch.device("meta"):
        model = DFlashDrafter(config)
    return {name: p.shape for name, p in model.named_parameters()}


def public_state(model_state: dict[str, torch.Tensor], config: DrafterConfig) -> dict[str, torch.Tensor]:
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


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files ``src`` has (TOKENIZER_FILES) into ``dst``; the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def export_drafter(
    model_state: dict[str, torch.Tensor],
    config: DrafterConfig,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    metadata: dict[str, str] | None = None,
    overwrite: bool = False,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write the export folder. It appears complete or not at all: files go to a temp folder beside
    `out_dir`, which is renamed into place last. `metadata` (str -> str) goes into the safetensors header;
    `tokenizer_dir`: a folder whose tokenizer files are copied in (the target's)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise ExportError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    tensors = {
        name: t.detach().to("cpu", dtype).contiguous()
        for name, t in public_state(model_state, config).items()
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(export_config(config, dtype), indent=2) + "\n")
        shutil.copyfile(remote_code.__file__, tmp / CODE_FILE)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
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
    log.info("exported a %s: %d tensors (%s) to %s", CLASS_NAMES[config.arch], len(tensors), dtype, out)
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
