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

import io
import logging
import os
import random
import re
import shutil
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

# ----------------------------------------------------------------------------------------------------------
# Redaction


_AWS_KEY_ID = re.compile(
    r"(?<![A-Z0-9])(?:AKIA|ASIA|AIDA|AROA|AGPA|ANPA|ANVA|AIPA|ABIA|ACCA)[A-Z0-9]{16}(?![A-Z0-9])"
)
# A 40-character base64-ish run with upper, lower and a digit: the shape of an AWS secret access key.
_AWS_SECRET = re.compile(
    r"(?<![A-Za-z0-9/+=])(?=[A-Za-z0-9/+]{0,39}[A-Z])(?=[A-Za-z0-9/+]{0,39}[a-z])(?=[A-Za-z0-9/+]{0,39}[0-9])"
    r"[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"
)
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")
_SECRET_ASSIGNMENT = re.compile(
    r"(?i)((?<![A-Za-z0-9_\-])(?:(?:aws_)?secret_access_key|secret_key|secret|(?:aws_)?session_token|"
    r"(?:aws_)?security_token|(?:aws_)?access_key_id|access_key|password|passwd|token|api_key|apikey|hf_token|"
    r"auth_token|access_token|x-amz-security-token|x-amz-credential|x-amz-signature|signature|credential)"
    r"[\"']?\s*[=:]\s*[\"']?)([^\s\"'&,;}\]]+)"
)
_SECRET_ENV_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID")
# Config keys whose string values are blanked. A bare "token" suffix is not enough ("mask_token" is not a secret).
_SECRET_KEY_NAME = re.compile(
    r"(?i)token|(?:.*[_\-.])?(?:secret(?:[_-]access)?(?:[_-]key)?|password|passwd|credentials?|api[_-]?key|"
    r"access[_-]?key(?:[_-]?id)?|(?:auth|access|api|session|security|hf|wandb|bearer|refresh|github)[_-]?token)"
)
_extra_secrets: set[str] = set()
REDACTED = "***"


def register_secret(value: str | None) -> None:
    """Make :func:`redact` replace this literal value too (e.g. credentials resolved from a profile)."""
    if value and len(value) >= 8:
        _extra_secrets.add(value)


def redact(text: str) -> str:
    """Remove credentials from free text (log lines, error messages, config values).

    Covers: the literal values of the AWS credential environment variables and of registered secrets,
    AWS access key ids, strings shaped like AWS secret keys, ``name=value`` / ``"name": "value"`` pairs
    whose name looks secret, and the ``user:pass@`` part of URLs.
    """
    text = str(text)
    literals = {os.environ.get(name, "") for name in _SECRET_ENV_VARS} | _extra_secrets
    for value in sorted((v for v in literals if len(v) >= 8), key=len, reverse=True):
        text = text.replace(value, REDACTED)
    text = _URL_USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", text)
    text = _SECRET_ASSIGNMENT.sub(lambda m: m.group(1) + REDACTED, text)
    text = _AWS_KEY_ID.sub(REDACTED, text)
    return _AWS_SECRET.sub(REDACTED, text)


def redact_config(obj: Any) -> Any:
    """A JSON-friendly deep copy of ``obj`` with secret-named keys blanked and every string redacted."""
    if isinstance(obj, Mapping):
        out = {}
        for key, value in obj.items():
            if _SECRET_KEY_NAME.fullmatch(str(key)) and isinstance(value, str | bytes) and value:
                out[str(key)] = REDACTED
            else:
                out[str(key)] = redact_config(value)
        return out
    if isinstance(obj, list | tuple | set | frozenset):
        return [redact_config(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float):
        return obj
    return redact(str(obj))


def _one_line(text: str) -> str:
    return redact(" ".join(str(text).split()))


# ----------------------------------------------------------------------------------------------------------
# Protocol and errors


class CheckpointStoreError(RuntimeError):
    """A storage operation failed; the message is one line and already redacted."""


class StoreKeyNotFoundError(CheckpointStoreError):
    """The key does not exist in the store."""


def _check_key(key: str) -> str:
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
        return self.root / _check_key(key)

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
            raise CheckpointStoreError(_one_line(f"cannot write {dest}: {err.strerror or err}")) from None

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
            raise CheckpointStoreError(_one_line(f"cannot read {src}: {err.strerror or err}")) from None

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
            _check_key(prefix)
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
        _check_key(prefix)
        target = self.root / prefix.rstrip("/")
        try:
            if prefix.endswith("/") and target.is_dir():
                shutil.rmtree(target)
                return
            for key in self.list(prefix):
                (self.root / key).unlink(missing_ok=True)
        except OSError as err:
            raise CheckpointStoreError(_one_line(f"cannot delete {target}: {err.strerror or err}")) from None

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckpointStoreError(
                _one_line(f"cannot create {self.root}: {err.strerror or err}")
            ) from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise CheckpointStoreError(f"{self.root}: not writable")


# ----------------------------------------------------------------------------------------------------------
# S3


@dataclass(kw_only=True)
class S3Options:
    """Transfer and retry settings for :class:`S3Store`. Credentials and endpoint are NOT here: they come
    from the standard AWS chain (env vars, profiles, instance roles; ``AWS_ENDPOINT_URL``)."""

    max_attempts: int = 5
    """botocore attempts per HTTP request, the first one included (it retries throttling, 5xx and
    connection errors)."""
    retry_mode: str = "standard"
    """botocore retry mode: "standard" or "adaptive" (adds client-side rate limiting)."""
    operation_attempts: int = 4
    """Attempts of a whole operation (e.g. one multipart upload) after botocore gave up on a request."""
    backoff_s: float = 1.0
    """First whole-operation backoff; doubles per attempt, with jitter, capped at ``max_backoff_s``."""
    max_backoff_s: float = 30.0
    multipart_threshold_mb: int = 64
    """Files at least this large are uploaded/downloaded in parts, in parallel."""
    multipart_chunk_mb: int = 64
    max_concurrency: int = 8
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("max_attempts", "operation_attempts", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"S3Options.{name} must be >= 1, got {getattr(self, name)}")
        if self.retry_mode not in ("standard", "adaptive", "legacy"):
            raise ValueError(
                f"S3Options.retry_mode must be standard|adaptive|legacy, got {self.retry_mode!r}"
            )
        if self.multipart_chunk_mb < 5 or self.multipart_threshold_mb < 5:
            raise ValueError(
                "S3Options.multipart_chunk_mb/multipart_threshold_mb must be >= 5 (S3 minimum part)"
            )
        for name in ("backoff_s", "max_backoff_s", "connect_timeout_s", "read_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"S3Options.{name} must be >= 0, got {getattr(self, name)}")


_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeoutException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "BadDigest",
}
_DENIED_CODES = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}
_DENIED_CODES |= {"InvalidToken", "AllAccessDisabled", "AccountProblem"}


def _root_cause(err: BaseException) -> BaseException:
    """boto3 wraps ClientErrors of transfers (S3UploadFailedError, RetriesExceededError): unwrap them."""
    from boto3.exceptions import RetriesExceededError, S3UploadFailedError

    seen = 0
    while seen < 10:
        seen += 1
        if isinstance(err, RetriesExceededError) and err.last_exception is not None:
            err = err.last_exception
        elif isinstance(err, S3UploadFailedError) and (err.__cause__ or err.__context__):
            err = err.__cause__ or err.__context__
        else:
            break
    return err


def _error_code(err: BaseException) -> tuple[str, int]:
    from botocore.exceptions import ClientError

    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code, status
    return "", 0


def _is_transient(err: BaseException) -> bool:
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError, IncompleteReadError

    if isinstance(err, BotoConnectionError | HTTPClientError | IncompleteReadError):
        return True
    code, status = _error_code(err)
    return code in _TRANSIENT_CODES or status >= 500 or status == 429


_data_loader: Any = None


def _botocore_session() -> Any:
    """A new botocore session (it reads the AWS environment now) that shares one data loader per
    process: parsing the S3 service model costs ~0.15 s per client otherwise."""
    import botocore.session

    global _data_loader
    session = botocore.session.get_session()
    if _data_loader is None:
        _data_loader = session.get_component("data_loader")
    else:
        session.register_component("data_loader", _data_loader)
    return session


class S3Store(CheckpointStore):
    """``s3://bucket/prefix`` through boto3: TransferManager for files (multipart above a threshold,
    parallel parts), botocore per-request retries, and a jittered exponential backoff around each whole
    operation for outages longer than botocore's retries."""

    def __init__(
        self, bucket: str, prefix: str = "", *, options: S3Options | None = None, client: Any = None
    ):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError

        if not _BUCKET_NAME.match(bucket):
            raise ValueError(f"invalid S3 bucket name {bucket!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.options = options or S3Options()
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        opts = self.options
        config = Config(
            # total_max_attempts counts the first try too ("max_attempts" in this dict would not)
            retries={"total_max_attempts": opts.max_attempts, "mode": opts.retry_mode},
            connect_timeout=opts.connect_timeout_s,
            read_timeout=opts.read_timeout_s,
            max_pool_connections=max(10, opts.max_concurrency + 2),
        )
        try:
            self._session = boto3.session.Session(botocore_session=_botocore_session())
            self.client = client or self._session.client("s3", config=config)
        except BotoCoreError as err:  # e.g. AWS_PROFILE names a profile that does not exist
            raise CheckpointStoreError(_one_line(f"cannot set up S3 access for {self.url}: {err}")) from None
        mb = 1024 * 1024
        self.transfer_config = TransferConfig(
            multipart_threshold=opts.multipart_threshold_mb * mb,
            multipart_chunksize=opts.multipart_chunk_mb * mb,
            max_concurrency=opts.max_concurrency,
            use_threads=True,
        )
        self._remember_credentials()

    def _remember_credentials(self) -> None:
        """Credentials resolved from a profile or role are not in os.environ: register them so that
        :func:`redact` also removes them from any error text."""
        try:
            creds = self._session.get_credentials()
            if creds is not None:
                frozen = creds.get_frozen_credentials()
                for value in (frozen.access_key, frozen.secret_key, frozen.token):
                    register_secret(value)
        except Exception:  # no credentials yet: the first request reports it clearly
            pass

    @property
    def endpoint(self) -> str:
        return redact(self.client.meta.endpoint_url)

    def _key(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- error handling ---------------------------------------------------------------------------------

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        opts = self.options
        for attempt in range(1, opts.operation_attempts + 1):
            try:
                return fn()
            except Exception as err:
                cause = _root_cause(err)
                if attempt < opts.operation_attempts and _is_transient(cause):
                    backoff = min(opts.max_backoff_s, opts.backoff_s * 2 ** (attempt - 1))
                    delay = backoff * random.uniform(0.5, 1.0)
                    log.warning(
                        _one_line(
                            f"{what} {self.url_for(key)}: {type(cause).__name__}: {cause}; "
                            f"retrying in {delay:.2f}s (attempt {attempt}/{opts.operation_attempts})"
                        )
                    )
                    time.sleep(delay)
                    continue
                raise self._translate(what, key, cause) from None
        raise AssertionError("unreachable")

    def _translate(self, what: str, key: str, err: BaseException) -> CheckpointStoreError:
        from botocore.exceptions import (
            BotoCoreError,
            NoCredentialsError,
            PartialCredentialsError,
            ProfileNotFound,
        )
        from botocore.exceptions import ConnectionError as BotoConnectionError

        url = self.url_for(key)
        code, status = _error_code(err)
        if code in ("NoSuchKey", "404") or (code == "" and status == 404):
            return StoreKeyNotFoundError(_one_line(f"{url}: not found"))
        if code == "NoSuchBucket":
            return CheckpointStoreError(
                _one_line(f"s3://{self.bucket}: bucket does not exist (endpoint {self.endpoint})")
            )
        if code in _DENIED_CODES or status == 403:
            return CheckpointStoreError(
                _one_line(
                    f"{what} {url}: access denied ({code or status}); check the AWS credentials "
                    "(AWS_PROFILE, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, instance role) and the bucket policy"
                )
            )
        if isinstance(err, NoCredentialsError | PartialCredentialsError):
            return CheckpointStoreError(
                f"{what} {url}: no usable AWS credentials; set AWS_PROFILE or "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or run with an instance role"
            )
        if isinstance(err, ProfileNotFound):
            return CheckpointStoreError(_one_line(f"{what} {url}: {err}"))
        if isinstance(err, BotoConnectionError):
            return CheckpointStoreError(
                _one_line(f"{what} {url}: cannot reach the S3 endpoint {self.endpoint}")
            )
        if code:
            return CheckpointStoreError(_one_line(f"{what} {url} failed: {code}: {err}"))
        kind = "" if isinstance(err, BotoCoreError | CheckpointStoreError) else f"{type(err).__name__}: "
        return CheckpointStoreError(_one_line(f"{what} {url} failed: {kind}{err}"))

    # -- protocol ---------------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        full = self._key(key)
        if len(data) < self.transfer_config.multipart_threshold:
            self._call("upload", key, lambda: self.client.put_object(Bucket=self.bucket, Key=full, Body=data))
            return
        self._call(
            "upload",
            key,
            lambda: self.client.upload_fileobj(
                io.BytesIO(data), self.bucket, full, Config=self.transfer_config
            ),
        )

    def get_bytes(self, key: str) -> bytes:
        full = self._key(key)

        def get() -> bytes:
            return self.client.get_object(Bucket=self.bucket, Key=full)["Body"].read()

        return self._call("download", key, get)

    def put_file(self, key: str, path: str | Path) -> None:
        full = self._key(key)
        self._call(
            "upload",
            key,
            lambda: self.client.upload_file(str(path), self.bucket, full, Config=self.transfer_config),
        )

    def get_file(self, key: str, path: str | Path) -> None:
        # s3transfer downloads to a temporary name and renames it into place.
        full = self._key(key)
        self._call(
            "download",
            key,
            lambda: self.client.download_file(self.bucket, full, str(path), Config=self.transfer_config),
        )

    def size(self, key: str) -> int:
        full = self._key(key)
        head = self._call("stat", key, lambda: self.client.head_object(Bucket=self.bucket, Key=full))
        return int(head["ContentLength"])

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except StoreKeyNotFoundError:
            self.check()  # HEAD answers a bare 404 for a missing bucket too: tell the two apart
            return False

    def list(self, prefix: str = "") -> list[str]:
        if prefix:
            _check_key(prefix)
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0

        def list_all() -> list[str]:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
            return [obj["Key"][strip:] for page in pages for obj in page.get("Contents", [])]

        return sorted(self._call("list", prefix, list_all))

    def delete_prefix(self, prefix: str) -> None:
        _check_key(prefix)
        keys = [self._key(k) for k in self.list(prefix)]
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start : start + 1000]]
            resp = self._call(
                "delete",
                prefix,
                lambda batch=batch: self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                ),
            )
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise CheckpointStoreError(
                    _one_line(
                        f"delete {self.url_for(prefix)}: {len(errors)} object(s) not deleted, first "
                        f"{first.get('Key')}: {first.get('Code')} {first.get('Message', '')}"
                    )
                )

    def check(self) -> None:
        try:
            self._call("open", "", lambda: self.client.head_bucket(Bucket=self.bucket))
        except StoreKeyNotFoundError:  # HeadBucket answers a bare 404 for a missing bucket
            raise CheckpointStoreError(
                _one_line(f"s3://{self.bucket}: bucket does not exist (endpoint {self.endpoint})")
            ) from None


# ----------------------------------------------------------------------------------------------------------


def open_store(url: str | Path, *, s3_options: S3Options | None = None) -> CheckpointStore:
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
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket or ":" in bucket:
        raise ValueError(
            f"checkpoint store url {redact(text)!r}: credentials or ports do not belong in an s3:// url "
            "(use AWS_PROFILE / AWS_ACCESS_KEY_ID and AWS_ENDPOINT_URL)"
        )
    if not _BUCKET_NAME.match(bucket):
        raise ValueError(f"checkpoint store url {redact(text)!r}: invalid bucket name {bucket!r}")
    if any(p in (".", "..") for p in prefix.strip("/").split("/") if prefix.strip("/")):
        raise ValueError(f"checkpoint store url {redact(text)!r}: prefix must not contain '.' or '..'")
    return S3Store(bucket, prefix, options=s3_options)
