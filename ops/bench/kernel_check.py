"""Are fla's kernels as accurate as the reference? Each bf16 path against one fp32 truth, per captured layer.

Why this shape: comparing fla with the torch reference kernels, both in bf16, measures the two paths'
bf16 rounding added together (0.013 at layer 1 to 0.084 at layer 61 of a random 64-layer stack, growing
with depth), so no fixed bound on it says whether fla is right. Here the truth is the same random target
in fp32 on the reference kernels; the bf16 model on the reference kernels gives the error bf16 itself costs,
and fla's error is judged against that, layer by layer: fla passes when its error is at most
``FLA_ERROR_RATIO`` times the reference's own bf16 error (plus a floor for layers where both are tiny). A
slice of the full stack (default 8 layers: 6 Gated DeltaNet + 2 attention) keeps the fp32 model small;
the error per layer does not depend on what comes after it.
"""

from __future__ import annotations

import torch
from targets import build_target

from dflash.common.drafter.layers import default_target_layer_ids
from dflash.common.target.capture import LayerCapture
from dflash.common.target.kernels import force_reference_kernels, linear_attention_kernels

FLA_ERROR_RATIO = 1.5
"""fla's rel L2 error against the fp32 truth may be this many times the reference kernels' bf16 error: room
for a different (still bf16) summation order in the chunked kernels, none for a wrong result (a wrong
delta rule is off by O(1), a thousand times more)."""
ERROR_FLOOR = 1e-3
"""Errors below this pass whatever the ratio (a layer where bf16 costs almost nothing)."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def kernel_check(preset: str, layers: int, ids: torch.Tensor, device: torch.device) -> dict:
    """fla (bf16) and the reference kernels (bf16) against the fp32 reference forward of the same random
    ``layers``-deep target on ``ids`` [rows, length]; the verdict per captured layer (see the module)."""
    model = build_target(preset, layers=layers, device=str(device), dtype=torch.float32)
    kernels = linear_attention_kernels(model)
    layer_ids = default_target_layer_ids(layers)
    cap = LayerCapture(model, layer_ids)
    with torch.inference_mode():
        undo = force_reference_kernels(model)
        truth = cap.run(ids).float()
        model.to(torch.bfloat16)
        reference = cap.run(ids).float()
        undo()
        fla = cap.run(ids).float()
    cap.close()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    fast = bool(kernels and kernels.fast)
    return {
        "layers": layers,
        "tokens": int(ids.numel()),
        "kernels": kernels.kernels if kernels else None,
        **verdict(layer_ids, truth, reference, fla, fast=fast),
    }


def verdict(layer_ids: list[int], truth, reference, fla, *, fast: bool) -> dict:
    """Per captured layer (features concatenated along the last dim, as captured): each bf16 path's
    relative L2 error against the fp32 truth and fla's pass / fail; ``ok`` is None when fla did not run
    (nothing was checked), else whether every layer passed."""
    per_layer = {}
    for i, t, r, f in zip(
        layer_ids, *(x.chunk(len(layer_ids), -1) for x in (truth, reference, fla)), strict=True
    ):
        ref_err, fla_err = _rel(r, t), _rel(f, t)
        per_layer[i] = {
            "reference_bf16": round(ref_err, 5),
            "fla_bf16": round(fla_err, 5),
            "ratio": round(fla_err / ref_err, 3) if ref_err else None,
            "ok": fla_err <= max(FLA_ERROR_RATIO * ref_err, ERROR_FLOOR),
        }
    return {
        "fast": fast,
        "per_layer": per_layer,
        "worst_ratio": max(v["ratio"] or 0.0 for v in per_layer.values()),
        "bound": f"fla error <= {FLA_ERROR_RATIO} x the reference's bf16 error (floor {ERROR_FLOOR}) per layer",
        "ok": all(v["ok"] for v in per_layer.values()) if fast else None,
    }
