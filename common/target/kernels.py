"""Which kernels a hybrid target's linear-attention layers run on, said in one line, and the switches around
them.

Why: Qwen3.5/3.6 (and Qwen3-Next) interleave Gated DeltaNet layers with full attention. transformers runs a
GDN layer on flash-linear-attention's Triton kernels (`fla`, from ``fla-core``) when that package imports,
else on its own PyTorch reference (measured 1.52x slower at the 27B shape, docs/producer.md); the causal
conv likewise on ``causal-conv1d`` or a reference conv. The choice is silent but for a transformers warning
at the first forward, so a producer says on its start line which kernels it will run on, and warns once
when the chunked delta rule (the prefill kernel, the one that matters) is the reference.

How transformers chooses (read in its source, docs/producer.md "Hybrid targets"):
- 5.15 and later: module-level functions of the modeling module (``torch_chunk_gated_delta_rule``,
  ``causal_conv1d_fn``, ...) are wrappers whose closure cell ``implementation`` is fla's / causal-conv1d's
  function or the wrapped torch reference (``__wrapped__``); it is resolved once, at import, and the
  device is not checked: on a CPU with fla installed the forward would call a Triton kernel and fail. A
  global is process-wide (every model of the module calls it), so it is not switched to the reference for
  a CPU target, which would put a CUDA target of the same process on the slow path without a word: it is
  routed by the device of its input instead (`route_kernels_by_device`: fla on CUDA tensors, the torch
  reference on any other). 5.15/5.16 miss fla when ``fla.ops`` is not imported yet, which importing it
  first (`prefer_fast_kernels`) avoids.
- 5.25 and later (with the ``kernels`` package, a dependency of transformers then): each such wrapper is
  itself wrapped in a hub-kernel ``Func`` module (``_unwrap_hub_func``), and the wrapper checks the device
  itself; the routing stays for the versions before and changes nothing here.
- 5.2 to 5.14: each GDN layer holds the functions as attributes (``chunk_gated_delta_rule``,
  ``causal_conv1d_fn`` None when absent); fla is used only on CUDA.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from dflash.common.target.fla_configs import reuse_tuned_configs

log = logging.getLogger(__name__)

# the prefill (no cache) kernels: what a producer's forward runs. name -> (5.15+ module global, layer attr)
PREFILL_KERNELS = {
    "chunk_gated_delta_rule": ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule"),
    "causal_conv1d": ("causal_conv1d_fn", "causal_conv1d_fn"),
}
# every kernel global a 5.15+ modeling module resolves to fla / causal-conv1d at import (decoding runs the last two)
ROUTED_GLOBALS = (
    "torch_chunk_gated_delta_rule",
    "causal_conv1d_fn",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_update",
)
# transformers' own fallback notices: replaced by the one line of `KernelReport.warning`
_FALLBACK_NOTICES = ("falling back to its reference PyTorch implementation", "The fast path is not available")
_NOTICE_LOGGERS = (
    "transformers.integrations.hub_kernels",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.qwen3_next.modeling_qwen3_next",
)
REFERENCE = "torch reference"
INSTALL_HINT = "pip install 'dflash-spool[hybrid]' (docs/producer.md, Hybrid targets)"


@dataclass
class KernelReport:
    """The kernels of one hybrid target's linear-attention layers: function -> where it comes from."""

    layers: int  # linear-attention layers in the (loaded part of the) model
    kernels: dict[str, str]  # prefill kernel name -> "fla.ops.gated_delta_rule.chunk" | REFERENCE

    @property
    def fast(self) -> bool:
        """The chunked delta rule (the prefill's main kernel) runs on fla, not the torch reference."""
        return self.kernels.get("chunk_gated_delta_rule") != REFERENCE

    def line(self) -> str:
        parts = ", ".join(f"{k} on {v}" for k, v in self.kernels.items())
        return f"{self.layers} linear-attention layers: {parts}"

    def warning(self) -> str | None:
        """One line when the delta rule runs on the slow reference (None when it is fast)."""
        if self.fast:
            return None
        return (
            f"hybrid target on the slow reference kernels ({self.line()}; ~1.5x slower at the 27B shape): "
            f"{INSTALL_HINT}"
        )


def _gdn_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def _unwrap_hub_func(fn: Callable | None) -> Callable | None:
    """The function inside a hub-kernel ``Func`` module: with the ``kernels`` package installed (a dependency
    of transformers >= 5.25), its ``use_kernel_forward_from_hub`` turns the module-level kernel function into
    an ``nn.Module`` instance whose forward calls the function it closes over."""
    if isinstance(fn, nn.Module):
        inner = inspect.getclosurevars(type(fn).forward).nonlocals.get("func")
        return inner if callable(inner) else fn
    return fn


class DeviceRouted:
    """A kernel global that runs ``fast`` (transformers' wrapper around fla / causal-conv1d) on CUDA inputs
    and ``reference`` (the torch function that wrapper was made from) on any other device: what
    transformers 5.25 does inside its wrapper, for the versions whose wrapper does not look."""

    def __init__(self, fast: Callable, reference: Callable):
        self.fast, self.reference = fast, reference
        functools.update_wrapper(self, reference)

    def __call__(self, *args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if hasattr(a, "is_cuda")), None)
        return (self.fast if first is not None and first.is_cuda else self.reference)(*args, **kwargs)


def _origin(fn: Callable | None, device_type: str = "cuda") -> str:
    """Where a kernel function comes from on ``device_type``: its module (fla, causal_conv1d) or REFERENCE."""
    if isinstance(fn, DeviceRouted):
        return _origin(fn.fast) if device_type == "cuda" else REFERENCE
    fn = _unwrap_hub_func(fn)
    if fn is None:
        return REFERENCE
    wrapped = getattr(fn, "__wrapped__", None)
    impl = inspect.getclosurevars(fn).nonlocals.get("implementation", fn) if wrapped is not None else fn
    if impl is wrapped or impl.__module__.startswith("transformers."):
        return REFERENCE
    return impl.__module__


def _modeling_module(gdn: nn.Module):
    return sys.modules[type(gdn).__module__]


def _device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


def linear_attention_kernels(model: nn.Module, device_type: str | None = None) -> KernelReport | None:
    """The report of a hybrid target on ``device_type`` (default: where its parameters are); None when the
    model has no linear-attention layer. 5.2 - 5.14 use fla only on CUDA, whatever their attributes hold."""
    gdns = _gdn_modules(model)
    if not gdns:
        return None
    first, mod = gdns[0], _modeling_module(gdns[0])
    device_type = device_type or _device_type(model)
    kernels = {}
    for name, (global_name, attr) in PREFILL_KERNELS.items():
        if hasattr(first, attr):  # transformers 5.2 - 5.14: per-layer attributes
            origin = _origin(getattr(first, attr))
            kernels[name] = origin if device_type == "cuda" else REFERENCE
        else:
            kernels[name] = _origin(getattr(mod, global_name, None), device_type)
    return KernelReport(layers=len(gdns), kernels=kernels)


def route_kernels_by_device(model: nn.Module) -> None:
    """Route the model's modeling module's fast kernel globals (5.15+) by the device of their input: fla /
    causal-conv1d on CUDA tensors, the torch reference elsewhere (`DeviceRouted`). Once per module;
    globals on the reference, and 5.2 - 5.14's per-layer attributes, are left as they are."""
    for mod in {_modeling_module(gdn) for gdn in _gdn_modules(model)}:
        for global_name in ROUTED_GLOBALS:
            fn = getattr(mod, global_name, None)
            if fn is None or isinstance(fn, DeviceRouted) or _origin(fn) == REFERENCE:
                continue
            reference = getattr(_unwrap_hub_func(fn), "__wrapped__", None)
            if reference is not None:
                setattr(mod, global_name, DeviceRouted(fn, reference))


def prefer_fast_kernels() -> bool:
    """Import fla's delta-rule ops before transformers resolves its kernels (5.15/5.16 otherwise miss
    them when ``fla.ops`` is not imported yet), set to reuse what it tunes at every token count
    (fla_configs.py). True when they import (fla and triton installed)."""
    reuse_tuned_configs()
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception:  # noqa: BLE001 - not installed, or no triton / no driver: the reference path then
        return False
    return True


def force_reference_kernels(model: nn.Module) -> Callable[[], None]:
    """Run the model's linear-attention layers on transformers' torch reference kernels; returns the undo.

    For a CPU target with fla installed (its Triton kernels need a GPU) and for benchmarks comparing the
    two paths. 5.15+: the modeling module's globals (looked up at call time) point at the wrapped torch
    functions; 5.2-5.14: each layer's attributes do.
    """
    undo: list[tuple[object, str, object]] = []
    done: set[str] = set()
    for gdn in _gdn_modules(model):
        mod = _modeling_module(gdn)
        if hasattr(gdn, "chunk_gated_delta_rule"):  # 5.2 - 5.14
            undo += [(gdn, a, getattr(gdn, a)) for a in ("chunk_gated_delta_rule", "causal_conv1d_fn")]
            gdn.chunk_gated_delta_rule = mod.torch_chunk_gated_delta_rule
            gdn.causal_conv1d_fn = None  # the layer's own nn.Conv1d + SiLU
        elif mod.__name__ not in done:  # 5.15+: once per modeling module
            done.add(mod.__name__)
            for global_name, _ in PREFILL_KERNELS.values():
                fn = getattr(mod, global_name, None)
                inner = fn.reference if isinstance(fn, DeviceRouted) else _unwrap_hub_func(fn)
                reference = inner if isinstance(fn, DeviceRouted) else getattr(inner, "__wrapped__", None)
                if reference is not None:
                    undo.append((mod, global_name, fn))
                    setattr(mod, global_name, reference)

    def restore() -> None:
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)

    return restore


class _DropFallbackNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in _FALLBACK_NOTICES)


def quiet_fallback_notices() -> None:
    """Drop transformers' per-kernel fallback warnings: the producer says it in one line instead."""
    for name in _NOTICE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropFallbackNotices) for f in logger.filters):
            logger.addFilter(_DropFallbackNotices())


def prepare_kernels(model: nn.Module, device_type: str) -> KernelReport | None:
    """Route the hybrid target's kernels by device (a CPU target runs the torch reference, fla's kernels
    need a GPU; a CUDA target of the same process keeps fla), report them for ``device_type``, and log the
    one-line warning for the reference path on CUDA. None for a model without linear attention."""
    if linear_attention_kernels(model) is None:
        return None
    quiet_fallback_notices()
    route_kernels_by_device(model)
    report = linear_attention_kernels(model, device_type)
    if device_type != "cuda" and linear_attention_kernels(model, "cuda").fast:
        log.info("CPU target: linear attention on the torch reference (fla's kernels need a GPU)")
    if (warning := report.warning()) is not None and device_type == "cuda":
        log.warning(warning)
    return report
