"""A drafter attached to its target: exported (or checkpoint) weights and config, checked name by name, plus
the target's frozen embedding and lm_head (head.py) -> an inference-ready ``DFlashDrafter``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.hf_format import WEIGHTS_FILE, ExportError, public_state, read_export_config
from dflash.common.drafter.model import DFlashDrafter
from dflash.common.target.head import load_target_head

log = logging.getLogger(__name__)


def load_exported_drafter(
    path: str | Path,
    target: Any,
    *,
    device: Any = None,
    dtype: torch.dtype | None = None,
    attention_backend: str = "auto",
) -> DFlashDrafter:
    """An exported folder (or a public DFlash drafter folder) -> `DFlashDrafter` with the target's head.

    `target`: the target's folder or hub id (only its embedding and lm_head are read) or an in-memory HF
    model. `dtype`: default the stored dtype. The drafter is returned in eval mode.
    """
    root = Path(path)
    config = read_export_config(root)
    state = load_file(str(root / WEIGHTS_FILE))
    return build_drafter(
        state, config, target, device=device, dtype=dtype, attention_backend=attention_backend
    )


def build_drafter(
    model_state: dict[str, torch.Tensor],
    config: DrafterConfig,
    target: Any,
    *,
    device: Any = None,
    dtype: torch.dtype | None = None,
    attention_backend: str = "auto",
) -> DFlashDrafter:
    """Weights (an export's or a checkpoint's, checked name by name) -> `DFlashDrafter` with the target's
    head, in eval mode: the one path from weights to an inference drafter (`load_exported_drafter`,
    ``dflash-eval --watch`` on checkpoints). `dtype`: default the stored dtype."""
    state = public_state(model_state, config)
    dtype = dtype or next(iter(state.values())).dtype
    head = load_target_head(target, dtype=dtype, device=device)
    if head.embed_weight.shape[1] != config.hidden_size:
        raise ExportError(
            f"target hidden size {head.embed_weight.shape[1]} != drafter hidden size {config.hidden_size}: "
            "this drafter was trained for another target"
        )
    # Built on the meta device and filled by assignment: no random init of weights that are overwritten
    # anyway, and the parameters take `dtype` while the rotary table stays fp32 (a `.to(dtype)` would round
    # inv_freq, which the public model keeps in fp32).
    with torch.device("meta"):
        model = DFlashDrafter(config, attention_backend=attention_backend)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    model.reset_rotary()
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftover, f"tensors left uninitialized after loading: {leftover}"
    model.set_target_head(head)
    return model.to(device).eval() if device is not None else model.eval()
