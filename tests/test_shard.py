"""Shard format: bit-exact round trip, plain-zarr readability, and clear errors on damaged shards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from dflash.common.contract.codecs import DEFAULT_CODEC_SPEC, SHUFFLE_ZSTD_LEVELS
from dflash.common.contract.shard import (
    SHARD_FORMAT,
    SHARD_VERSION,
    CodecConfig,
    Shard,
    ShardFormatError,
    ShardMeta,
    hidden_chunk_rows,
)
from dflash.common.contract.shard_reader import read_shard, read_shard_meta, shard_nbytes
from dflash.common.contract.shard_writer import write_shard

CODECS = ["none", "zstd:1", "zstd:3", "zstd:1:shuffle", "zstd:3:shuffle"]
LAYER_IDS = [1, 4]
HIDDEN_SIZE = 64
WIDTH = len(LAYER_IDS) * HIDDEN_SIZE
# This file tests the bf16 format (bit-exact, every pattern: NaN too), written with the bf16 codec; FP8 shards
# are tests/test_fp8.py's.
BF16 = CodecConfig.parse("bf16")
# Small chunks so every test shard has several chunks of `hidden`, the last one partial.
CHUNK_BYTES = 100 * WIDTH * 2


def every_bf16_pattern(seed: int = 0) -> torch.Tensor:
    """All 65536 bf16 bit patterns (±0, ±inf, every NaN payload, subnormals), shuffled, as [512, 128]."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    perm = torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(seed))
    return bits[perm].view(torch.bfloat16).reshape(-1, WIDTH)


def make_shard(hidden: torch.Tensor | None = None, seqlens: tuple[int, ...] = (100, 1, 300, 111)) -> Shard:
    hidden = every_bf16_pattern() if hidden is None else hidden
    num_tokens = hidden.shape[0]
    assert sum(seqlens) == num_tokens
    g = torch.Generator().manual_seed(1)
    return Shard(
        input_ids=torch.randint(0, 150_000, (num_tokens,), dtype=torch.int32, generator=g),
        loss_mask=torch.rand(num_tokens, generator=g) > 0.5,
        cu_seqlens=torch.tensor([0, *np.cumsum(seqlens).tolist()], dtype=torch.int64),
        sample_index=torch.tensor([10, 3, 2**40, 7], dtype=torch.int64)[: len(seqlens)],
        hidden=hidden,
        meta=ShardMeta(
            target_model="Qwen/Qwen3-8B",
            layer_ids=LAYER_IDS,
            hidden_size=HIDDEN_SIZE,
            producer_id="n0g1",
            bucket=512,
        ),
    )


@pytest.fixture
def shard_path(tmp_path: Path) -> Path:
    path = tmp_path / "b000512-n0g1-s00000001.zarr"
    write_shard(path, make_shard(), BF16, chunk_bytes=CHUNK_BYTES)
    return path


def assert_same(a: Shard, b: Shard) -> None:
    assert a.meta == b.meta
    for name in ("input_ids", "loss_mask", "cu_seqlens", "sample_index"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert b.hidden.dtype == torch.bfloat16 and b.hidden.shape == a.hidden.shape
    assert torch.equal(a.hidden.view(torch.int16), b.hidden.view(torch.int16)), "hidden bits differ"


def hidden_chunk_files(path: Path) -> list[Path]:
    files = sorted(p for p in (path / "hidden").rglob("*") if p.is_file() and p.name != "zarr.json")
    assert len(files) > 1
    return files


@pytest.mark.parametrize("spec", CODECS)
def test_round_trip_is_bit_exact(tmp_path: Path, spec: str) -> None:
    shard = make_shard()
    path = tmp_path / "s.zarr"
    nbytes = write_shard(path, shard, CodecConfig.parse(spec), chunk_bytes=CHUNK_BYTES)
    assert nbytes == shard_nbytes(path) > 0
    back = read_shard(path)
    assert_same(shard, back)
    assert back.num_tokens == 512 and back.num_samples == 4
    h = back.hidden.view(torch.int16)
    for bits in (0x0000, -0x8000, 0x7F80, -0x0080, 0x7FC0, 0x7F81, -0x0001, 0x0001, -0x7FFF):
        assert bool((h == bits).any()), hex(bits)  # ±0, ±inf, NaNs with payloads, ±subnormals


def test_round_trip_of_a_single_chunk_and_a_non_contiguous_tensor(tmp_path: Path) -> None:
    hidden = every_bf16_pattern().t().contiguous().t()  # same values, column-major strides
    shard = make_shard(hidden)
    write_shard(tmp_path / "s.zarr", shard, BF16)  # default chunk size: one chunk
    assert_same(shard, read_shard(tmp_path / "s.zarr"))


def test_compression_actually_compresses_hidden_states(tmp_path: Path) -> None:
    hidden = torch.randn(512, WIDTH, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    sizes = {}
    for spec in ("none", "zstd:1", "zstd:1:shuffle"):
        write_shard(tmp_path / f"{spec}.zarr", make_shard(hidden), CodecConfig.parse(spec))
        sizes[spec] = read_shard_meta(tmp_path / f"{spec}.zarr")["nbytes"]
    assert sizes["none"] > 512 * WIDTH * 2
    assert sizes["zstd:1:shuffle"] < sizes["zstd:1"] < sizes["none"]


def test_metadata_attributes_and_read_shard_meta(shard_path: Path) -> None:
    meta = read_shard_meta(shard_path)
    assert meta["format"] == SHARD_FORMAT and meta["version"] == SHARD_VERSION
    assert meta["target_model"] == "Qwen/Qwen3-8B" and meta["layer_ids"] == LAYER_IDS
    assert (
        meta["num_layers"] == 2 and meta["hidden_size"] == HIDDEN_SIZE and meta["hidden_dtype"] == "bfloat16"
    )
    assert meta["producer_id"] == "n0g1" and meta["bucket"] == 512
    assert meta["num_tokens"] == 512 and meta["num_samples"] == 4 and meta["codec"] == "zstd:1:shuffle"
    arrays = meta["arrays"]
    assert arrays["hidden"] == {
        **arrays["hidden"],
        "shape": [512, WIDTH],
        "dtype": "uint16",
        "chunks": [86, WIDTH],  # 512 rows in 6 equal chunks of <= 100 rows
    }
    assert arrays["cu_seqlens"]["shape"] == [5] and arrays["sample_index"]["dtype"] == "int64"
    assert meta["nbytes"] == shard_nbytes(shard_path)
    json.dumps(meta)  # plain JSON, for `inspect` output


def test_opens_with_plain_zarr_and_documented_names(shard_path: Path) -> None:
    group = zarr.open_group(shard_path, mode="r")
    assert group.attrs["format"] == "dflash-shard" and group.attrs["version"] == 1
    hidden = torch.from_numpy(group["hidden"][:]).view(torch.bfloat16)
    cu = group["cu_seqlens"][:]
    assert group["input_ids"].dtype == np.int32 and group["loss_mask"].dtype == np.bool_
    assert group["sample_index"][:].tolist() == [10, 3, 2**40, 7]
    assert cu[0] == 0 and cu[-1] == hidden.shape[0] == group["input_ids"].shape[0]
    assert torch.equal(hidden.view(torch.int16), every_bf16_pattern().view(torch.int16))


@pytest.mark.parametrize("spec", CODECS)
def test_flipped_byte_in_a_chunk_is_a_format_error(tmp_path: Path, spec: str) -> None:
    path = tmp_path / "s.zarr"
    write_shard(path, make_shard(), CodecConfig.parse(spec), chunk_bytes=CHUNK_BYTES)
    chunk = hidden_chunk_files(path)[1]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match="corrupt") as e:
        read_shard(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "damage",
    [
        "delete_chunk",
        "truncate_chunk",
        "empty_chunk",
        "delete_array",
        "garbage_array_json",
        "garbage_group_json",
    ],
)
def test_truncated_or_damaged_shard_is_a_format_error(shard_path: Path, damage: str) -> None:
    chunk = hidden_chunk_files(shard_path)[-1]
    if damage == "delete_chunk":
        chunk.unlink()
    elif damage == "truncate_chunk":
        chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    elif damage == "empty_chunk":
        chunk.write_bytes(b"")
    elif damage == "delete_array":
        shutil.rmtree(shard_path / "cu_seqlens")
    elif damage == "garbage_array_json":
        (shard_path / "hidden" / "zarr.json").write_text('{"zarr_format": 3, "node_ty')
    elif damage == "garbage_group_json":
        (shard_path / "zarr.json").write_bytes(b"\x00\xff not json")
    with pytest.raises(ShardFormatError) as e:
        read_shard(shard_path)
    message = str(e.value)
    assert str(shard_path) in message and "\n" not in message
    if damage == "delete_chunk":
        assert "truncated" in message
    if damage == "delete_array":
        assert "missing array 'cu_seqlens'" in message


def test_wrong_version_is_a_format_error_naming_both_versions(shard_path: Path) -> None:
    zarr.open_group(shard_path, mode="r+").attrs["version"] = 99
    with pytest.raises(ShardFormatError, match=r"version 99 .*reads version 1") as e:
        read_shard(shard_path)
    assert str(shard_path) in str(e.value)
    assert read_shard_meta(shard_path)["version"] == 99  # inspect tools still see what it is


def test_not_a_dflash_shard_is_a_format_error(tmp_path: Path) -> None:
    zarr.open_group(tmp_path / "other.zarr", mode="w", attributes={"format": "something-else"})
    for read in (read_shard, read_shard_meta):
        with pytest.raises(ShardFormatError, match="not a dflash shard"):
            read(tmp_path / "other.zarr")
    (tmp_path / "file.zarr").write_text("x")
    with pytest.raises(ShardFormatError, match="not a shard"):
        read_shard(tmp_path / "file.zarr")
    with pytest.raises(FileNotFoundError):
        read_shard(tmp_path / "missing.zarr")


def test_inconsistent_arrays_on_disk_are_a_format_error(shard_path: Path) -> None:
    group = zarr.open_group(shard_path, mode="r+")
    group["cu_seqlens"][:] = np.array([0, 100, 50, 411, 512])
    with pytest.raises(ShardFormatError, match="cu_seqlens is not monotone"):
        read_shard(shard_path)
    group["cu_seqlens"][:] = np.array([0, 100, 101, 401, 500])
    with pytest.raises(ShardFormatError, match="end at T=512"):
        read_shard(shard_path)


def test_wrong_hidden_width_on_disk_is_a_format_error(shard_path: Path) -> None:
    zarr.open_group(shard_path, mode="r+").attrs["hidden_size"] = 32
    with pytest.raises(ShardFormatError, match=r"expected \(T, K\*H\) = \(512, 64\)"):
        read_shard(shard_path)


def test_wrong_dtype_on_disk_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    write_shard(path, make_shard(), BF16)
    group = zarr.open_group(path, mode="r+")
    del group["input_ids"]
    group.create_array("input_ids", data=np.zeros(512, dtype=np.int64))
    with pytest.raises(ShardFormatError, match="array 'input_ids' is int64"):
        read_shard(path)


def test_write_refuses_existing_path_and_invalid_shards(tmp_path: Path, shard_path: Path) -> None:
    with pytest.raises(FileExistsError):
        write_shard(shard_path, make_shard(), BF16)
    shard = make_shard()
    with pytest.raises(ValueError, match="hidden has shape"):
        Shard(**{**vars(shard), "hidden": shard.hidden[:, :-1]})
    with pytest.raises(ValueError, match="input_ids must be torch.int32"):
        Shard(**{**vars(shard), "input_ids": shard.input_ids.long()})
    with pytest.raises(ValueError, match="cu_seqlens has 4 entries"):
        Shard(**{**vars(shard), "cu_seqlens": shard.cu_seqlens[:-1]})
    with pytest.raises(ValueError, match="ShardMeta.layer_ids"):
        ShardMeta(target_model="m", layer_ids=[], hidden_size=8, producer_id="p", bucket=0)
    with pytest.raises(ValueError, match="ShardMeta.hidden_size"):
        ShardMeta(target_model="m", layer_ids=[1], hidden_size=0, producer_id="p", bucket=0)
    assert not (tmp_path / "never.zarr").exists()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("none", CodecConfig(values="bf16", name="none")),
        ("zstd", CodecConfig(values="bf16", name="zstd", level=1, shuffle=False)),
        ("zstd:3", CodecConfig(values="bf16", name="zstd", level=3, shuffle=False)),
        ("ZSTD:3:shuffle", CodecConfig(values="bf16", name="zstd", level=3, shuffle=True)),
        ("zstd:shuffle", CodecConfig(values="bf16", name="zstd", level=1, shuffle=True)),
        ("zstd:-5", CodecConfig(values="bf16", name="zstd", level=-5, shuffle=False)),
        ("zstd:22:shuffle", CodecConfig(values="bf16", name="zstd", level=22, shuffle=True)),
    ],
)
def test_codec_spec_parses(spec: str, expected: CodecConfig) -> None:
    codec = CodecConfig.parse(spec)
    assert codec == expected and CodecConfig.parse(codec.spec) == codec and str(codec) == codec.spec


def test_default_codec_is_the_documented_one() -> None:
    assert CodecConfig() == CodecConfig.parse(DEFAULT_CODEC_SPEC)
    assert sorted(SHUFFLE_ZSTD_LEVELS) == [1, 3, 5, 7, 9, 11, 13, 15, 22]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", r"expected \[bf16:\|fp8:\]none\|zstd"),
        ("gzip:3", "unknown codec 'gzip'"),
        ("zstd:fast", "level 'fast' is not an integer"),
        ("zstd:1:2", r"expected \[bf16:\|fp8:\]none\|zstd"),
        ("zstd:1:shuffle:x", r"expected \[bf16:\|fp8:\]none\|zstd"),
        ("none:shuffle", "'none' takes no options"),
        ("zstd:23", r"zstd levels are -131072\.\.22"),
        ("zstd:2:shuffle", r"with shuffle the zstd level must be one of \[1, 3, 5"),
    ],
)
def test_bad_codec_specs_are_clear_value_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        CodecConfig.parse(spec)
    assert repr(spec) in str(e.value) and "\n" not in str(e.value)


def test_bad_codec_config_fields_are_value_errors() -> None:
    with pytest.raises(ValueError, match="CodecConfig.name='lz4'"):
        CodecConfig(name="lz4")
    with pytest.raises(ValueError, match="CodecConfig.level"):
        CodecConfig(name="zstd", level="3")  # type: ignore[arg-type]
    assert CodecConfig(values="bf16", name="none", level=5, shuffle=True) == CodecConfig.parse("none")
    assert CodecConfig(name="none") == CodecConfig.parse("fp8:none")  # the default values: FP8


@pytest.mark.parametrize(
    ("num_tokens", "row_bytes", "chunk_bytes", "rows"),
    [
        (512, 256, 25_600, 86),
        (500, 256, 25_600, 100),
        (1, 20_480, 2 << 20, 1),
        (10, 10**9, 2 << 20, 1),
        (4096, 20_480, 2 << 20, 100),
    ],
)
def test_hidden_chunk_rows_are_bounded_and_even(
    num_tokens: int, row_bytes: int, chunk_bytes: int, rows: int
) -> None:
    assert hidden_chunk_rows(num_tokens, row_bytes, chunk_bytes) == rows


def test_failed_write_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: CodecConfig, *, element_size: int = 2) -> list:
        raise RuntimeError("encoder exploded")

    monkeypatch.setattr(CodecConfig, "zarr_codecs", broken)  # fails after the group and 1-D arrays exist
    with pytest.raises(RuntimeError, match="encoder exploded"):
        write_shard(tmp_path / "s.zarr", make_shard(), BF16)
    assert not (tmp_path / "s.zarr").exists()


def test_requires_grad_hidden_is_written(tmp_path: Path) -> None:
    hidden = torch.randn(512, WIDTH).to(torch.bfloat16).requires_grad_()
    write_shard(tmp_path / "s.zarr", make_shard(hidden), BF16)
    assert torch.equal(
        read_shard(tmp_path / "s.zarr").hidden.view(torch.int16), hidden.detach().view(torch.int16)
    )


def test_uint8_loss_mask_on_disk_reads_as_bool(shard_path: Path) -> None:
    group = zarr.open_group(shard_path, mode="r+")
    mask = group["loss_mask"][:]
    del group["loss_mask"]
    group.create_array("loss_mask", data=mask.astype(np.uint8))
    back = read_shard(shard_path)
    assert back.loss_mask.dtype == torch.bool and torch.equal(back.loss_mask, torch.from_numpy(mask))
    assert repr(back).startswith("Shard(num_tokens=512, num_samples=4, hidden=(512, 128), meta=ShardMeta(")
