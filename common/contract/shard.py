"""The shard: one length bucket's worth of packed samples and their target hidden states, on disk.

A shard is a zarr v3 group stored as a directory `<name>.zarr`, so that a single `os.rename` publishes it
into the spool. Its layout is specified in docs/shard-format.md; the short version:

    attributes  format="dflash-shard", version, target_model, layer_ids, num_layers, hidden_size,
                hidden_dtype="bfloat16", producer_id, bucket, num_tokens, num_samples, codec
    input_ids     int32  [T]
    loss_mask     bool   [T]
    cu_seqlens    int64  [N+1]   0 = cu[0] <= cu[1] <= ... <= cu[N] = T
    sample_index  int64  [N]
    hidden        uint16 [T, K*H] bf16 bit patterns, chunked along T, compressed with a CodecConfig

The writer avoids copies (torch -> numpy views); the reader checks everything it relies on and turns any
problem with the bytes on disk into a one-line ShardFormatError naming the shard, so that a consumer can
quarantine the shard and carry on instead of dying on a zarr or zstd traceback.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec
from zarr.storage import LocalStore

from dflash.common.contract.codecs import DEFAULT_CODEC_SPEC, CodecConfig, default_codec

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
    "read_shard",
    "read_shard_meta",
    "shard_nbytes",
    "write_shard",
]

log = logging.getLogger(__name__)

SHARD_FORMAT = "dflash-shard"
SHARD_VERSION = 1
HIDDEN_DTYPE = "bfloat16"

# Rows of `hidden` per chunk are chosen so a chunk holds about this many bytes: big enough that zstd sees
# enough data and per-chunk overhead (a file, a task) is small, small enough that several chunks of one
# shard encode in parallel and a reader never decodes much more than it needs.
DEFAULT_CHUNK_BYTES = 2 << 20

# name -> (numpy dtypes accepted on read, the dtype written, rank)
_ARRAYS: dict[str, tuple[tuple[np.dtype, ...], np.dtype, int]] = {
    "input_ids": ((np.dtype(np.int32),), np.dtype(np.int32), 1),
    "loss_mask": ((np.dtype(np.bool_), np.dtype(np.uint8)), np.dtype(np.bool_), 1),
    "cu_seqlens": ((np.dtype(np.int64),), np.dtype(np.int64), 1),
    "sample_index": ((np.dtype(np.int64),), np.dtype(np.int64), 1),
    "hidden": ((np.dtype(np.uint16),), np.dtype(np.uint16), 2),
}
_REQUIRED_ATTRS = ("target_model", "layer_ids", "hidden_size", "producer_id", "bucket", "hidden_dtype")


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
    """int64 [N]: global dataset index of each sample (the data cursor for resume)."""
    hidden: torch.Tensor
    """bfloat16 [T, K*H]: the K captured layers concatenated in meta.layer_ids order."""
    meta: ShardMeta

    def __post_init__(self) -> None:
        problem = _shard_problem(self)
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


def _shard_problem(s: Shard) -> str | None:
    """Why `s` is not a valid shard, or None. Shared by the constructor and the reader."""
    if not isinstance(s.meta, ShardMeta):
        return f"meta must be a ShardMeta, got {type(s.meta).__name__}"
    expect = {
        "input_ids": (torch.int32, 1),
        "loss_mask": (torch.bool, 1),
        "cu_seqlens": (torch.int64, 1),
        "sample_index": (torch.int64, 1),
        "hidden": (torch.bfloat16, 2),
    }
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
    return None


def hidden_chunk_rows(num_tokens: int, row_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per `hidden` chunk: at most ~chunk_bytes, and spread evenly over the shard.

    zarr stores an edge chunk at full size, so chunks of exactly chunk_bytes would waste up to a chunk of
    padding per shard (2% of a 84 MB shard, uncompressed); equal chunks waste fewer rows than chunks.
    """
    max_rows = max(1, chunk_bytes // max(1, row_bytes))
    num_chunks = max(1, -(-num_tokens // max_rows))
    return max(1, -(-num_tokens // num_chunks))


def write_shard(
    path: str | Path,
    shard: Shard,
    codec: CodecConfig | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> int:
    """Write `shard` as a new zarr v3 group directory at `path`; return its bytes on disk.

    `path` must not exist (FileExistsError): shards are written once under the spool's tmp/ and renamed.
    Tensors on another device are copied to the CPU; CPU tensors are written without an extra copy.
    Chunks of `hidden` are encoded in parallel by zarr's thread pool (`async.concurrency` chunks at once).
    """
    path = Path(path)
    codec = default_codec() if codec is None else codec
    if not isinstance(codec, CodecConfig):
        raise ValueError(f"codec must be a CodecConfig, got {type(codec).__name__}")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes}: must be > 0")
    if path.exists():
        raise FileExistsError(f"{path}: shard path already exists")
    problem = _shard_problem(shard)
    if problem:
        raise ValueError(f"write_shard({path}): {problem}")

    meta = shard.meta
    num_tokens, num_samples = shard.num_tokens, shard.num_samples
    # .view(torch.uint16) reinterprets the bf16 bits in place; .numpy() shares memory. No copy on CPU.
    hidden = shard.hidden.detach().cpu().view(torch.uint16).numpy()
    columns = {
        "input_ids": shard.input_ids.cpu().numpy(),
        "loss_mask": shard.loss_mask.cpu().numpy(),
        "cu_seqlens": shard.cu_seqlens.cpu().numpy(),
        "sample_index": shard.sample_index.cpu().numpy(),
    }
    attrs: dict[str, Any] = {
        "format": SHARD_FORMAT,
        "version": SHARD_VERSION,
        "target_model": meta.target_model,
        "layer_ids": list(meta.layer_ids),
        "num_layers": meta.num_layers,
        "hidden_size": meta.hidden_size,
        "hidden_dtype": HIDDEN_DTYPE,
        "producer_id": meta.producer_id,
        "bucket": meta.bucket,
        "num_tokens": num_tokens,
        "num_samples": num_samples,
        "codec": codec.spec,
    }
    try:
        _write_group(path, attrs, columns, hidden, codec, chunk_bytes)
    except BaseException:
        # Nothing existed at `path` before this call: do not leave a half-written shard behind.
        shutil.rmtree(path, ignore_errors=True)
        raise
    nbytes = shard_nbytes(path)
    log.debug(
        "wrote %s: %d tokens, %d samples, %d bytes, codec %s", path, num_tokens, num_samples, nbytes, codec
    )
    return nbytes


def _write_group(
    path: Path,
    attrs: dict[str, Any],
    columns: dict[str, np.ndarray],
    hidden: np.ndarray,
    codec: CodecConfig,
    chunk_bytes: int,
) -> None:
    array_config = {"write_empty_chunks": True}
    group = zarr.open_group(LocalStore(path), mode="w-", zarr_format=3, attributes=attrs)
    for name, data in columns.items():
        # Small 1-D arrays: one chunk each (a few bytes per token, never the bottleneck).
        arr = group.create_array(
            name,
            shape=data.shape,
            dtype=_ARRAYS[name][1],
            chunks=(max(1, data.shape[0]),),
            compressors=[ZstdCodec(level=1), Crc32cCodec()],
            config=array_config,
        )
        arr[...] = data
    rows = hidden_chunk_rows(hidden.shape[0], hidden.shape[1] * hidden.itemsize, chunk_bytes)
    arr = group.create_array(
        "hidden",
        shape=hidden.shape,
        dtype=np.uint16,
        chunks=(rows, hidden.shape[1]),
        compressors=codec.zarr_codecs(element_size=hidden.itemsize),
        dimension_names=("token", "feature"),
        config=array_config,
    )
    arr[...] = hidden


def _open_group(path: Path) -> zarr.Group:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such shard")
    if not path.is_dir():
        raise ShardFormatError(f"{path}: not a shard (a shard is a directory)")
    try:
        return zarr.open_group(LocalStore(path, read_only=True), mode="r", zarr_format=3)
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:
        raise ShardFormatError(f"{path}: not a readable zarr v3 group ({_one_line(e)})") from e


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _check_attrs(path: Path, attrs: dict[str, Any], *, check_version: bool) -> None:
    fmt = attrs.get("format")
    if fmt != SHARD_FORMAT:
        raise ShardFormatError(f"{path}: not a dflash shard (format={fmt!r}, expected {SHARD_FORMAT!r})")
    if not check_version:
        return
    version = attrs.get("version")
    if version != SHARD_VERSION:
        raise ShardFormatError(
            f"{path}: shard version {version!r} is not supported (this reader reads version {SHARD_VERSION})"
        )
    missing = [k for k in _REQUIRED_ATTRS if k not in attrs]
    if missing:
        raise ShardFormatError(f"{path}: missing attribute(s) {', '.join(missing)}")
    if attrs["hidden_dtype"] != HIDDEN_DTYPE:
        raise ShardFormatError(f"{path}: hidden_dtype={attrs['hidden_dtype']!r}, expected {HIDDEN_DTYPE!r}")


def read_shard(path: str | Path) -> Shard:
    """Read and fully validate the shard at `path`.

    Raises FileNotFoundError if `path` does not exist, ShardFormatError (one line, naming the path) for
    anything wrong with what is there: wrong format or version, missing array or chunk, dtype or shape
    mismatch, undecodable bytes.
    """
    path = Path(path)
    group = _open_group(path)
    try:
        attrs = dict(group.attrs)
        _check_attrs(path, attrs, check_version=True)
        try:
            meta = ShardMeta(
                target_model=attrs["target_model"],
                layer_ids=attrs["layer_ids"],
                hidden_size=attrs["hidden_size"],
                producer_id=attrs["producer_id"],
                bucket=attrs["bucket"],
            )
        except ValueError as e:
            raise ShardFormatError(f"{path}: bad attributes: {e}") from e
        if attrs.get("num_layers", meta.num_layers) != meta.num_layers:
            raise ShardFormatError(
                f"{path}: num_layers={attrs['num_layers']} but layer_ids has {meta.num_layers} entries"
            )
        data: dict[str, np.ndarray] = {}
        for name, (accepted, _, ndim) in _ARRAYS.items():
            data[name] = _read_array(path, group, name, accepted, ndim)
    except ShardFormatError:
        raise
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:
        # zarr, json and codec errors on damaged bytes: say which shard and what, in one line.
        raise ShardFormatError(f"{path}: corrupt shard ({_one_line(e)})") from e

    try:
        shard = Shard(
            input_ids=torch.from_numpy(data["input_ids"]),
            loss_mask=torch.from_numpy(data["loss_mask"].astype(np.bool_, copy=False)),
            cu_seqlens=torch.from_numpy(data["cu_seqlens"]),
            sample_index=torch.from_numpy(data["sample_index"]),
            hidden=torch.from_numpy(data["hidden"]).view(torch.bfloat16),
            meta=meta,
        )
    except ValueError as e:
        raise ShardFormatError(f"{path}: inconsistent shard ({str(e).removeprefix('Shard: ')})") from e
    for key, actual in (("num_tokens", shard.num_tokens), ("num_samples", shard.num_samples)):
        if key in attrs and attrs[key] != actual:
            raise ShardFormatError(f"{path}: attribute {key}={attrs[key]} but the arrays hold {actual}")
    return shard


def _read_array(
    path: Path, group: zarr.Group, name: str, accepted: tuple[np.dtype, ...], ndim: int
) -> np.ndarray:
    try:
        arr = group[name]
    except KeyError:
        raise ShardFormatError(f"{path}: missing array {name!r}") from None
    if not isinstance(arr, zarr.Array):
        raise ShardFormatError(f"{path}: {name!r} is not an array")
    if arr.dtype not in accepted or arr.ndim != ndim:
        raise ShardFormatError(
            f"{path}: array {name!r} is {arr.dtype} with {arr.ndim} dim(s), "
            f"expected {'/'.join(str(d) for d in accepted)} with {ndim}"
        )
    # zarr silently fills a missing chunk with the fill value; a shard is written with every chunk
    # present (write_empty_chunks=True), so a missing one means a truncated or damaged shard.
    if arr.nchunks_initialized != arr.nchunks:
        raise ShardFormatError(
            f"{path}: array {name!r} has {arr.nchunks_initialized} of its {arr.nchunks} chunks (truncated shard)"
        )
    out = arr[...]
    assert isinstance(out, np.ndarray)
    return out


def read_sample_index(path: str | Path) -> np.ndarray:
    """Only the shard's global sample indices (int64), without reading its tokens or hidden states.
    FileNotFoundError if it is gone, ShardFormatError if it cannot be read."""
    path = Path(path)
    group = _open_group(path)
    try:
        return np.asarray(group["sample_index"][...], dtype=np.int64)
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such shard") from e
        raise ShardFormatError(f"{path}: unreadable sample_index ({_one_line(e)})") from e


def read_shard_meta(path: str | Path) -> dict[str, Any]:
    """Attributes plus `arrays: {name: {shape, dtype, chunks, codecs}}` and `nbytes`, without reading data.

    Checks only that `path` is a dflash shard (format attribute), not its version, so that tools can show
    what a shard of another version holds.
    """
    path = Path(path)
    group = _open_group(path)
    try:
        attrs = dict(group.attrs)
        _check_attrs(path, attrs, check_version=False)
        arrays: dict[str, Any] = {}
        for name, arr in group.arrays():
            arrays[name] = {
                "shape": list(arr.shape),
                "dtype": str(arr.dtype),
                "chunks": list(arr.chunks),
                "codecs": [c.to_dict() for c in arr.compressors],
            }
    except ShardFormatError:
        raise
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:
        raise ShardFormatError(f"{path}: corrupt shard metadata ({_one_line(e)})") from e
    meta = dict(attrs)
    meta["arrays"] = json.loads(json.dumps(arrays, default=str))
    meta["nbytes"] = shard_nbytes(path)
    return meta


def shard_nbytes(path: str | Path) -> int:
    """Bytes on disk of a shard directory: the sum of its files' sizes (metadata and chunks)."""
    total = 0
    stack = [os.fspath(path)]
    while stack:
        with os.scandir(stack.pop()) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    return total
