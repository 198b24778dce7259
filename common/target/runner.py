"""The target as ``dflash-eval`` and the demo run it: one model, one KV cache, and hooks that capture the
drafter's K context layers for every token the target processes (prefill and verify forwards alike)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from dflash.common.target.capture import find_decoder

log = logging.getLogger(__name__)


def _crop(cache: Any, length: int) -> None:
    """Keep the first `length` positions of a DynamicCache (transformers 5 crops by a negative count)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


class TargetRunner:
    """The target LM with one KV cache and hooks that capture the drafter's K context layers.

    Layer i's feature is the output of decoder layer i (HF `hidden_states[i + 1]`); for the last layer that
    is the final norm's output, as the producer captures it (dflash.common.target.capture).
    """
    def __init__(self, model: nn.Module, layer_ids: Sequence[int]):

        self.model = model
        _, layers, norm = find_decoder(model)
        self.layer_ids = [int(i) for i in layer_ids]
        bad = [i for i in self.layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"drafter target_layer_ids {bad} do not exist in a {len(layers)}-layer target")
        self._captured: dict[int, torch.Tensor] = {}
        self._capture = False
        self._handles = []
        for i in sorted(set(self.layer_ids)):
            module = norm if i == len(layers) - 1 else layers[i]
            self._handles.append(module.register_forward_hook(self._hook(i)))
        self.cache = None
        self.device = next(model.parameters()).device
        # transformers >= 5.2x renamed `past_key_values` to `cache` (the old name warns, then goes away)
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self._capture:
                self._captured[layer] = (output[0] if isinstance(output, tuple) else output)[0]

        return hook

    def reset(self) -> None:

        self.cache = DynamicCache(config=self.model.config)
        if hasattr(self.cache, "activate_past_recording"):  # lets sliding-window layers be cropped
            self.cache.activate_past_recording()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def crop(self, length: int) -> None:
        _crop(self.cache, length)

    @torch.no_grad()
    def forward(
        self, ids: torch.Tensor, *, last_logits_only: bool = False, capture: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `ids` [n] at positions length..length+n-1 -> (logits [n or 1, V], features [n, K*H] or None)."""
        start = self.length
        positions = torch.arange(start, start + ids.shape[0], device=self.device)
        self._capture, self._captured = capture, {}
        try:
            out = self.model(
                input_ids=ids[None].to(self.device),
                position_ids=positions[None],
                use_cache=True,
                **{self._cache_kw: self.cache},
                logits_to_keep=1 if last_logits_only else 0,
            )
        finally:
            self._capture = False
        feats = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1) if capture else None
        self._captured = {}
        return out.logits[0], feats

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
