"""FP8 hidden states: e4m3 values with one bf16 scale per (token, captured layer).

Why this shape (docs/shard-format.md, "FP8 hidden states", has the measured figures):

- **e4m3** (`torch.float8_e4m3fn`: 4 exponent bits, 3 mantissa bits, max 448, no inf): hidden states need
  relative precision over a wide range more than they need range; e4m3's 3 mantissa bits give a relative
  rounding error of at most 2^-4 on every value above the subnormals.
- **One scale per token and captured layer**: each layer's slice of a token's features is divided by
  amax / 448, so its largest value lands on e4m3's largest. A token with a massive activation (a channel
  hundreds or thousands of times its neighbours) sets a large scale for that token and layer only; floats
  keep their relative precision under a large scale, and its other channels lose precision only when they
  fall more than 2^14.8 below the outlier (into e4m3's subnormals: below 2^-6 of the scale's unit), so
  the damage stays on those few tokens instead of on the whole shard.
- **bf16 scales**: the values are divided by the scale as stored, so the scale's own rounding costs
  nothing but a sliver of range; bf16 has fp32's exponent range, half its bytes, and makes dequantization
  one bf16 multiply (an e4m3 value times a bf16 scale is rounded once to bf16, on the CPU or the GPU).
- **Clamped before the cast**: a bf16-rounded scale can put amax / scale a hair above 448; torch's cast
  saturates there anyway, the clamp makes the codec independent of that.
- **Non-finite values are never quantized silently**: a NaN or inf in a slice makes its scale NaN or inf
  (amax propagates them), which `nonfinite_problem` reports by sample id. The check reads only the
  [T, K] scales, so it costs nothing next to the encode, and it runs wherever a shard is written or read.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_DTYPE = torch.bfloat16
FP8_NAME = "float8_e4m3fn"
"""The shard attribute `hidden_dtype` of an FP8 shard (torch's name for the type)."""
MIN_SCALE = 2.0**-126
"""A slice of zeros gets this scale (bf16's smallest normal): its zeros restore exactly, nothing divides
by zero."""
QUANTIZE_CHUNK_ROWS = 2048
"""Tokens quantized at once: bounds the fp32 temporaries (a 32K-token 8B batch at once would need 2.7 GB
of them on the GPU; 2048 rows need 168 MB)."""


class NonFiniteHiddenError(ValueError):
    """A hidden state holds NaN or inf: the target's forward went wrong; the shard is not written."""


def quantize(hidden: torch.Tensor, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 (or fp32) [T, K*H] -> (e4m3 [T, K*H], bf16 scales [T, K]) on the device `hidden` is on.

    Runs without a host sync (kernels only), so a producer queues it after the forward and before the
    device-to-host copy. A slice holding NaN or inf gets a NaN or inf scale: check `nonfinite_problem`
    before trusting the result.
    """
    if hidden.dim() != 2 or num_layers < 1 or hidden.shape[1] % num_layers:
        raise ValueError(f"hidden {list(hidden.shape)} is not [T, K*H] for K={num_layers} layers")
    rows, width = hidden.shape
    size = width // num_layers
    values = torch.empty(rows, width, dtype=FP8_DTYPE, device=hidden.device)
    scales = torch.empty(rows, num_layers, dtype=SCALE_DTYPE, device=hidden.device)
    for a in range(0, rows, QUANTIZE_CHUNK_ROWS):
        b = min(rows, a + QUANTIZE_CHUNK_ROWS)
        x = hidden[a:b].reshape(b - a, num_layers, size).float()
        scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE).to(SCALE_DTYPE)
        x.div_(scale.float().unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
        values[a:b] = x.reshape(b - a, width).to(FP8_DTYPE)
        scales[a:b] = scale
    return values, scales


def dequantize(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(e4m3 [T, K*H], bf16 scales [T, K]) -> [T, K*H] of `dtype`, on their device.

    The product is formed in bf16: each e4m3 value is exact in bf16 and a bf16 multiply rounds the exact
    product once, so the values restored are those of the shard format's three-line recipe on any device;
    another `dtype` is a cast of them.
    """
    rows, width = values.shape
    num_layers = scales.shape[1]
    out = values.to(torch.bfloat16).view(rows, num_layers, width // num_layers)
    out.mul_(scales.to(torch.bfloat16).unsqueeze(-1))
    out = out.view(rows, width)
    return out if dtype == torch.bfloat16 else out.to(dtype)


def nonfinite_problem(
    scales: torch.Tensor, cu_seqlens: torch.Tensor, sample_index: torch.Tensor, layer_ids: list[int]
) -> str | None:
    """Why these scales cannot be trusted (naming the first sample, token and layer whose hidden state
    holds NaN or inf, and how many samples do), or None. Reads only the [T, K] scales."""
    bad = ~torch.isfinite(scales.float())
    if not bool(bad.any()):
        return None
    rows = bad.any(dim=1).nonzero().squeeze(1)
    cu = cu_seqlens.cpu()
    samples = torch.searchsorted(cu, rows.cpu(), right=True) - 1
    row = int(rows[0])
    layer = int(bad[row].nonzero()[0, 0])
    first = int(samples[0])
    what = "nan" if bool(torch.isnan(scales[row, layer].float())) else "inf"
    count = int(torch.unique(samples).numel())
    return (
        f"sample {int(sample_index[first])}: its hidden state at token {row - int(cu[first])} of layer "
        f"{layer_ids[layer]} is {what} ({count} sample(s) with non-finite hidden states)"
    )
