"""Load a target for hidden-state capture: its text model only, with its linear-attention kernels reported.

Why: Qwen3.5/3.6 ship as multimodal checkpoints (``Qwen3_5ForConditionalGeneration``: a ``text_config``
sub-config, a vision tower under ``model.visual``, the text model under ``model.language_model``). The
producer needs the text model alone: since transformers 5.2, ``AutoModelForCausalLM`` maps such a config to
the text class (``qwen3_5`` -> ``Qwen3_5ForCausalLM``, built from ``get_text_config()``) and renames the
keys (``model.language_model.*`` -> ``model.*``); the vision tower is never built and its tensors never
read. Subclassing that class would break the rename (a class outside ``transformers.*`` counts as custom
code: random weights, only a log table as the signal), so this module only calls it and checks the result.
A family without such a mapping loads with its vision tower: said in one line, not hidden.

FP8 (fp8.py says why and how): a fine-grained FP8 checkpoint (``quantization_config.quant_method`` "fp8")
loads through transformers' own integration with ``dequantize=True`` (its block scales applied, on any
device), then runs as an FP8 target unless told otherwise; any checkpoint can be made one at load
(``precision="fp8"``). Where FP8 matmuls do not exist it is refused or emulated, as asked, in one line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config

from dflash.common.drafter.dflash import find_decoder
from dflash.common.target.fp8 import fp8_matmul_unavailable, to_fp8
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
    precision: str = ""  # how its linears run when not in the load dtype, e.g. "FP8 (196 linears, ...)"

    def line(self) -> str:
        what = self.cls
        if self.multimodal:
            what += " (text model of a multimodal checkpoint" + (
                ", vision tower loaded)" if self.vision_params else ", no vision tower)"
            )
        if self.kernels is not None:
            what += f"; {self.kernels.line()}"
        if self.precision:
            what += f"; {self.precision}"
        return what


class Fp8Unavailable(ValueError):
    """FP8 was asked for where FP8 matmuls do not run, with ``fp8_fallback="refuse"`` (one line)."""


def checkpoint_is_fp8(config) -> bool:
    """The checkpoint stores fine-grained FP8 weights (transformers' ``quant_method`` "fp8" format)."""
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method)) == "fp8"


def runs_fp8(precision: str, config) -> bool:
    """Whether a target of ``config`` runs FP8 under ``precision`` (auto: as its checkpoint is stored)."""
    return precision == "fp8" or (precision == "auto" and checkpoint_is_fp8(config))


def refusal_line(why: str) -> str:
    """The one line refusing an FP8 target where FP8 matmuls do not run (``why``)."""
    return f"FP8 target refused (--fp8-fallback refuse): {why}; --fp8-fallback emulate runs FP8's numbers (not its speed) in --dtype, --target-precision bf16 runs without FP8"


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


def load_target(
    path: str,
    *,
    dtype: torch.dtype,
    device: str,
    precision: str = "auto",
    fp8_fallback: str = "emulate",
) -> tuple[nn.Module, TargetInfo]:
    """``AutoModelForCausalLM.from_pretrained(path)`` in ``dtype`` on ``device`` (eval mode), text model
    only where transformers can (see the module docstring), kernels prepared (kernels.prepare_kernels);
    its decoder's linears FP8 when ``precision`` says so (`runs_fp8`), emulated where FP8 matmuls do not
    run (``fp8_fallback`` "emulate", one warning line) or refused (``"refuse"``: Fp8Unavailable)."""
    config = AutoConfig.from_pretrained(path)
    fp8 = runs_fp8(precision, config)
    why = fp8_matmul_unavailable(device) if fp8 else None
    if why and fp8_fallback == "refuse":
        raise Fp8Unavailable(refusal_line(why))
    multimodal = hasattr(config, "get_text_config") and config.get_text_config() is not config
    quiet_fallback_notices()  # 5.2-5.14 warn while building the layers: the report says it in one line
    if device.startswith("cuda") and is_hybrid(config):
        prefer_fast_kernels()
    kw: dict = {"dtype": dtype}
    if device.startswith("cuda"):
        kw["device_map"] = {"": device}
    if checkpoint_is_fp8(config):  # its blocks restored to ``dtype``; requantized per channel below
        kw["quantization_config"] = FineGrainedFP8Config(dequantize=True)
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
    how = fp8_target(model, emulate=why is not None, dtype=dtype) if fp8 else ""
    if why:
        log.warning("FP8 target: %s: %s (--fp8-fallback refuse: exit instead)", why, how)
    return model, TargetInfo(
        cls=type(model).__name__, multimodal=multimodal, vision_params=vision, kernels=kernels, precision=how
    )


def fp8_target(model: nn.Module, *, emulate: bool, dtype: torch.dtype) -> str:
    """Make ``model``'s decoder linears FP8 (fp8.to_fp8); returns the phrase the start line carries."""
    count = to_fp8(find_decoder(model)[1], emulate=emulate)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the replaced bf16 weights
    if emulate:
        return (
            f"FP8 e4m3 weights and activations on {count} linears emulated (quantize -> dequantize, "
            f"matmuls in {str(dtype).removeprefix('torch.')}: FP8's numbers, not its speed)"
        )
    return f"FP8 e4m3 on {count} linears (torch._scaled_mm, per-row activation and per-channel weight scales)"
