"""A Gated DeltaNet mixer's memory-bound parts in fusable form (common/target/mixer_kernels.py): the shifted
causal conv equals transformers' reference conv (F.conv1d, one group per channel, then the activation) and
hands back a view whose transpose is contiguous; the swap covers a model's mixers and is undone; the
producer's warm-up reaches every class of fla's L2 norm a run's batches can make."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

from dflash.common.target.fp8 import fp8_linears, to_fp8
from dflash.common.target.mixer_kernels import (
    CONV_GLOBAL,
    ShiftedCausalConv,
    causal_conv_shifted,
    compile_mixer_parts,
)
from dflash.producer.buckets import BucketConfig, Bucketer
from dflash.producer.compile_plan import FLA_NORM_ROWS_PER_CLASS, mixer_shapes


def _reference_conv(x: torch.Tensor, weight: torch.Tensor, bias, activation) -> torch.Tensor:
    """transformers' torch fallback (``causal_conv1d_fn``): conv with left padding, cut to the length."""
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])[
        ..., : x.shape[-1]
    ]
    return F.silu(out) if activation == "silu" else out


@pytest.mark.parametrize("with_bias,activation", [(False, "silu"), (True, None), (True, "silu")])
def test_the_shifted_conv_equals_the_reference_conv(with_bias, activation):
    g = torch.Generator().manual_seed(0)
    btd = torch.randn(3, 37, 24, generator=g)  # [B, T, D] as the projection writes it
    x = btd.transpose(1, 2)  # the [B, D, T] view transformers passes
    weight = torch.randn(24, 4, generator=g)
    bias = torch.randn(24, generator=g) if with_bias else None
    got = causal_conv_shifted(x, weight, bias, activation=activation)
    torch.testing.assert_close(
        got, _reference_conv(x.contiguous(), weight, bias, activation), rtol=1e-5, atol=1e-5
    )
    assert got.shape == x.shape and got.transpose(1, 2).is_contiguous()  # q/k/v become views, no copy
    with pytest.raises(ValueError, match="packed sequences"):
        causal_conv_shifted(x, weight, cu_seqlens=torch.tensor([0, 37]))
    with pytest.raises(ValueError, match="activation 'gelu'"):
        causal_conv_shifted(x, weight, activation="gelu")


def test_the_mixer_parts_are_swapped_in_for_a_model_and_undone():
    cfg = Qwen3_5TextConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    gdn = model.model.layers[0].linear_attn
    module = sys.modules[type(gdn).__module__]
    conv = getattr(module, CONV_GLOBAL)
    ids = torch.randint(0, 128, (2, 50), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(input_ids=ids, use_cache=False).logits
    compiled: list = []
    undo = compile_mixer_parts(model, lambda fn: compiled.append(fn) or fn, conv_on_reference=True)
    assert "forward" in vars(gdn.norm) and isinstance(getattr(module, CONV_GLOBAL), ShiftedCausalConv)
    assert len(compiled) == 2  # the norm's forward and the conv
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
    undo()
    assert "forward" not in vars(gdn.norm) and getattr(module, CONV_GLOBAL) is conv
    compile_mixer_parts(model, lambda fn: fn, conv_on_reference=False)()  # a fast conv is left as it is
    assert getattr(module, CONV_GLOBAL) is conv


def test_warm_up_reaches_every_class_of_flas_l2_norm():
    cfg = BucketConfig(batch_tokens=32768, round_rows=True)
    lengths = np.random.default_rng(0).integers(64, 4096, 400)
    heads = 48
    shapes = mixer_shapes(cfg, lengths, heads)
    bk = Bucketer(cfg)
    most = max(bk.rows_per_batch(b) * b for b in {bk.bucket_of(int(n)) for n in lengths})
    classes = lambda tokens: -(-tokens * heads // FLA_NORM_ROWS_PER_CLASS)  # noqa: E731
    assert {classes(r * n) for r, n in shapes} >= set(range(1, classes(most) + 1))
    assert (
        mixer_shapes(cfg, lengths) == shapes[: len(mixer_shapes(cfg, lengths))]
    )  # no heads: no norm classes


def test_an_fp8_targets_mixer_projections_are_compiled_with_its_norm_and_undone():
    """The eager GDN mixer of an FP8 target: its FP8 projections (their activations' quantization) become
    small compiled graphs too; the narrow decay gates (a, b) stay plain linears."""
    cfg = Qwen3_5TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_value_heads=4,
        linear_num_key_heads=1,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    to_fp8(model.model.layers, emulate=True)
    gdn = model.model.layers[0].linear_attn
    projections = fp8_linears(gdn)
    assert {id(m) for m in projections} == {id(gdn.in_proj_qkv), id(gdn.in_proj_z), id(gdn.out_proj)}
    assert type(gdn.in_proj_a) is torch.nn.Linear
    ids = torch.randint(0, 128, (2, 50), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(input_ids=ids, use_cache=False).logits
    compiled: list = []
    undo = compile_mixer_parts(model, lambda fn: compiled.append(fn) or fn, conv_on_reference=False)
    assert len(compiled) == 4 and all("forward" in vars(m) for m in projections)  # the norm + 3 projections
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
    undo()
    assert not any("forward" in vars(m) for m in [*projections, gdn.norm])
