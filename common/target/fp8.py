"""An FP8 target: the decoder layers' linears as FP8 (e4m3) weights with a scale per output channel, the
activations quantized per row (token) on the fly, the matmul ``torch._scaled_mm`` with rowwise scales.

Why: a producer GPU runs nothing but the target forward, and its matmuls are ~3/4 of that time; Hopper's
FP8 tensor cores run dense matmuls at ~1.8x bf16. The captured hidden states stay the target's own
activations (in --dtype, bf16 on a GPU): only the linears' inputs and weights are FP8, the norms,
residuals, attention and the hybrid's linear-attention kernels are untouched.

Which FP8 matmul (docs/producer.md, "FP8 target"): ``torch._scaled_mm`` with rowwise scales (activation
scale per row [M, 1], weight scale per output channel [1, N]), written here in ~30 lines of torch, rather
than torchao's float8 ``quantize_`` (the same cuBLAS/CUTLASS rowwise kernel under a tensor subclass, and a
wheel with C++ extensions to match to each torch build) or transformers' fine-grained FP8 linears (block
128 x 128 weights, 1 x 128 activation groups, two Triton kernels per linear that inductor cannot fuse into
the norm before them). Under ``torch.compile`` the activation's quantization (row amax, divide, cast) is
pointwise + one reduction: inductor fuses it into the kernel that makes the activation (the RMSNorm, the
SiLU x up), so an FP8 linear costs one extra read of nothing; ``_scaled_mm`` is an aten op inductor lowers
as it is.

A published fine-grained FP8 checkpoint (transformers' format: ``weight`` e4m3 + ``weight_scale_inv`` per
128 x 128 block, ``quantization_config.quant_method`` "fp8") loads through transformers (dequantized, see
loading.py) and is requantized here per output channel: one more rounding of weights that were FP8
already (docs/benchmarks.md measures what it costs).

Where FP8 matmuls do not exist (the CPU, GPUs before Hopper) the same module emulates them: the weights
hold their FP8 values (quantize -> dequantize once), the activations are quantized -> dequantized per row,
the matmul runs in --dtype. The numbers are FP8's, the speed is not; the caller says so in one line.
"""

from __future__ import annotations

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale (its values quantize to 0)
ALIGN = 16  # _scaled_mm needs both dims of the weight divisible by 16
MIN_OUT = 64  # narrower projections stay as they are: no FLOPs to win (the hybrid's 48-wide decay gates a, b)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scales [rows, 1]) of a 2-D tensor, one scale per row: amax / 448."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` quantized per row and restored, in its own dtype: the values an FP8 matmul sees."""
    q, scale = quantize_rows(x)
    return (q.float() * scale).to(x.dtype)


class Fp8Linear(nn.Module):
    """An ``nn.Linear`` with FP8 weights (per output channel) and FP8 activations (per row).

    ``emulate`` False: ``weight`` e4m3 [N, K] and ``weight_scale`` fp32 [1, N]; the forward is
    ``torch._scaled_mm`` (CUDA, sm_89+). True: ``weight`` holds the FP8-rounded weights in the linear's
    dtype and the forward rounds the activation the same way before a plain ``F.linear``."""

    def __init__(self, linear: nn.Linear, *, emulate: bool):
        super().__init__()
        self.in_features, self.out_features, self.emulate = linear.in_features, linear.out_features, emulate
        w = linear.weight.detach()
        q, scale = quantize_rows(w)
        if emulate:
            self.weight = nn.Parameter((q.float() * scale).to(w.dtype), requires_grad=False)
            self.weight_scale = None
        else:
            self.weight = nn.Parameter(q, requires_grad=False)
            self.weight_scale = nn.Parameter(scale.view(1, -1).contiguous(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.emulate:
            out = nn.functional.linear(fp8_rounded(x2), self.weight, self.bias)
        else:
            q, scale = quantize_rows(x2)
            out = torch._scaled_mm(
                q,
                self.weight.t(),  # column-major [K, N], as cuBLAS wants the second operand
                scale_a=scale,
                scale_b=self.weight_scale,
                bias=self.bias,
                out_dtype=x.dtype,
            )
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        how = "emulated (quantize -> dequantize)" if self.emulate else "torch._scaled_mm, rowwise"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3: {how}"


def fp8_matmul_unavailable(device: str, *, probe: bool = True) -> str | None:
    """Why FP8 matmuls do not run on ``device`` (one phrase), or None when they do: a CUDA GPU of compute
    capability 8.9+ (Ada, Hopper, Blackwell) whose ``torch._scaled_mm`` runs a rowwise-scaled product
    (``probe``: tried once on 16 x 32 zeros; off, the capability alone, e.g. in a launch's parent process,
    which must not make a CUDA context on every GPU)."""
    if not device.startswith("cuda"):
        return "the CPU has no FP8 matmuls"
    dev = torch.device(device)
    major, minor = torch.cuda.get_device_capability(dev)
    name = torch.cuda.get_device_name(dev)
    if (major, minor) < (8, 9):
        return f"{name} (sm_{major}{minor}) has no FP8 tensor cores (sm_89+: Ada, Hopper, Blackwell)"
    if not probe:
        return None
    try:  # the rowwise kernel is built per architecture and torch build: ask it once
        a = torch.zeros(16, 32, device=dev).to(FP8_DTYPE)
        b = torch.zeros(16, 32, device=dev).to(FP8_DTYPE)
        ones = lambda n: torch.ones(n, 1, device=dev)  # noqa: E731
        torch._scaled_mm(a, b.t(), scale_a=ones(16), scale_b=ones(16).view(1, -1), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as err:
        return f"torch {torch.__version__} has no rowwise-scaled FP8 matmul on {name} ({str(err).splitlines()[0]})"
    return None


def convertible(linear: nn.Linear) -> bool:
    return (
        linear.in_features % ALIGN == 0
        and linear.out_features % ALIGN == 0
        and linear.out_features >= MIN_OUT
    )


def to_fp8(layers: nn.Module, *, emulate: bool) -> int:
    """Replace every ``nn.Linear`` under ``layers`` (the decoder layers: never the embeddings or the head)
    whose dims are multiples of 16 (and at least MIN_OUT outputs) by an :class:`Fp8Linear`, freeing its high-precision weight. Returns how
    many were replaced."""
    swaps = [
        (parent, name, child)
        for parent in layers.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and convertible(child)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, Fp8Linear(child, emulate=emulate))
    return len(swaps)


def fp8_linears(module: nn.Module) -> list[Fp8Linear]:
    return [m for m in module.modules() if isinstance(m, Fp8Linear)]
