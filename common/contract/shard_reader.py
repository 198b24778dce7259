"""Reading one shard back, bit-exact: the arrays, its metadata alone, or its sample ids alone; a wrong
version, a missing array, a shape mismatch, a bad checksum or a non-finite FP8 scale is one
ShardFormatError (the consumer then quarantines the shard). An FP8 shard is returned as it is stored,
e4m3 values and their scales, without dequantizing on the host. The writer is shard_writer.py."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.storage import LocalStore

from dflash.common.cli.exits import error_line
from dflash.common.contract import hidden_fp8
from dflash.common.contract.shard import (
    HIDDEN_DTYPES,
    HIDDEN_RANK,
    REQUIRED_ATTRS,
    SCALES_ARRAY,
    SHARD_ARRAYS,
    SHARD_FORMAT,
    SHARD_VERSION,
    Shard,
    ShardFormatError,
    ShardMeta,
)

log = logging.getLogger(__name__)


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
        raise ShardFormatError(f"{path}: not a readable zarr v3 group ({error_line(e)})") from e


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
    missing = [k for k in REQUIRED_ATTRS if k not in attrs]
    if missing:
        raise ShardFormatError(f"{path}: missing attribute(s) {', '.join(missing)}")
    if attrs["hidden_dtype"] not in HIDDEN_DTYPES:
        raise ShardFormatError(
            f"{path}: hidden_dtype={attrs['hidden_dtype']!r}, expected one of {', '.join(map(repr, HIDDEN_DTYPES))}"
        )


@contextlib.contextmanager
def _damaged_bytes_are_format_errors(path: Path, what: str) -> Iterator[None]:
    """zarr, json and codec errors on damaged bytes become one ShardFormatError naming the shard."""
    try:
        yield
    except (ShardFormatError, MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:
        raise ShardFormatError(f"{path}: {what} ({error_line(e)})") from e


def read_shard(path: str | Path) -> Shard:
    """Read and fully validate the shard at `path`.

    Raises FileNotFoundError if `path` does not exist, ShardFormatError (one line, naming the path) for
    anything wrong with what is there: wrong format or version, missing array or chunk, dtype or shape
    mismatch, undecodable bytes.
    """
    path = Path(path)
    group = _open_group(path)
    with _damaged_bytes_are_format_errors(path, "corrupt shard"):
        attrs = dict(group.attrs)
        _check_attrs(path, attrs, check_version=True)
        try:
            meta = ShardMeta(
                target_model=attrs["target_model"],
                layer_ids=attrs["layer_ids"],
                hidden_size=attrs["hidden_size"],
                producer_id=attrs["producer_id"],
                bucket=attrs["bucket"],
                epoch=attrs.get("epoch", 0),
            )
        except ValueError as e:
            raise ShardFormatError(f"{path}: bad attributes: {e}") from e
        if attrs.get("num_layers", meta.num_layers) != meta.num_layers:
            raise ShardFormatError(
                f"{path}: num_layers={attrs['num_layers']} but layer_ids has {meta.num_layers} entries"
            )
        stored, hidden_dtype = HIDDEN_DTYPES[attrs["hidden_dtype"]]
        fp8 = hidden_dtype == hidden_fp8.FP8_DTYPE
        data: dict[str, np.ndarray] = {}
        for name, (accepted, _, ndim) in SHARD_ARRAYS.items():
            data[name] = _read_array(path, group, name, accepted, ndim)
        data["hidden"] = _read_array(path, group, "hidden", (stored,), HIDDEN_RANK)
        if fp8:
            data[SCALES_ARRAY] = _read_array(path, group, SCALES_ARRAY, (np.dtype(np.uint16),), 2)

    try:
        shard = Shard(
            input_ids=torch.from_numpy(data["input_ids"]),
            loss_mask=torch.from_numpy(data["loss_mask"].astype(np.bool_, copy=False)),
            cu_seqlens=torch.from_numpy(data["cu_seqlens"]),
            sample_index=torch.from_numpy(data["sample_index"]),
            hidden=torch.from_numpy(data["hidden"]).view(hidden_dtype),
            hidden_scales=torch.from_numpy(data[SCALES_ARRAY]).view(hidden_fp8.SCALE_DTYPE) if fp8 else None,
            meta=meta,
        )
    except ValueError as e:
        raise ShardFormatError(f"{path}: inconsistent shard ({str(e).removeprefix('Shard: ')})") from e
    for key, actual in (("num_tokens", shard.num_tokens), ("num_samples", shard.num_samples)):
        if key in attrs and attrs[key] != actual:
            raise ShardFormatError(f"{path}: attribute {key}={attrs[key]} but the arrays hold {actual}")
    if shard.hidden_scales is not None:
        problem = hidden_fp8.nonfinite_problem(
            shard.hidden_scales, shard.cu_seqlens, shard.sample_index, meta.layer_ids
        )
        if problem:
            raise ShardFormatError(f"{path}: {problem}")
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
        raise ShardFormatError(f"{path}: unreadable sample_index ({error_line(e)})") from e


def read_shard_meta(path: str | Path) -> dict[str, Any]:
    """Attributes plus `arrays: {name: {shape, dtype, chunks, codecs}}` and `nbytes`, without reading data.

    Checks only that `path` is a dflash shard (format attribute), not its version, so that tools can show
    what a shard of another version holds.
    """
    path = Path(path)
    group = _open_group(path)
    with _damaged_bytes_are_format_errors(path, "corrupt shard metadata"):
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
