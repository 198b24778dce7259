"""The producer's ``trunk`` compile scope: the text model cut after its last captured layer as one module whose
forward returns the captured layers' outputs, so that one graph can hold the whole truncated trunk.

Why wrapper modules and not the capture hooks (common/target/capture.py): a forward hook cannot raise out
of a compiled graph to stop early, and its side effects would break the graph; taps keep each captured
output as an attribute of the forward, and the layers after the last captured one are replaced by
pass-throughs that are never computed.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.common.target.capture import LayerCapture


class Tap(nn.Module):
    """Wraps a layer (or the final norm) in the ``trunk`` scope and keeps its output of this forward."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.out: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self.out = out[0] if isinstance(out, tuple) else out
        return out


class Skip(nn.Module):
    """A layer after the last captured one in the ``trunk`` scope: returns its input (never computed)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class TappedTrunk(nn.Module):
    """The text model cut after the last captured layer, returning the captured layers' outputs
    concatenated along features: [B, S, K*H] (the same values as LayerCapture, see capture.py)."""

    def __init__(self, capture: LayerCapture):
        super().__init__()
        self.text_model = capture.text_model
        layers, last, n = capture.layers, max(capture.layer_ids), capture.num_layers
        self.replaced = [(layers, str(i), layers[i]) for i in range(n)] + [
            (self.text_model, "norm", self.text_model.norm)
        ]
        taps: dict[int, Tap] = {}
        for i in sorted(set(capture.layer_ids)):
            if i == n - 1:  # HF's hidden_states[L] is taken after the final norm: tap the norm
                taps[i] = self.text_model.norm = Tap(capture.norm)
            else:
                taps[i] = layers[i] = Tap(layers[i])
        for j in range(last + 1, n):
            layers[j] = Skip()
        if last < n - 1:
            self.text_model.norm = nn.Identity()
        self.taps = [taps[i] for i in capture.layer_ids]

    def restore(self) -> None:
        """Put the text model's own modules back (benchmarks run several variants on one model)."""
        for parent, name, module in self.replaced:
            setattr(parent, name, module)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.text_model(input_ids=input_ids, use_cache=False)
        out = torch.cat([t.out for t in self.taps], dim=-1)
        for t in self.taps:
            t.out = None
        return out
