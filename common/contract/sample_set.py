"""The set of global sample indices trained in one epoch, as a compact bitmap.

Why a bitmap: the set is saved in every checkpoint and read by every producer on start, and datasets
have millions of samples; one bit per index (1.25 MB for 10 M samples, far less after compression since
training order is mostly contiguous per producer) beats a list of int64s by 64x and makes ``union`` a
byte-wise OR when ranks' sets are merged.

Serialized form (little endian): a 40-byte header ``magic "DFSS" | version u8 | codec u8 | pad u16 |
epoch i64 | bitmap bytes u64 | count u64 | crc32 of the raw bitmap u32 | pad u32``, then the bitmap
(bit ``i % 8`` of byte ``i // 8`` is index ``i``), zstd-compressed (codec 1) or raw (codec 0).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable

import numpy as np
import torch
import zstandard

MAGIC = b"DFSS"
VERSION = 1
_HEADER = struct.Struct("<4sBBHqQQII")
_CODEC_RAW, _CODEC_ZSTD = 0, 1


class SampleSetFormatError(ValueError):
    """Bytes that are not a valid serialized SampleSet (wrong magic/version, truncated, checksum)."""


def _as_index_array(indices: Iterable[int] | torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(indices, torch.Tensor):
        arr = indices.detach().cpu().reshape(-1).numpy()
    elif isinstance(indices, np.ndarray):
        arr = indices.reshape(-1)
    elif isinstance(indices, range):
        arr = np.arange(indices.start, indices.stop, indices.step, dtype=np.int64)
    else:
        arr = np.fromiter((int(i) for i in indices), dtype=np.int64)
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"sample indices must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"sample indices must be >= 0, got {int(arr.min())}")
    return arr


class SampleSet:
    """Trained sample indices of epoch ``epoch``. ``size_hint`` pre-sizes the bitmap (it grows anyway)."""

    def __init__(self, epoch: int = 0, size_hint: int = 0):
        if epoch < 0:
            raise ValueError(f"SampleSet epoch must be >= 0, got {epoch}")
        if size_hint < 0:
            raise ValueError(f"SampleSet size_hint must be >= 0, got {size_hint}")
        self.epoch = int(epoch)
        self._bits = np.zeros((size_hint + 7) // 8, dtype=np.uint8)
        self._count: int | None = 0

    def _grow(self, num_bytes: int) -> None:
        if num_bytes > self._bits.size:
            # Double so that adding indices in increasing order is amortized O(1) per byte.
            bigger = np.zeros(max(num_bytes, 2 * self._bits.size), dtype=np.uint8)
            bigger[: self._bits.size] = self._bits
            self._bits = bigger

    def add(self, indices: Iterable[int] | torch.Tensor | np.ndarray) -> None:
        arr = _as_index_array(indices)
        if arr.size == 0:
            return
        self._grow(int(arr.max()) // 8 + 1)
        np.bitwise_or.at(self._bits, arr >> 3, (1 << (arr & 7)).astype(np.uint8))
        self._count = None

    def __contains__(self, index: object) -> bool:
        if isinstance(index, torch.Tensor | np.integer):
            index = int(index)
        if not isinstance(index, int) or index < 0:
            return False
        byte = index >> 3
        return byte < self._bits.size and bool((self._bits[byte] >> (index & 7)) & 1)

    def __len__(self) -> int:
        if self._count is None:
            self._count = int(np.unpackbits(self._bits).sum(dtype=np.int64))
        return self._count

    def indices(self) -> torch.Tensor:
        """Sorted int64 tensor of the indices in the set."""
        bits = np.unpackbits(self._bits, bitorder="little")
        return torch.from_numpy(np.flatnonzero(bits).astype(np.int64))

    def contains_mask(self, indices: torch.Tensor | np.ndarray | Iterable[int]) -> torch.Tensor:
        """Vectorized membership: a bool tensor, True where the index is in the set (for producers' skips)."""
        arr = _as_index_array(indices)
        byte = arr >> 3
        inside = byte < self._bits.size
        out = np.zeros(arr.shape, dtype=bool)
        out[inside] = ((self._bits[byte[inside]] >> (arr[inside] & 7)) & 1).astype(bool)
        return torch.from_numpy(out)

    def _used_bytes(self) -> np.ndarray:
        nonzero = np.flatnonzero(self._bits)
        return self._bits[: int(nonzero[-1]) + 1] if nonzero.size else self._bits[:0]

    def update(self, other: SampleSet) -> None:
        """In-place union with ``other`` (same epoch): how ranks' sets are merged before a checkpoint."""
        if other.epoch != self.epoch:
            raise ValueError(f"cannot merge SampleSets of epochs {self.epoch} and {other.epoch}")
        theirs = other._used_bytes()
        self._grow(theirs.size)
        self._bits[: theirs.size] |= theirs
        self._count = None

    def union(self, *others: SampleSet) -> SampleSet:
        out = self.copy()
        for other in others:
            out.update(other)
        return out

    __or__ = union

    def copy(self) -> SampleSet:
        out = SampleSet(self.epoch)
        out._bits = self._bits.copy()
        out._count = self._count
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SampleSet):
            return NotImplemented
        return self.epoch == other.epoch and np.array_equal(self._used_bytes(), other._used_bytes())

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"SampleSet(epoch={self.epoch}, len={len(self)})"

    def to_bytes(self, *, compress: bool = True) -> bytes:
        raw = self._used_bytes().tobytes()
        codec, payload = _CODEC_RAW, raw
        if compress:
            codec, payload = _CODEC_ZSTD, zstandard.ZstdCompressor(level=3).compress(raw)
        header = _HEADER.pack(MAGIC, VERSION, codec, 0, self.epoch, len(raw), len(self), zlib.crc32(raw), 0)
        return header + payload

    @classmethod
    def from_bytes(cls, data: bytes) -> SampleSet:
        if len(data) < _HEADER.size:
            raise SampleSetFormatError(f"sample set: {len(data)} bytes is shorter than its header")
        magic, version, codec, _, epoch, num_bytes, count, crc, _ = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise SampleSetFormatError(f"sample set: bad magic {magic!r} (expected {MAGIC!r})")
        if version != VERSION:
            raise SampleSetFormatError(
                f"sample set: unsupported version {version} (this code reads {VERSION})"
            )
        payload = bytes(data[_HEADER.size :])
        if codec == _CODEC_ZSTD:
            try:
                raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=num_bytes)
            except zstandard.ZstdError as err:
                raise SampleSetFormatError(f"sample set: corrupt zstd payload ({err})") from None
        elif codec == _CODEC_RAW:
            raw = payload
        else:
            raise SampleSetFormatError(f"sample set: unknown codec {codec}")
        if len(raw) != num_bytes or zlib.crc32(raw) != crc:
            raise SampleSetFormatError("sample set: bitmap length or crc32 mismatch (truncated or corrupt)")
        out = cls(epoch)
        out._bits = np.frombuffer(raw, dtype=np.uint8).copy()
        out._count = None
        if len(out) != count:
            raise SampleSetFormatError(f"sample set: header says {count} indices, bitmap has {len(out)}")
        return out

    @classmethod
    def from_indices(cls, indices: Iterable[int] | torch.Tensor | np.ndarray, *, epoch: int = 0) -> SampleSet:
        out = cls(epoch)
        out.add(indices)
        return out
