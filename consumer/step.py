"""One training step's pieces, shared by the trainer and ops/bench/consumer_bench.py: the forward and
backward, the loss, compiling the draft layers, the step's stats. The optimizer (built for the precision,
its step with clipping folded in, the mixed precision's master weights) is consumer/optim.py."""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass, field

import torch

from dflash.common.drafter.batch import DraftBatch
from dflash.common.drafter.loss import (
    DraftLossOutput,
    LinearCrossEntropy,
    SelectorTerm,
    draft_loss,
    linear_cross_entropy,
)
from dflash.common.drafter.model import DFlashDrafter
from dflash.consumer.config import StepConfig

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """Sums over a logging interval. Device tensors accumulate without a host sync per step."""

    loss_sum: torch.Tensor | float = 0.0
    weight_sum: float = 0.0
    correct: torch.Tensor | int = 0
    valid: torch.Tensor | int = 0
    tau_sum: torch.Tensor | float = 0.0
    blocks: torch.Tensor | int = 0
    tokens: int = 0
    samples: int = 0
    steps: int = 0
    grad_norm: torch.Tensor | float = 0.0
    selector: list | None = None
    """DFlash2: [selector loss sum, correct, covered, valid rows] over the interval (None for DFlash)."""
    t0: float = field(default_factory=time.monotonic)

    def add(
        self, r: DraftLossOutput, *, weight: float, grad_norm: torch.Tensor, tokens: int, samples: int
    ) -> None:
        self.loss_sum = self.loss_sum + r.loss_sum.detach()
        self.weight_sum += weight
        self.correct = self.correct + r.correct
        self.valid = self.valid + r.valid
        self.tau_sum = self.tau_sum + r.tau_sum
        self.blocks = self.blocks + r.num_blocks
        self.tokens += tokens
        self.samples += samples
        self.steps += 1
        self.grad_norm = grad_norm
        if r.selector is not None:
            sel = r.selector
            now = [sel.loss_sum.detach(), sel.correct, sel.covered, sel.valid]
            self.selector = (
                now if self.selector is None else [a + b for a, b in zip(self.selector, now, strict=True)]
            )


def forward_backward(
    model: DFlashDrafter,
    train_model: torch.nn.Module,
    batch: DraftBatch,
    *,
    loss_scale: torch.Tensor | float,
    chunk_tokens: int = 2048,
    autocast: bool | None = None,
    lce: LinearCrossEntropy | None = None,
    selector_alpha: float = 0.0,
) -> DraftLossOutput:
    """One step's forward and backward (shared by the trainer and ops/bench/consumer_bench.py).

    ``train_model`` is ``model`` or its DDP wrapper. The mask is built once per step outside the compiled
    layers. ``autocast`` (bf16): default on for fp32 parameters on CUDA (precision "amp"), off otherwise
    (bf16 parameters run in bf16 as they are; fp32 on the CPU). ``loss_scale`` turns the local loss sum into
    this rank's share of sum(loss) / global supervised weight (DDP averages gradients over ranks).
    ``lce``: the lm_head + cross-entropy (``make_loss``); default the chunked one of ``chunk_tokens`` rows.
    ``selector_alpha``: a DFlash2 drafter's selector-loss weight this step (``selector_weight``); its term
    stays in the graph at 0 (the warm-up), so DDP sees every parameter used each step.
    """
    device_type = batch.input_ids.device.type
    mask = model.build_mask(batch)
    if autocast is None:
        autocast = device_type == "cuda" and model.fc.weight.dtype == torch.float32
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        hidden_out = train_model(batch, mask)
        selector = (
            SelectorTerm(selector=model.candidate_selector, alpha=selector_alpha)
            if model.spec.dflash2
            else None
        )
        result = draft_loss(
            hidden_out,
            batch,
            model.target_head.lm_head_weight,
            chunk_tokens=chunk_tokens,
            lce=lce,
            selector=selector,
        )
    (result.loss_sum * loss_scale).backward()
    return result


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the trainable parameters only: buffers such as rotary ``inv_freq`` stay fp32 (a bf16
    ``inv_freq`` is off by whole radians at position 4000)."""
    for p in model.parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)


def make_loss(cfg: StepConfig, device: torch.device) -> LinearCrossEntropy:
    """The step's lm_head + cross-entropy for this device (``StepConfig.loss_impl``). liger needs CUDA and
    the liger-kernel package: anything else is one clear error here, before the model is compiled."""
    impl = cfg.resolved_loss_impl(device.type)
    if device.type == "cuda" and impl == "chunked" and cfg.loss_impl == "auto":
        log.warning(
            "liger-kernel is not installed: the loss runs on the chunked torch passes (~5 %% slower a step on "
            "an H200, docs/benchmarks.md); pip install 'dflash-spool[cuda]'"
        )
    if impl == "liger":
        if device.type != "cuda":
            raise ValueError("loss-impl liger needs a CUDA device (its kernel is Triton): use chunked")
        if importlib.util.find_spec("liger_kernel") is None:
            raise ValueError("loss-impl liger needs the liger-kernel package: pip install liger-kernel")
    return linear_cross_entropy(impl, chunk_tokens=cfg.loss_chunk_tokens)


def compile_drafter(model: DFlashDrafter, backend: str) -> None:
    """Compile each draft decoder layer once per process (flex_attention is compiled inside on CUDA).

    Parameters are graph inputs, so the five layers share one graph; step shapes never change, so nothing
    recompiles after the first step.
    """
    if backend == "eager":
        return
    for layer in model.layers:
        layer.compile(backend=backend, dynamic=False)
