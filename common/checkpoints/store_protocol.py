"""The checkpoint store protocol: what a store must do, and the errors it raises.

Why its own module: the local store (store.py) and the S3 store (s3.py) both build on it, and store.py
opens either by URL; with the protocol apart, s3.py needs nothing of store.py and no import runs in a circle.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from pathlib import Path

from dflash.common.cli.exits import one_line


class CheckpointStoreError(RuntimeError):
    """A storage operation failed; the message is one line and already redacted."""


class StoreKeyNotFoundError(CheckpointStoreError):
    """The key does not exist in the store."""


def check_key(key: str) -> str:
    """``key`` when it is a valid store key: non-empty, relative, '/'-separated, no '.' or '..'; else ValueError."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"store key must be a non-empty str, got {key!r}")
    parts = key.split("/")
    if key.startswith("/") or "\\" in key or any(p in (".", "..") for p in parts):
        raise ValueError(f"store key {key!r}: must be relative, '/'-separated, without '.' or '..'")
    return key


class CheckpointStore(ABC):
    """The storage protocol the checkpoint code uses. Keys are relative, '/'-separated strings; a missing
    key raises StoreKeyNotFoundError, any other failure CheckpointStoreError (one line, redacted)."""

    url: str
    retries: int = 0
    """Whole operations this store tried again after a transient failure, so far (the S3 store's backoff
    around an operation; 0 for a folder). A caller that tries a write again itself says the count once,
    in the line that reports the write's outcome, rather than a line per retry."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write ``data`` under ``key``, replacing it; readers never see a partial object."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def put_file(self, key: str, path: str | Path) -> None:
        """Upload a local file (large files in parallel parts on S3)."""

    @abstractmethod
    def get_file(self, key: str, path: str | Path) -> None: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys that start with ``prefix`` (a plain string prefix, as on S3)."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every key that starts with ``prefix`` (end it with '/' to mean one directory)."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def check(self) -> None:
        """Fail early with a clear error when the store is unusable (missing bucket, no permission)."""

    def url_for(self, key: str) -> str:
        return self.url.rstrip("/") + "/" + key if key else self.url

    def probe_writable(self, prefix: str) -> None:
        """Prove the store takes checkpoints under ``prefix``: write a small object, read it back, delete it.

        Why a real write and not a permission check: a read-only mount, a full disk, a bucket policy that
        denies PutObject, or a root user on a 0555 folder all pass ``os.access`` or HeadBucket and still
        refuse the first checkpoint. Raises CheckpointStoreError (one line) naming the store and the cause.
        """
        key = f"{prefix.strip('/')}/.write-probe-{uuid.uuid4().hex[:12]}"
        data = b"dflash-spool write probe " + key.encode()
        try:
            self.put_bytes(key, data)
            back = self.get_bytes(key)
            if back != data:
                raise CheckpointStoreError(
                    f"read back {len(back)} bytes that differ from the {len(data)} written"
                )
            self.delete_prefix(key)
        except CheckpointStoreError as err:
            raise CheckpointStoreError(
                one_line(f"checkpoint store {self.url_for(prefix)} is not writable: {err}")
            ) from None
        except (OSError, ValueError) as err:
            raise CheckpointStoreError(
                one_line(f"checkpoint store {self.url_for(prefix)} is not writable: {err}")
            ) from None
