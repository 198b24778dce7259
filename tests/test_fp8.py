"""FP8 hidden-state shards: exact where FP8 can be, bounded elsewhere, NaN/inf refused by sample, the format
readable with plain zarr, bf16 shards still read, and packing keeps FP8 up to the device copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from dflash.common.contract import hidden_fp8
from dflash.common.contract.codecs import VALUE_DEFAULTS, CodecConfig
from dflash.common.contract.shard import Shard, ShardFormatError, ShardMeta
from dflash.common.contract.shard_reader import read_shard, read_shard_meta, shard_nbytes
from dflash.common.contract.shard_writer import write_shard
from dflash.common.drafter.batch import pack_samples

LAYER_IDS = [1, 4, 7]
H = 64
K = len(LAYER_IDS)
FP8 = CodecConfig.parse("fp8")


def make_shard(
    hidden: torch.Tensor, seqlens: tuple[int, ...], *, scales: torch.Tensor | None = None
) -> Shard:
    t = hidden.shape[0]
    assert sum(seqlens) == t
    return Shard(
        input_ids=torch.arange(t, dtype=torch.int32) % 101,
        loss_mask=torch.ones(t, dtype=torch.bool),
        cu_seqlens=torch.tensor([0, *np.cumsum(seqlens).tolist()], dtype=torch.int64),
        sample_index=torch.arange(100, 100 + len(seqlens), dtype=torch.int64),
        hidden=hidden,
        hidden_scales=scales,
        meta=ShardMeta(target_model="m", layer_ids=LAYER_IDS, hidden_size=H, producer_id="p0", bucket=64),
    )


def representable(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bf16 hidden, its e4m3 values, its scales): every (token, layer) slice is an e4m3 value times a scale
    with two significant bits (so each product is exact in bf16), and holds +-448 (so its amax / 448 is
    that scale)."""
    g = torch.Generator().manual_seed(seed)
    every = torch.arange(256, dtype=torch.uint8).view(hidden_fp8.FP8_DTYPE).float()
    finite = every[torch.isfinite(every)]  # the 254 non-NaN e4m3 values, +-0 and subnormals included
    values = finite[torch.randint(0, finite.numel(), (rows, K, H), generator=g)]
    values[:, :, 0] = torch.where(torch.rand(rows, K, generator=g) < 0.5, 448.0, -448.0)
    exponent = torch.randint(-20, 10, (rows, K), generator=g).float()
    scales = (torch.where(torch.rand(rows, K, generator=g) < 0.5, 1.0, 1.5) * 2.0**exponent).to(
        torch.bfloat16
    )
    hidden = (values * scales.float().unsqueeze(-1)).reshape(rows, K * H)
    assert torch.equal(hidden.to(torch.bfloat16).float(), hidden), "the test values must be exact in bf16"
    return hidden.to(torch.bfloat16), values.reshape(rows, K * H).to(hidden_fp8.FP8_DTYPE), scales


def test_values_representable_in_fp8_with_their_scale_round_trip_exactly(tmp_path: Path) -> None:
    hidden, values, scales = representable(300)
    write_shard(tmp_path / "s.zarr", make_shard(hidden, (100, 1, 199)), FP8)
    back = read_shard(tmp_path / "s.zarr")
    assert back.hidden.dtype == hidden_fp8.FP8_DTYPE and back.hidden_scales.dtype == torch.bfloat16
    assert torch.equal(back.hidden.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(back.hidden_scales, scales)
    assert torch.equal(back.restored_hidden().view(torch.int16), hidden.view(torch.int16))


def test_the_error_elsewhere_is_bounded_per_value_with_massive_activations(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, K * H, generator=g) * torch.rand(1, K * H, generator=g) * 4
    x[::50, 5] = 3000.0  # a massive activation on a few tokens of layer 0 (2-3 orders above the rest)
    x[7, H + 3] = -1e-6  # deep in the subnormals of its slice
    x[8, 2 * H :] = 0.0  # a slice of zeros
    hidden = x.to(torch.bfloat16)
    write_shard(tmp_path / "s.zarr", make_shard(hidden, (256, 256)), FP8)
    back = read_shard(tmp_path / "s.zarr")
    ref = hidden.float().view(-1, K, H)
    restored = back.restored_hidden().float().view(-1, K, H)
    scale = back.hidden_scales.float().unsqueeze(-1)
    # e4m3 rounds to 2^-4 relative above its subnormals, 2^-10 of the scale below; bf16 then rounds 2^-8
    bound = (2.0**-4 + 2.0**-8 + 2.0**-12) * ref.abs() + 2.0**-10 * scale * (1 + 2.0**-8)
    assert bool(((restored - ref).abs() <= bound).all())
    assert bool((restored[8, 2:] == 0).all())
    rel = (restored - ref).norm(dim=(0, 2)) / ref.norm(dim=(0, 2))
    assert bool((rel < 0.04).all()), rel  # e4m3's 3 mantissa bits: ~0.026 on Gaussian values


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("quantized_by_the_producer", [False, True])
def test_a_non_finite_hidden_state_is_refused_naming_the_sample(
    tmp_path: Path, bad: float, quantized_by_the_producer: bool
) -> None:
    hidden = torch.randn(40, K * H).to(torch.bfloat16)
    hidden[25, 2 * H + 9] = bad  # sample 101 (tokens 10..29), its token 15, layer 7
    shard = make_shard(hidden, (10, 20, 10))
    if quantized_by_the_producer:
        values, scales = hidden_fp8.quantize(hidden, K)
        shard = make_shard(values, (10, 20, 10), scales=scales)
    with pytest.raises(hidden_fp8.NonFiniteHiddenError) as e:
        write_shard(tmp_path / "s.zarr", shard, FP8)
    message = str(e.value)
    assert "sample 101" in message and "token 15" in message and "layer 7" in message, message
    assert ("nan" if bad != bad else "inf") in message and "\n" not in message
    assert not (tmp_path / "s.zarr").exists()


def test_the_reader_refuses_a_shard_with_a_non_finite_scale(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    write_shard(path, make_shard(torch.randn(40, K * H).to(torch.bfloat16), (10, 20, 10)), FP8)
    scales = zarr.open_group(path, mode="r+")["hidden_scales"]
    patched = scales[...]
    patched[33, 1] = 0x7FC0  # bf16 NaN: sample 102 (tokens 30..39), its token 3, layer 4
    scales[...] = patched  # zarr writes a fresh checksum: only the scale check can catch it
    with pytest.raises(ShardFormatError, match=r"sample 102: .*token 3 of layer 4 is nan"):
        read_shard(path)


def test_restoring_bf16_with_plain_zarr_takes_three_lines(tmp_path: Path) -> None:
    """The recipe docs/shard-format.md gives."""
    hidden = torch.randn(96, K * H).to(torch.bfloat16)
    path = tmp_path / "b000064-p0-s00000001.zarr"
    write_shard(path, make_shard(hidden, (32, 64)), FP8)
    g = zarr.open_group(path, mode="r")
    assert g.attrs["hidden_dtype"] == "float8_e4m3fn" and g.attrs["codec"] == "fp8:zstd:3"
    values = torch.from_numpy(g["hidden"][:]).view(torch.float8_e4m3fn)  # [T, K*H]
    scales = torch.from_numpy(g["hidden_scales"][:]).view(torch.bfloat16)  # [T, K]
    restored = (values.view(len(values), scales.shape[1], -1).bfloat16() * scales[:, :, None]).flatten(1)
    assert torch.equal(restored.view(torch.int16), read_shard(path).restored_hidden().view(torch.int16))
    assert float((restored.float() - hidden.float()).norm() / hidden.float().norm()) < 0.04


def test_fp8_shards_hold_under_half_the_bytes_and_bf16_shards_still_read(tmp_path: Path) -> None:
    hidden = torch.randn(1024, K * H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    arrays, hidden_bytes = {}, {}
    for spec in ("zstd:1:shuffle", "fp8:none", "fp8:zstd:1", "fp8:zstd:3"):
        path = tmp_path / f"{spec}.zarr"
        write_shard(path, make_shard(hidden, (512, 512)), CodecConfig.parse(spec))
        arrays[spec] = read_shard_meta(path)["arrays"]
        hidden_bytes[spec] = sum(
            shard_nbytes(path / a) for a in ("hidden", "hidden_scales") if a in arrays[spec]
        )
    assert (
        arrays["fp8:none"]["hidden"]["dtype"] == "uint8" and "hidden_scales" not in arrays["zstd:1:shuffle"]
    )
    assert arrays["fp8:none"]["hidden_scales"]["shape"] == [1024, K]
    raw_bf16 = hidden.numel() * 2
    assert (
        hidden_bytes["fp8:zstd:3"] <= hidden_bytes["fp8:zstd:1"] < hidden_bytes["fp8:none"] < 0.52 * raw_bf16
    )
    assert hidden_bytes["zstd:1:shuffle"] > 0.6 * raw_bf16  # Gaussian bf16: ~1.45x at best
    bf16 = read_shard(tmp_path / "zstd:1:shuffle.zarr")
    assert bf16.hidden_scales is None and torch.equal(bf16.hidden.view(torch.int16), hidden.view(torch.int16))


def test_an_fp8_shard_is_not_stored_as_bf16_and_needs_its_scales(tmp_path: Path) -> None:
    values, scales = hidden_fp8.quantize(torch.randn(8, K * H), K)
    with pytest.raises(ValueError, match="cannot be stored with codec zstd:1:shuffle"):
        write_shard(tmp_path / "s.zarr", make_shard(values, (8,), scales=scales), CodecConfig.parse("bf16"))
    with pytest.raises(ValueError, match="hidden must be torch.bfloat16"):
        make_shard(values, (8,))
    with pytest.raises(ValueError, match=r"hidden_scales has shape \(8, 2\)"):
        make_shard(values, (8,), scales=scales[:, :2])


@pytest.mark.parametrize(
    ("spec", "canonical"),
    [
        ("fp8", "fp8:zstd:3"),
        ("FP8:none", "fp8:none"),
        ("fp8:zstd", "fp8:zstd:1"),
        ("bf16", "zstd:1:shuffle"),
        ("bf16:zstd:3", "zstd:3"),
        ("zstd:1:shuffle", "zstd:1:shuffle"),
    ],
)
def test_codec_specs_name_the_values_and_the_bytes(spec: str, canonical: str) -> None:
    codec = CodecConfig.parse(spec)
    assert codec.spec == canonical and CodecConfig.parse(codec.spec) == codec
    assert codec.fp8 == canonical.startswith("fp8") and set(VALUE_DEFAULTS) == {"bf16", "fp8"}
    with pytest.raises(ValueError, match="byte shuffle of one-byte fp8 values does nothing"):
        CodecConfig.parse("fp8:zstd:1:shuffle")


def test_packing_keeps_fp8_to_the_device_copy_and_mixed_streams_are_bf16() -> None:
    g = torch.Generator().manual_seed(3)
    hidden = [torch.randn(n, K * H, generator=g).to(torch.bfloat16) for n in (5, 7)]
    quantized = [hidden_fp8.quantize(h, K) for h in hidden]
    docs = [
        (torch.arange(n), torch.ones(n, dtype=torch.bool), q, i)
        for i, (n, (q, _)) in enumerate(zip((5, 7), quantized, strict=True))
    ]
    scales = [s for _, s in quantized]
    packed = pack_samples(docs, context_tokens=16, hidden_scales=scales)
    assert packed.hidden.dtype == hidden_fp8.FP8_DTYPE and packed.hidden_scales.shape == (16, K)
    moved = packed.to("cpu", hidden_dtype=torch.float32)
    expected = torch.cat([hidden_fp8.dequantize(q, s) for q, s in quantized]).float()
    assert moved.hidden_scales is None and moved.hidden.dtype == torch.float32
    assert torch.equal(moved.hidden[:12], expected) and bool((moved.hidden[12:] == 0).all())
    mixed_docs = [docs[0], (torch.arange(7), torch.ones(7, dtype=torch.bool), hidden[1], 1)]
    mixed = pack_samples(mixed_docs, context_tokens=16, hidden_scales=[scales[0], None])
    assert mixed.hidden.dtype == torch.bfloat16 and mixed.hidden_scales is None
    assert torch.equal(mixed.hidden[:5], hidden_fp8.dequantize(*quantized[0]))
    assert torch.equal(mixed.hidden[5:12].view(torch.int16), hidden[1].view(torch.int16))
