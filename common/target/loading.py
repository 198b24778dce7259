"""Load a target for hidden-state capture: its text model only, with its linear-attention kernels reported.

Why: Qwen3.5/3.6 ship as multimodal checkpoints (``Qwen3_5ForConditionalGeneration``: a ``text_config``
sub-config, a vision tower under ``model.visual``, the text model under ``model.language_model``). The
producer needs the text model alone: since transformers 5.2, ``AutoModelForCausalLM`` maps such a config to
the text class (``qwen3_5`` -> ``Qwen3_5ForCausalLM``, built from ``get_text_config()``) and renames the
keys (``model.language_model.*`` -> ``model.*``); the vision tower is never built and its tensors never
read. Subclassing that class would break the rename (a class outside ``transformers.*`` counts as custom
code: random weights, only a log table as the signal), so this module only calls it and checks the result.
A family without such a mapping loads with its vision tower: said in one line, not hidden.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from dflash.common.target.kernels import (
    KernelReport,
    prefer_fast_kernels,
    prepare_kernels,
    quiet_fallback_notices,
)

log = logging.getLogger(__name__)

_VISION_NAMES = ("visual", "vision_tower", "vision_model", "multi_modal_projector")


@dataclass
class TargetInfo:
    """What the producer's start line says about the loaded target."""

    cls: str  # the class loaded, e.g. Qwen3_5ForCausalLM
    multimodal: bool  # the checkpoint's config has a text sub-config (a VLM checkpoint)
    vision_params: int  # parameters of a vision tower that was loaded anyway (0: text only)
    kernels: KernelReport | None  # linear-attention kernels (None: no linear attention)

    def line(self) -> str:
        what = self.cls
        if self.multimodal:
            what += " (text model of a multimodal checkpoint" + (
                ", vision tower loaded)" if self.vision_params else ", no vision tower)"
            )
        if self.kernels is not None:
            what += f"; {self.kernels.line()}"
        return what


def is_hybrid(config) -> bool:
    """The text config interleaves linear attention (Gated DeltaNet) with full attention."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return "linear_attention" in (getattr(text, "layer_types", None) or [])


def vision_parameters(model: nn.Module) -> int:
    """Parameters under a vision tower / projector submodule (0 for a text-only model)."""
    return sum(
        p.numel()
        for name, p in model.named_parameters()
        if any(part in _VISION_NAMES for part in name.split("."))
    )


def load_target(path: str, *, dtype: torch.dtype, device: str) -> tuple[nn.Module, TargetInfo]:
    """``AutoModelForCausalLM.from_pretrained(path)`` in ``dtype`` on ``device`` (eval mode), text model
    only where transformers can (see the module docstring), kernels prepared (kernels.prepare_kernels)."""
    config = AutoConfig.from_pretrained(path)
    multimodal = hasattr(config, "get_text_config") and config.get_text_config() is not config
    quiet_fallback_notices()  # 5.2-5.14 warn while building the layers: the report says it in one line
    if device.startswith("cuda") and is_hybrid(config):
        prefer_fast_kernels()
    kw: dict = {"dtype": dtype}
    if device.startswith("cuda"):
        kw["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(path, **kw).eval()
    vision = vision_parameters(model)
    if vision:
        log.warning(
            "%s: %s loaded with its vision tower (%.1f M parameters on the GPU, never run): this transformers "
            "has no text-only class for model_type %r",
            path,
            type(model).__name__,
            vision / 1e6,
            config.model_type,
        )
    kernels = prepare_kernels(model, "cuda" if device.startswith("cuda") else "cpu")
    return model, TargetInfo(
        cls=type(model).__name__, multimodal=multimodal, vision_params=vision, kernels=kernels
    )
