"""Shard names: ``b<bucket>-<producer>-s<seq>.zarr``. They sort by (bucket, producer, sequence), so a
consumer can pick a bucket and a listing shows the flow in order; producer ids and roles are checked here
once for every file name built from them."""

from __future__ import annotations

import logging
import re
from functools import lru_cache

log = logging.getLogger(__name__)


SHARD_SUFFIX = ".zarr"


_NAME_RE = re.compile(r"^b(\d{6,})-([A-Za-z0-9_.][A-Za-z0-9_.-]*)-s(\d{8,})\.zarr$")


_ID_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*$")


def _check_id(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value) or value in (".", ".."):
        raise ValueError(f"{kind} must be a non-empty string of [A-Za-z0-9_.-], got {value!r}")
    return value


def shard_name(bucket: int, producer_id: str, seq: int) -> str:
    """Name that sorts by (bucket, producer, seq) as a plain string: zero-padded numbers."""
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 0:
        raise ValueError(f"bucket must be an int >= 0, got {bucket!r}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ValueError(f"seq must be an int >= 0, got {seq!r}")
    _check_id("producer_id", producer_id)
    return f"b{bucket:06d}-{producer_id}-s{seq:08d}{SHARD_SUFFIX}"


@lru_cache(maxsize=65536)
def parse_shard_name(name: str) -> tuple[int, str, int]:
    """Inverse of ``shard_name``; ValueError for anything else (stray files, trash, .why files)."""
    m = _NAME_RE.match(name)
    if not m:
        raise ValueError(f"not a shard name: {name!r}")
    return int(m.group(1)), m.group(2), int(m.group(3))


def _is_shard_name(name: str) -> bool:
    try:
        parse_shard_name(name)
    except ValueError:
        return False
    return True
