"""Shard names: ``e<epoch>-b<bucket>-<producer>-s<seq>.zarr`` (``b<bucket>-<producer>-s<seq>.zarr`` for a
shard of no particular epoch, read as epoch 0). They sort by (epoch, bucket, producer, sequence): a
consumer claims the lowest epoch first (epochs are trained in order) and can pick a bucket, and a listing
shows the flow in order. Producer ids and roles are checked here once for every file name built from them."""

from __future__ import annotations

import logging
import re
from functools import lru_cache

log = logging.getLogger(__name__)


SHARD_SUFFIX = ".zarr"


_NAME_RE = re.compile(r"^(?:e(\d{4,})-)?b(\d{6,})-([A-Za-z0-9_.][A-Za-z0-9_.-]*)-s(\d{8,})\.zarr$")


_ID_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*$")


def check_id(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value) or value in (".", ".."):
        raise ValueError(f"{kind} must be a non-empty string of [A-Za-z0-9_.-], got {value!r}")
    return value


def shard_name(bucket: int, producer_id: str, seq: int, epoch: int | None = None) -> str:
    """Name that sorts by (epoch, bucket, producer, seq) as a plain string: zero-padded numbers. Producers
    give the epoch (a shard never mixes epochs: docs/training.md, "A campaign"); None leaves it out."""
    for what, v in (("bucket", bucket), ("seq", seq)) + ((("epoch", epoch),) if epoch is not None else ()):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{what} must be an int >= 0, got {v!r}")
    check_id("producer_id", producer_id)
    prefix = f"e{epoch:04d}-" if epoch is not None else ""
    return f"{prefix}b{bucket:06d}-{producer_id}-s{seq:08d}{SHARD_SUFFIX}"


@lru_cache(maxsize=65536)
def _parse(name: str) -> tuple[int, int, str, int]:
    m = _NAME_RE.match(name)
    if not m:
        raise ValueError(f"not a shard name: {name!r}")
    return int(m.group(1) or 0), int(m.group(2)), m.group(3), int(m.group(4))


def parse_shard_name(name: str) -> tuple[int, str, int]:
    """(bucket, producer, seq) of a shard name; ValueError for anything else (stray files, trash, .why)."""
    return _parse(name)[1:]


def shard_epoch(name: str) -> int:
    """The epoch a shard name carries (0 for a name without one)."""
    return _parse(name)[0]


def shard_sort_key(name: str) -> tuple[int, int, str, int]:
    """(epoch, bucket, producer, seq): the order consumers claim in and listings show."""
    return _parse(name)


def is_shard_name(name: str) -> bool:
    try:
        parse_shard_name(name)
    except ValueError:
        return False
    return True
