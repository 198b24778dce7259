"""Checkpoint storage behind a small key/value protocol: a local directory or an S3 prefix.

Why a protocol on plain ``str`` keys (as torchtitan does): the checkpoint code only ever needs "put these
bytes/this file under this key", "list keys under a prefix" and "delete a prefix", so the same code runs
against ``/some/dir`` and ``s3://bucket/prefix``. Keys are ``/``-separated and relative to the store root.

S3 uses the standard AWS configuration chain (``AWS_PROFILE``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
instance roles, ``AWS_ENDPOINT_URL`` for MinIO/Ceph/moto...): credentials never pass through this code.
Errors are one line (:class:`CheckpointStoreError`) and go through :func:`redact`, so a failure message
can be logged or printed by a CLI without leaking secrets.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from dflash.common.checkpoints.store_protocol import (
    CheckpointStore,
    CheckpointStoreError,
    StoreKeyNotFoundError,
    check_key,
)
from dflash.common.cli.exits import one_line
from dflash.common.redact import redact

__all__ = ["CheckpointStore", "CheckpointStoreError", "LocalStore", "StoreKeyNotFoundError", "open_store"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# ----------------------------------------------------------------------------------------------------------
# Local directory


_TMP_MARK = ".tmp-"


def _fsync_dir(path: Path) -> None:
    """Persist a rename: without it a power loss can keep ``latest`` but lose the files it names."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class LocalStore(CheckpointStore):
    """A directory. Every write goes to a temporary name in the same directory, is fsynced, then
    ``os.replace``d into place, so readers (and a crash) see either the old or the new file, never a part."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _atomic_write(self, key: str, write: Callable[[Path], None]) -> None:
        dest = self._path(key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.parent / f".{dest.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                write(tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, dest)
                _fsync_dir(dest.parent)
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as err:
            blocker = next((p for p in dest.parents if p.exists() and not p.is_dir()), None)
            why = f"{blocker} is a file, not a folder" if blocker is not None else (err.strerror or str(err))
            raise CheckpointStoreError(one_line(f"cannot write {dest}: {why}")) from None

    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(key, lambda tmp: tmp.write_bytes(data))

    def put_file(self, key: str, path: str | Path) -> None:
        self._atomic_write(key, lambda tmp: shutil.copyfile(path, tmp))

    def _read(self, key: str, read: Callable[[Path], T]) -> T:
        src = self._path(key)
        try:
            return read(src)
        except FileNotFoundError:
            raise StoreKeyNotFoundError(f"{src}: not found") from None
        except OSError as err:
            raise CheckpointStoreError(one_line(f"cannot read {src}: {err.strerror or err}")) from None

    def get_bytes(self, key: str) -> bytes:
        return self._read(key, Path.read_bytes)

    def get_file(self, key: str, path: str | Path) -> None:
        self._read(key, lambda src: shutil.copyfile(src, path))

    def size(self, key: str) -> int:
        return self._read(key, lambda src: src.stat().st_size)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        if prefix:
            check_key(prefix)
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if _TMP_MARK in name:
                    continue
                key = Path(dirpath, name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete_prefix(self, prefix: str) -> None:
        check_key(prefix)
        target = self.root / prefix.rstrip("/")
        try:
            if prefix.endswith("/") and target.is_dir():
                shutil.rmtree(target)
                return
            for key in self.list(prefix):
                (self.root / key).unlink(missing_ok=True)
        except OSError as err:
            raise CheckpointStoreError(one_line(f"cannot delete {target}: {err.strerror or err}")) from None

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckpointStoreError(
                one_line(f"cannot create {self.root}: {err.strerror or err}")
            ) from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise CheckpointStoreError(f"{self.root}: not writable")


def open_store(url: str | Path, *, s3_options: Any = None) -> CheckpointStore:
    """``s3://bucket[/prefix]`` -> :class:`S3Store`; ``file:///path`` or a plain path -> :class:`LocalStore`.

    Opening does no I/O; call ``store.check()`` to fail early on a missing bucket or missing permissions.
    """
    text = str(url)
    if not text.strip():
        raise ValueError("checkpoint store url is empty")
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", text)
    if match is None:
        return LocalStore(text)
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "file":
        return LocalStore(rest if rest.startswith("/") else "/" + rest)
    if scheme != "s3":
        raise ValueError(
            f"checkpoint store url {redact(text)!r}: unsupported scheme {scheme!r} (use s3://bucket/prefix or a path)"
        )
    # s3.py builds on this module's base class (and imports boto3 only when an S3 store is opened)
    from dflash.common.checkpoints.s3 import S3Store, valid_bucket_name

    bucket, _, prefix = rest.partition("/")
    if "@" in bucket or ":" in bucket:
        raise ValueError(
            f"checkpoint store url {redact(text)!r}: credentials or ports do not belong in an s3:// url "
            "(use AWS_PROFILE / AWS_ACCESS_KEY_ID and AWS_ENDPOINT_URL)"
        )
    if not valid_bucket_name(bucket):
        raise ValueError(f"checkpoint store url {redact(text)!r}: invalid bucket name {bucket!r}")
    if any(p in (".", "..") for p in prefix.strip("/").split("/") if prefix.strip("/")):
        raise ValueError(f"checkpoint store url {redact(text)!r}: prefix must not contain '.' or '..'")
    return S3Store(bucket, prefix, options=s3_options)
