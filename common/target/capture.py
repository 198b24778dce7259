"""Capture the hidden states of K decoder layers and stop the target forward after the last one.

Why hooks and an early stop: DFlash needs the outputs of K layers spaced from layer 1 to L-3, never the
logits. `output_hidden_states=True` keeps all L+1 hidden states alive and still runs the last layers and
the lm_head (a [tokens, vocab] matmul: ~10 % of an 8B model's FLOPs with a 152K vocabulary). Forward
hooks on the chosen layers copy just their outputs (real tokens only, already packed) into one
[T, K*H] buffer, and the hook of the last chosen layer raises a private exception that ends the forward,
so later layers, the final norm and the lm_head never run.

Which module's output is layer i's feature is the drafter's capture rule (``feature_module`` in
dflash.common.drafter.dflash: the output of decoder layer i, HF `hidden_states[i + 1]`, the final norm's
output for the last layer), shared with ``dflash-eval`` and the exported ``spec_generate``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from dflash.common.drafter.dflash import feature_module, find_decoder

log = logging.getLogger(__name__)

__all__ = ["LayerCapture", "find_decoder", "num_target_layers"]


class _StopForward(Exception):
    """Raised by the hook of the last captured layer to end the forward early (caught in `run`)."""


class _Unused(nn.Module):
    """Stands in for a module that must never run (layers after the last captured one, the lm_head)."""

    def __init__(self, name: str, attention_type: str | None = None):
        super().__init__()
        self.name = name
        if attention_type is not None:
            self.attention_type = attention_type

    def forward(self, *args, **kwargs):
        raise AssertionError(f"{self.name} was freed by LayerCapture(free_unused=True) but ran")


def num_target_layers(model: nn.Module) -> int:
    return len(find_decoder(model)[1])


class LayerCapture:
    """Hooks on a target model that return the packed outputs of `layer_ids` for each forward.

    `run(input_ids, valid)` -> [T, K*H] with T = valid.sum(): for each captured layer k, the rows of its
    output at the positions where `valid` is True (row-major, i.e. sample by sample), concatenated along
    the feature dim in `layer_ids` order. With `stop_early` the forward ends after the last captured layer.
    """

    def __init__(
        self,
        model: nn.Module,
        layer_ids: Sequence[int],
        *,
        stop_early: bool = True,
        free_unused: bool = False,
    ):
        self.model = model
        self.text_model, self.layers, self.norm = find_decoder(model)
        num_layers = len(self.layers)
        self.layer_ids = [int(i) for i in layer_ids]
        if not self.layer_ids:
            raise ValueError("layer_ids: must not be empty")
        bad = [i for i in self.layer_ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"layer_ids={self.layer_ids}: must be in [0, {num_layers})")
        self.num_layers = num_layers
        self.hidden_size = self.text_model.embed_tokens.embedding_dim
        self.stop_early = stop_early
        self._out: torch.Tensor | None = None
        self._index: torch.Tensor | None = None
        self._handles = []
        last = max(self.layer_ids)
        for i in sorted(set(self.layer_ids)):  # a repeated id (small L) fills several column slots
            slots = [k for k, j in enumerate(self.layer_ids) if j == i]
            module = feature_module(self.layers, self.norm, i)
            self._handles.append(
                module.register_forward_hook(self._make_hook(slots, stop=stop_early and i == last))
            )
        if free_unused:
            self._free_after(last)

    def _make_hook(self, slots: list[int], *, stop: bool):
        h = self.hidden_size

        def hook(module, args, output):
            if self._out is None:
                return None  # a forward not started by run(): leave it alone
            hs = (output[0] if isinstance(output, tuple) else output).reshape(-1, h)
            rows = hs if self._index is None else hs.index_select(0, self._index)
            for k in slots:
                self._out[:, k * h : (k + 1) * h].copy_(rows)
            if stop:
                raise _StopForward
            return None

        return hook

    def _free_after(self, last: int) -> None:
        """Drop the weights of modules that can never run (saves memory on the producer GPU)."""
        if not self.stop_early or last == self.num_layers - 1:
            return
        for j in range(last + 1, self.num_layers):
            self.layers[j] = _Unused(f"layer {j}", getattr(self.layers[j], "attention_type", None))
        if isinstance(getattr(self.model, "lm_head", None), nn.Module):
            self.model.lm_head = _Unused("lm_head")
        self.text_model.norm = _Unused("final norm")

    @property
    def feature_size(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    def run(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Forward `input_ids` [B, S] (right-padded; no attention mask needed: causal) and return the
        captured features of the positions where `valid` [B, S] is True (all positions if None).

        Pass `valid` as a CPU tensor: the positions are then gathered with an index computed on the host,
        so nothing in the forward waits for the GPU (a boolean mask on the GPU would force a sync).
        """
        if valid is not None and valid.shape != input_ids.shape:
            raise ValueError(f"valid shape {tuple(valid.shape)} != input_ids shape {tuple(input_ids.shape)}")
        device = input_ids.device
        if valid is None:
            index, num_rows = None, input_ids.numel()
        else:
            index = valid.reshape(-1).nonzero().squeeze(1)
            num_rows = int(index.numel())  # free on the CPU; a sync if the caller passed a GPU mask
            if index.device != device:
                index = (
                    index.pin_memory().to(device, non_blocking=True)
                    if device.type == "cuda"
                    else index.to(device)
                )
        param = next(self.text_model.parameters())
        self._out = torch.empty(num_rows, self.feature_size, dtype=param.dtype, device=device)
        self._index = index
        try:
            self.text_model(input_ids=input_ids, use_cache=False)
        except _StopForward:
            pass
        finally:
            out, self._out, self._index = self._out, None, None
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
