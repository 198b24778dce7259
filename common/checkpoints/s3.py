"""The S3 checkpoint store (boto3): multipart uploads, retries with backoff on top of botocore's own, and
one-line errors that say what to fix (missing bucket, denied, unreachable endpoint) without a secret.

Credentials and the endpoint come from the standard AWS chain (``AWS_PROFILE``, ``AWS_ACCESS_KEY_ID``,
instance roles, ``AWS_ENDPOINT_URL``), never from code or flags."""

from __future__ import annotations

import io
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import boto3
import botocore.session
from boto3.exceptions import RetriesExceededError, S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from dflash.common.checkpoints.store_protocol import (
    CheckpointStore,
    CheckpointStoreError,
    StoreKeyNotFoundError,
    check_key,
)
from dflash.common.cli.exits import one_line
from dflash.common.redact import redact, register_secret

log = logging.getLogger(__name__)
T = TypeVar("T")


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


def valid_bucket_name(bucket: str) -> bool:
    """S3's bucket naming rule (3-63 lowercase letters, digits, dots and dashes, starting and ending alnum)."""
    return bool(_BUCKET_NAME.match(bucket))


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
_data_loader: Any = None


def _root_cause(err: BaseException) -> BaseException:
    """boto3 wraps ClientErrors of transfers (S3UploadFailedError, RetriesExceededError): unwrap them."""
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

    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code, status
    return "", 0


def _is_transient(err: BaseException) -> bool:

    if isinstance(err, BotoConnectionError | HTTPClientError | IncompleteReadError):
        return True
    code, status = _error_code(err)
    return code in _TRANSIENT_CODES or status >= 500 or status == 429


def _botocore_session() -> Any:
    """A new botocore session (it reads the AWS environment now) that shares one data loader per
    process: parsing the S3 service model costs ~0.15 s per client otherwise."""
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

        if not valid_bucket_name(bucket):
            raise ValueError(f"invalid S3 bucket name {bucket!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.options = options or S3Options()
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.retries = 0
        self._retries_lock = threading.Lock()
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
            raise CheckpointStoreError(one_line(f"cannot set up S3 access for {self.url}: {err}")) from None
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
        check_key(key)
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
                    with self._retries_lock:
                        self.retries += 1
                    # counted, not said: the caller's line on the operation's outcome says the count
                    # (an outage is one line per failed save, not one per retry)
                    log.debug(
                        one_line(
                            f"{what} {self.url_for(key)}: {type(cause).__name__}: {cause}; "
                            f"retrying in {delay:.2f}s (attempt {attempt}/{opts.operation_attempts})"
                        )
                    )
                    time.sleep(delay)
                    continue
                raise self._translate(what, key, cause) from None
        raise AssertionError("unreachable")

    def _translate(self, what: str, key: str, err: BaseException) -> CheckpointStoreError:

        url = self.url_for(key)
        code, status = _error_code(err)
        if code in ("NoSuchKey", "404") or (code == "" and status == 404):
            return StoreKeyNotFoundError(one_line(f"{url}: not found"))
        if code == "NoSuchBucket":
            return CheckpointStoreError(
                one_line(f"s3://{self.bucket}: bucket does not exist (endpoint {self.endpoint})")
            )
        if code in _DENIED_CODES or status == 403:
            return CheckpointStoreError(
                one_line(
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
            return CheckpointStoreError(one_line(f"{what} {url}: {err}"))
        if isinstance(err, BotoConnectionError):
            return CheckpointStoreError(
                one_line(f"{what} {url}: cannot reach the S3 endpoint {self.endpoint}")
            )
        if code:
            return CheckpointStoreError(one_line(f"{what} {url} failed: {code}: {err}"))
        kind = "" if isinstance(err, BotoCoreError | CheckpointStoreError) else f"{type(err).__name__}: "
        return CheckpointStoreError(one_line(f"{what} {url} failed: {kind}{err}"))

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
            check_key(prefix)
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0

        def list_all() -> list[str]:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
            return [obj["Key"][strip:] for page in pages for obj in page.get("Contents", [])]

        return sorted(self._call("list", prefix, list_all))

    def delete_prefix(self, prefix: str) -> None:
        check_key(prefix)
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
                    one_line(
                        f"delete {self.url_for(prefix)}: {len(errors)} object(s) not deleted, first "
                        f"{first.get('Key')}: {first.get('Code')} {first.get('Message', '')}"
                    )
                )

    def check(self) -> None:
        try:
            self._call("open", "", lambda: self.client.head_bucket(Bucket=self.bucket))
        except StoreKeyNotFoundError:  # HeadBucket answers a bare 404 for a missing bucket
            raise CheckpointStoreError(
                one_line(f"s3://{self.bucket}: bucket does not exist (endpoint {self.endpoint})")
            ) from None
