"""Writing one shard: a zarr v3 group in a directory, the hidden states chunked along T and compressed with
the chosen codec (bf16 as they are, or FP8 values beside their scales), every chunk's CRC32C stored
(docs/shard-format.md). The reader is shard_reader.py."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec
from zarr.storage import LocalStore

from dflash.common.contract import hidden_fp8
from dflash.common.contract.codecs import CodecConfig, default_codec
from dflash.common.contract.shard import (
    DEFAULT_CHUNK_BYTES,
    HIDDEN_DTYPE,
    SCALES_ARRAY,
    SHARD_ARRAYS,
    SHARD_FORMAT,
    SHARD_VERSION,
    Shard,
    hidden_chunk_rows,
    shard_problem,
)
from dflash.common.contract.shard_reader import shard_nbytes

log = logging.getLogger(__name__)


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

    An FP8 codec stores `shard.hidden_scales` beside the e4m3 values when the shard is already quantized
    (a producer quantizes on its device, before the copy to the host), and quantizes a bf16 shard here on
    the CPU. A hidden state holding NaN or inf is refused with NonFiniteHiddenError naming the sample
    (an FP8 shard would otherwise hold a NaN scale); a shard already FP8 cannot be stored as bf16.
    """
    path = Path(path)
    codec = default_codec() if codec is None else codec
    if not isinstance(codec, CodecConfig):
        raise ValueError(f"codec must be a CodecConfig, got {type(codec).__name__}")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes}: must be > 0")
    if path.exists():
        raise FileExistsError(f"{path}: shard path already exists")
    problem = shard_problem(shard)
    if problem:
        raise ValueError(f"write_shard({path}): {problem}")

    num_tokens, num_samples = shard.num_tokens, shard.num_samples
    hidden, scales = _stored_hidden(path, shard, codec)
    columns = {
        "input_ids": shard.input_ids.cpu().numpy(),
        "loss_mask": shard.loss_mask.cpu().numpy(),
        "cu_seqlens": shard.cu_seqlens.cpu().numpy(),
        "sample_index": shard.sample_index.cpu().numpy(),
    }
    if scales is not None:
        columns[SCALES_ARRAY] = scales
    try:
        _write_group(path, _group_attrs(shard, codec), columns, hidden, codec, chunk_bytes)
    except BaseException:
        # Nothing existed at `path` before this call: do not leave a half-written shard behind.
        shutil.rmtree(path, ignore_errors=True)
        raise
    nbytes = shard_nbytes(path)
    log.debug(
        "wrote %s: %d tokens, %d samples, %d bytes, codec %s", path, num_tokens, num_samples, nbytes, codec
    )
    return nbytes


def _stored_hidden(path: Path, shard: Shard, codec: CodecConfig) -> tuple[np.ndarray, np.ndarray | None]:
    """(`hidden`, `hidden_scales` or None) as the numpy arrays stored: the bits viewed as unsigned ints
    (.view reinterprets in place, .numpy() shares memory: no copy of CPU tensors)."""
    if not codec.fp8:
        if shard.fp8:
            raise ValueError(f"write_shard({path}): an FP8 shard cannot be stored with codec {codec.spec}")
        return shard.hidden.detach().cpu().view(torch.uint16).numpy(), None
    if shard.fp8:
        values, scales = shard.hidden.detach().cpu(), shard.hidden_scales.detach().cpu()
    else:
        values, scales = hidden_fp8.quantize(shard.hidden.detach().cpu(), shard.meta.num_layers)
    problem = hidden_fp8.nonfinite_problem(scales, shard.cu_seqlens, shard.sample_index, shard.meta.layer_ids)
    if problem:
        raise hidden_fp8.NonFiniteHiddenError(f"{path.name}: {problem}: not written")
    return values.view(torch.uint8).numpy(), scales.view(torch.uint16).numpy()


def _group_attrs(shard: Shard, codec: CodecConfig) -> dict[str, Any]:
    """The zarr group's attributes: what a reader checks before trusting the arrays (format, version) and
    the shard's metadata (docs/shard-format.md)."""
    meta = shard.meta
    return {
        "format": SHARD_FORMAT,
        "version": SHARD_VERSION,
        "target_model": meta.target_model,
        "layer_ids": list(meta.layer_ids),
        "num_layers": meta.num_layers,
        "hidden_size": meta.hidden_size,
        "hidden_dtype": hidden_fp8.FP8_NAME if codec.fp8 else HIDDEN_DTYPE,
        "producer_id": meta.producer_id,
        "bucket": meta.bucket,
        "epoch": meta.epoch,
        "num_tokens": shard.num_tokens,
        "num_samples": shard.num_samples,
        "codec": codec.spec,
    }


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
        # Small arrays: one chunk each (a few bytes per token, never the bottleneck); the scales of FP8
        # hidden states are [T, K] bf16 bits, 2 bytes per token and layer.
        scales = name == SCALES_ARRAY
        arr = group.create_array(
            name,
            shape=data.shape,
            dtype=np.uint16 if scales else SHARD_ARRAYS[name][1],
            chunks=tuple(max(1, n) for n in data.shape),
            compressors=[ZstdCodec(level=1), Crc32cCodec()],
            dimension_names=("token", "layer") if scales else None,
            config=array_config,
        )
        arr[...] = data
    rows = hidden_chunk_rows(hidden.shape[0], hidden.shape[1] * hidden.itemsize, chunk_bytes)
    arr = group.create_array(
        "hidden",
        shape=hidden.shape,
        dtype=hidden.dtype,
        chunks=(rows, hidden.shape[1]),
        compressors=codec.zarr_codecs(element_size=hidden.itemsize),
        dimension_names=("token", "feature"),
        config=array_config,
    )
    arr[...] = hidden
