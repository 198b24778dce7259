"""A Gated DeltaNet mixer's memory-bound parts in forms torch.compile fuses: the short causal conv and the
gated RMSNorm.

Why: the producer runs each hybrid mixer outside the compiled layer graphs (fla's kernels are its core), so
its elementwise work ran as eager PyTorch. A kernel table of the 27B hybrid's producer (two steady batches,
one H200, docs/benchmarks.md) put 28 % of the GPU's time there: the causal conv on transformers' reference
(``F.conv1d`` with one group per channel: PyTorch's generic depthwise kernel, 6 %, then a separate SiLU),
the gated norm as seven fp32 passes (11 % with the gates), and copies of the conv's [B, D, T] output back
to [B, T, D] (11 %). Compiled, each is one fused pass:

- `ShiftedCausalConv`: the kernel-size-W causal conv as W shifted multiply-adds plus the activation (one
  read and one write per element under inductor), computed in [B, T, D] and handed back as the [B, D, T]
  view transformers expects, so its transpose back is free and q/k/v are views of one buffer. Used where
  transformers would run its reference conv (the ``causal-conv1d`` package absent: it has no wheels).
- the gated norm module's own forward, compiled (norm, weight and SiLU gate in one kernel).

`compile_mixer_parts` swaps them in for a model and returns the undo. Same math as transformers' reference
(fp32 sums in another order: equal within rounding, tests/test_mixer_kernels.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dflash.common.target.fp8 import fp8_linears

CONV_GLOBAL = "causal_conv1d_fn"
_ACTIVATIONS: dict[str | None, Callable[[torch.Tensor], torch.Tensor] | None] = {
    None: None,
    "silu": F.silu,
    "swish": F.silu,
}


def causal_conv_btd(
    hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """The causal conv of ``hidden_states`` [B, D, T] (a view of [B, T, D] memory) as a contiguous [B, T, D]
    tensor: the graph torch.compile turns into one pass, reading and writing along D (coalesced)."""
    x = hidden_states.transpose(1, 2).to(weight.dtype)  # [B, T, D]: a view of the projection's output
    length, width = x.shape[1], weight.shape[-1]
    padded = F.pad(x, (0, 0, width - 1, 0))  # zeros before the first token: causal
    taps = weight.t()  # [W, D]
    out = padded[:, 0:length] * taps[0]
    for k in range(1, width):
        out = out + padded[:, k : k + length] * taps[k]
    if bias is not None:
        out = out + bias
    act = _ACTIVATIONS[activation]
    out = act(out) if act is not None else out
    return out.to(hidden_states.dtype)


class ShiftedCausalConv:
    """transformers' ``causal_conv1d_fn`` contract: ``hidden_states`` [B, D, T], ``weight`` [D, W] (one
    filter per channel) -> activation(causal conv) [B, D, T], returned as the transposed view of
    `causal_conv_btd`'s [B, T, D] result (the view outside the compiled graph, so the graph's output is
    contiguous [B, T, D]: written along D, and transformers' transpose back to [B, T, D] is free)."""

    def __init__(self, compile_fn: Callable[[Callable], Callable] = lambda fn: fn):
        self.conv = compile_fn(causal_conv_btd)

    def __call__(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str | None = None,
        **kwargs,
    ) -> torch.Tensor:
        packed = sorted(k for k, v in kwargs.items() if "seq" in k and v is not None)  # seq_idx, cu_seqlens
        if packed:
            raise ValueError(f"causal conv: packed sequences are not supported here ({', '.join(packed)})")
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"causal conv activation {activation!r}: expected one of {sorted(map(str, _ACTIVATIONS))}"
            )
        return self.conv(hidden_states, weight, bias, activation).transpose(1, 2)


def causal_conv_shifted(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    **kwargs,
) -> torch.Tensor:
    """`ShiftedCausalConv` uncompiled (tests, and the reference for its compiled form)."""
    return ShiftedCausalConv()(hidden_states, weight, bias, activation, **kwargs)


def _gdn_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def compile_mixer_parts(
    model: nn.Module, compile_fn: Callable[[Callable], Callable], *, conv_on_reference: bool
) -> Callable[[], None]:
    """Compile the gated norm and the FP8 projections (fp8.Fp8Linear: their activations' quantization fused
    into one kernel) of every Gated DeltaNet mixer of ``model`` (instance attributes: a graph per weight
    shape, parameters as inputs) and, when ``conv_on_reference`` and transformers looks the conv up as a
    module global (5.15+), swap in the compiled `causal_conv_shifted`. Returns the undo."""
    gdns = _gdn_modules(model)
    undo: list[Callable[[], None]] = []
    for gdn in gdns:
        norm = getattr(gdn, "norm", None)
        parts = [norm] if norm is not None else []
        for part in parts + fp8_linears(gdn):
            if "forward" not in vars(part):
                part.forward = compile_fn(part.forward)
                undo.append(lambda part=part: vars(part).pop("forward", None))
    modules = {sys.modules[type(gdn).__module__] for gdn in gdns}
    if conv_on_reference:
        conv = ShiftedCausalConv(compile_fn)
        for mod in modules:
            if hasattr(mod, CONV_GLOBAL) and not any(hasattr(g, CONV_GLOBAL) for g in gdns):
                original = getattr(mod, CONV_GLOBAL)
                undo.append(lambda mod=mod, fn=original: setattr(mod, CONV_GLOBAL, fn))
                setattr(mod, CONV_GLOBAL, conv)

    def restore() -> None:
        for step in reversed(undo):
            step()

    return restore
