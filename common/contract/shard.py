"""The shard: one length bucket's worth of packed samples and their target hidden states, on disk.

A shard is a zarr v3 group stored as a directory `<name>.zarr`, so that a single `os.rename` publishes it
into the spool. Its layout is specified in docs/shard-format.md; the short version:

    attributes  format="dflash-shard", version, target_model, layer_ids, num_layers, hidden_size,
                hidden_dtype="bfloat16" | "float8_e4m3fn", producer_id, bucket, num_tokens, num_samples, codec
    input_ids     int32  [T]
    loss_mask     bool   [T]
    cu_seqlens    int64  [N+1]   0 = cu[0] <= cu[1] <= ... <= cu[N] = T
    sample_index  int64  [N]
    hidden        uint16 [T, K*H] bf16 bit patterns, chunked along T, compressed with a CodecConfig
                  (FP8 shards: uint8 e4m3 bit patterns)
    hidden_scales uint16 [T, K]  FP8 shards only: bf16 bit patterns of each (token, layer)'s scale

The writer avoids copies (torch -> numpy views); the reader checks everything it relies on and turns any
problem with the bytes on disk into a one-line ShardFormatError naming the shard, so that a consumer can
quarantine the shard and carry on instead of dying on a zarr or zstd traceback.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from dflash.common.contract import hidden_fp8
from dflash.common.contract.codecs import DEFAULT_CODEC_SPEC, CodecConfig

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CODEC_SPEC",
    "SHARD_FORMAT",
    "SHARD_VERSION",
    "CodecConfig",
    "Shard",
    "ShardFormatError",
    "ShardMeta",
    "hidden_chunk_rows",
]

log = logging.getLogger(__name__)

SHARD_FORMAT = "dflash-shard"
SHARD_VERSION = 1
HIDDEN_DTYPE = "bfloat16"
# hidden_dtype attribute -> (the numpy dtype `hidden` is stored as, the torch dtype it is read back as)
HIDDEN_DTYPES: dict[str, tuple[np.dtype, torch.dtype]] = {
    HIDDEN_DTYPE: (np.dtype(np.uint16), torch.bfloat16),
    hidden_fp8.FP8_NAME: (np.dtype(np.uint8), hidden_fp8.FP8_DTYPE),
}
SCALES_ARRAY = "hidden_scales"

# Rows of `hidden` per chunk are chosen so a chunk holds about this many bytes: big enough that zstd sees
# enough data and per-chunk overhead (a file, a task) is small, small enough that several chunks of one
# shard encode in parallel and a reader never decodes much more than it needs.
DEFAULT_CHUNK_BYTES = 2 << 20

# name -> (numpy dtypes accepted on read, the dtype written, rank); `hidden` is stored as its
# `hidden_dtype` attribute says (HIDDEN_DTYPES)
SHARD_ARRAYS: dict[str, tuple[tuple[np.dtype, ...], np.dtype, int]] = {
    "input_ids": ((np.dtype(np.int32),), np.dtype(np.int32), 1),
    "loss_mask": ((np.dtype(np.bool_), np.dtype(np.uint8)), np.dtype(np.bool_), 1),
    "cu_seqlens": ((np.dtype(np.int64),), np.dtype(np.int64), 1),
    "sample_index": ((np.dtype(np.int64),), np.dtype(np.int64), 1),
}
HIDDEN_RANK = 2
REQUIRED_ATTRS = ("target_model", "layer_ids", "hidden_size", "producer_id", "bucket", "hidden_dtype")


class ShardFormatError(ValueError):
    """A shard that cannot be trusted: wrong format or version, missing array, shape mismatch, corrupt."""


@dataclass(kw_only=True)
class ShardMeta:
    """Who made a shard and how to interpret its `hidden` columns."""

    target_model: str
    """The target model id or path the hidden states came from."""
    layer_ids: list[int]
    """Target decoder layers captured, in column order: hidden[:, k*H:(k+1)*H] is layer layer_ids[k]."""
    hidden_size: int
    """H, the target's hidden size."""
    producer_id: str
    bucket: int
    """Length bucket (max tokens per sample) the producer packed this shard for."""
    epoch: int = 0
    """The campaign's epoch every sample of the shard belongs to (sample id // rows; shards never mix
    epochs). Optional in the file: a shard without it is of epoch 0."""

    def __post_init__(self) -> None:
        if not isinstance(self.target_model, str) or not self.target_model:
            raise ValueError(f"ShardMeta.target_model={self.target_model!r}: must be a non-empty string")
        if (
            not isinstance(self.layer_ids, list | tuple)
            or not self.layer_ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.layer_ids)
        ):
            raise ValueError(f"ShardMeta.layer_ids={self.layer_ids!r}: must be a non-empty list of ints >= 0")
        self.layer_ids = list(self.layer_ids)
        if (
            isinstance(self.hidden_size, bool)
            or not isinstance(self.hidden_size, int)
            or self.hidden_size <= 0
        ):
            raise ValueError(f"ShardMeta.hidden_size={self.hidden_size!r}: must be an int > 0")
        if not isinstance(self.producer_id, str) or not self.producer_id:
            raise ValueError(f"ShardMeta.producer_id={self.producer_id!r}: must be a non-empty string")
        if isinstance(self.bucket, bool) or not isinstance(self.bucket, int) or self.bucket < 0:
            raise ValueError(f"ShardMeta.bucket={self.bucket!r}: must be an int >= 0")
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise ValueError(f"ShardMeta.epoch={self.epoch!r}: must be an int >= 0")

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)


@dataclass(kw_only=True)
class Shard:
    """Packed samples (no padding) with the target's hidden states, as CPU tensors.

    Construction validates dtypes and shapes (ValueError), so a malformed shard never reaches the disk.
    """

    input_ids: torch.Tensor
    """int32 [T]"""
    loss_mask: torch.Tensor
    """bool [T]: True where the token is trained on (assistant tokens)."""
    cu_seqlens: torch.Tensor
    """int64 [N+1]: sample i is tokens cu_seqlens[i]:cu_seqlens[i+1]; cu_seqlens[0]==0, cu_seqlens[-1]==T."""
    sample_index: torch.Tensor
    """int64 [N]: sample id of each sample (common/contract/epochs.py; the data cursor for resume)."""
    hidden: torch.Tensor
    """bfloat16 [T, K*H]: the K captured layers concatenated in meta.layer_ids order; or float8_e4m3fn
    values with `hidden_scales` (hidden_fp8.py)."""
    meta: ShardMeta
    hidden_scales: torch.Tensor | None = None
    """bfloat16 [T, K] when `hidden` is FP8: hidden[t, k*H:(k+1)*H] = values * hidden_scales[t, k]."""

    def __post_init__(self) -> None:
        problem = shard_problem(self)
        if problem:
            raise ValueError(f"Shard: {problem}")

    def __repr__(self) -> str:  # the default would print every tensor
        return (
            f"Shard(num_tokens={self.num_tokens}, num_samples={self.num_samples}, "
            f"hidden={tuple(self.hidden.shape)}, meta={self.meta})"
        )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_samples(self) -> int:
        return int(self.sample_index.shape[0])

    @property
    def fp8(self) -> bool:
        return self.hidden_scales is not None

    def restored_hidden(self) -> torch.Tensor:
        """bf16 [T, K*H]: `hidden` itself, or an FP8 shard's values times their scales (on the CPU: for the
        tools and the held-out documents; the trainer dequantizes on its own device, after the copy)."""
        if self.hidden_scales is None:
            return self.hidden
        return hidden_fp8.dequantize(self.hidden, self.hidden_scales)


def shard_problem(s: Shard) -> str | None:
    """Why `s` is not a valid shard, or None. Shared by the constructor and the reader."""
    if not isinstance(s.meta, ShardMeta):
        return f"meta must be a ShardMeta, got {type(s.meta).__name__}"
    expect = {
        "input_ids": (torch.int32, 1),
        "loss_mask": (torch.bool, 1),
        "cu_seqlens": (torch.int64, 1),
        "sample_index": (torch.int64, 1),
        "hidden": (torch.bfloat16 if s.hidden_scales is None else hidden_fp8.FP8_DTYPE, 2),
    }
    if s.hidden_scales is not None:
        expect["hidden_scales"] = (hidden_fp8.SCALE_DTYPE, 2)
    for name, (dtype, ndim) in expect.items():
        t = getattr(s, name)
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dtype != dtype or t.ndim != ndim:
            return f"{name} must be {dtype} with {ndim} dim(s), got {t.dtype} shape {tuple(t.shape)}"
    num_tokens, num_samples = s.input_ids.shape[0], s.sample_index.shape[0]
    if num_samples == 0:
        return "a shard needs at least one sample (sample_index is empty)"
    if s.loss_mask.shape[0] != num_tokens:
        return f"loss_mask has {s.loss_mask.shape[0]} tokens, input_ids has {num_tokens}"
    if s.cu_seqlens.shape[0] != num_samples + 1:
        return f"cu_seqlens has {s.cu_seqlens.shape[0]} entries, expected num_samples+1 = {num_samples + 1}"
    cu = s.cu_seqlens
    if int(cu[0]) != 0 or int(cu[-1]) != num_tokens:
        return f"cu_seqlens must start at 0 and end at T={num_tokens}, got {int(cu[0])}..{int(cu[-1])}"
    if bool((cu[1:] < cu[:-1]).any()):
        return "cu_seqlens is not monotone non-decreasing"
    width = s.meta.num_layers * s.meta.hidden_size
    if tuple(s.hidden.shape) != (num_tokens, width):
        return (
            f"hidden has shape {tuple(s.hidden.shape)}, expected (T, K*H) = ({num_tokens}, {width}) "
            f"for K={s.meta.num_layers} layers of hidden_size {s.meta.hidden_size}"
        )
    if s.hidden_scales is not None and tuple(s.hidden_scales.shape) != (num_tokens, s.meta.num_layers):
        return (
            f"hidden_scales has shape {tuple(s.hidden_scales.shape)}, expected (T, K) = "
            f"({num_tokens}, {s.meta.num_layers})"
        )
    return None


def hidden_chunk_rows(num_tokens: int, row_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per `hidden` chunk: at most ~chunk_bytes, and spread evenly over the shard.

    zarr stores an edge chunk at full size, so chunks of exactly chunk_bytes would waste up to a chunk of
    padding per shard (2% of a 84 MB shard, uncompressed); equal chunks waste fewer rows than chunks.
    """
    max_rows = max(1, chunk_bytes // max(1, row_bytes))
    num_chunks = max(1, -(-num_tokens // max_rows))
    return max(1, -(-num_tokens // num_chunks))
