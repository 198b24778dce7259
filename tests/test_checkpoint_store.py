"""dflash.common.checkpoints.store: the same protocol tests against a local dir and moto's real S3 endpoint,
plus S3-only behaviour (multipart, retries, error messages) and redaction."""

from __future__ import annotations

import logging
import os
import shutil

import botocore.exceptions
import pytest

from dflash.common.checkpoints.s3 import S3Options, S3Store
from dflash.common.checkpoints.store import (
    CheckpointStoreError,
    LocalStore,
    StoreKeyNotFoundError,
    open_store,
)
from dflash.common.redact import redact, redact_config

FAST = S3Options(backoff_s=0.01, max_backoff_s=0.05, multipart_threshold_mb=5, multipart_chunk_mb=5)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.pipeline)])  # moto: a process
def store(request, tmp_path):
    if request.param == "local":
        return open_store(tmp_path / "store")
    return open_store(request.getfixturevalue("s3_server"), s3_options=FAST)


def test_open_store_picks_backend(tmp_path):
    assert isinstance(open_store(tmp_path), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    assert open_store(f"file://{tmp_path}").root == tmp_path


def test_open_store_s3_url(s3_env):
    s = open_store("s3://my-bucket/some/prefix/")
    assert isinstance(s, S3Store)
    assert (s.bucket, s.prefix, s.url) == ("my-bucket", "some/prefix", "s3://my-bucket/some/prefix")
    assert s.url_for("run/latest") == "s3://my-bucket/some/prefix/run/latest"
    assert open_store("s3://my-bucket").url_for("k") == "s3://my-bucket/k"


@pytest.mark.parametrize(
    "url, words",
    [
        ("", "empty"),
        ("gs://bucket/x", "unsupported scheme 'gs'"),
        ("s3://", "invalid bucket name"),
        ("s3://Bad_Bucket/x", "invalid bucket name"),
        ("s3://bucket/a/../b", "'..'"),
        ("s3://AKIAFAKE0TEST0KEY000:s3cr3tpassw0rd@bucket/x", "credentials or ports"),
    ],
)
def test_open_store_rejects_bad_urls_without_echoing_secrets(url, words):
    with pytest.raises(ValueError) as info:
        open_store(url)
    msg = str(info.value)
    assert words in msg and "\n" not in msg
    assert "s3cr3tpassw0rd" not in msg and "AKIAFAKE0TEST0KEY000" not in msg


def test_bytes_files_list_delete_roundtrip(store, tmp_path):
    store.put_bytes("run/step-1/a.bin", b"alpha")
    store.put_bytes("run/step-1/sub/b.bin", b"")
    store.put_bytes("run/step-2/a.bin", b"beta")
    store.put_bytes("run-other/x", b"x")
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(100_000))
    store.put_file("run/file.bin", src)

    assert store.get_bytes("run/step-1/a.bin") == b"alpha"
    assert store.get_bytes("run/step-1/sub/b.bin") == b""
    store.get_file("run/file.bin", tmp_path / "dst.bin")
    assert (tmp_path / "dst.bin").read_bytes() == src.read_bytes()
    assert store.size("run/file.bin") == 100_000
    assert store.exists("run/step-2/a.bin") and not store.exists("run/step-3/a.bin")

    assert store.list("run/") == [
        "run/file.bin",
        "run/step-1/a.bin",
        "run/step-1/sub/b.bin",
        "run/step-2/a.bin",
    ]
    assert store.list("run/step-") == ["run/step-1/a.bin", "run/step-1/sub/b.bin", "run/step-2/a.bin"]
    assert store.list("run") == sorted(store.list("run/") + ["run-other/x"])
    assert store.list("nothing/here/") == []

    store.put_bytes("run/step-2/a.bin", b"overwritten")
    assert store.get_bytes("run/step-2/a.bin") == b"overwritten"

    store.delete_prefix("run/step-1/")
    assert store.list("run/") == ["run/file.bin", "run/step-2/a.bin"]
    store.delete_prefix("run/step-")
    assert store.list("") == ["run-other/x", "run/file.bin"]


def test_missing_keys_raise_not_found(store, tmp_path):
    with pytest.raises(StoreKeyNotFoundError, match="not found"):
        store.get_bytes("run/nope")
    with pytest.raises(StoreKeyNotFoundError):
        store.get_file("run/nope", tmp_path / "x")
    with pytest.raises(StoreKeyNotFoundError):
        store.size("run/nope")
    store.delete_prefix("run/nope/")  # deleting nothing is fine


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a/./b", "a\\b"])
def test_bad_keys_are_rejected(store, key):
    with pytest.raises(ValueError):
        store.put_bytes(key, b"x")


def test_check_accepts_a_usable_store(store):
    store.check()


def test_local_write_is_atomic(tmp_path, monkeypatch):
    store = LocalStore(tmp_path)
    store.put_bytes("k", b"old")
    src = tmp_path / "big.bin"
    src.write_bytes(b"n" * 1000)

    def broken_copy(a, b):
        with open(b, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", broken_copy)
    with pytest.raises(CheckpointStoreError, match="No space left"):
        store.put_file("k", src)
    assert store.get_bytes("k") == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.bin", "k"]  # no temp file left behind


def test_local_list_hides_temp_files(tmp_path):
    store = LocalStore(tmp_path)
    store.put_bytes("run/a", b"1")
    (tmp_path / "run" / ".b.tmp-123-abcd").write_bytes(b"half")
    assert store.list("run/") == ["run/a"]


def test_s3_multipart_upload_and_download(s3_server, s3_faults, tmp_path):
    store = open_store(s3_server, s3_options=FAST)
    counts = s3_faults(store.client, lambda n, op: None)
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(11 * 1024 * 1024))
    store.put_file("run/big.bin", src)
    assert counts.get("UploadPart", 0) == 3 and counts.get("CompleteMultipartUpload") == 1
    store.get_file("run/big.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    data = os.urandom(6 * 1024 * 1024)
    store.put_bytes("run/big-bytes", data)
    assert counts["UploadPart"] == 5
    assert store.get_bytes("run/big-bytes") == data


def test_s3_transient_errors_are_retried(s3_server, s3_faults, tmp_path):
    store = open_store(s3_server, s3_options=FAST)
    # every third request of every operation answers 500: botocore's own retries absorb them
    counts = s3_faults(store.client, lambda n, op: 500 if n % 3 == 0 else None)
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(3000))
    for i in range(4):
        store.put_bytes(f"run/k{i}", f"v{i}".encode())
        store.put_file(f"run/f{i}", src)
    assert [store.get_bytes(f"run/k{i}") for i in range(4)] == [b"v0", b"v1", b"v2", b"v3"]
    assert len(store.list("run/")) == 8
    assert counts["PutObject"] >= 9  # 8 uploads + at least 2 injected failures retried


def test_s3_operation_backoff_outlasts_botocore_retries(s3_server, s3_faults, caplog):
    opts = S3Options(max_attempts=1, operation_attempts=4, backoff_s=0.01, max_backoff_s=0.02)
    store = open_store(s3_server, s3_options=opts)
    # botocore makes one attempt per request here; two consecutive failures need the outer backoff
    counts = s3_faults(store.client, lambda n, op: 503 if n <= 2 else None, operation="PutObject")
    with caplog.at_level(logging.DEBUG, logger="dflash.common.checkpoints.s3"):
        store.put_bytes("run/k", b"v")
    assert store.get_bytes("run/k") == b"v"
    assert counts["PutObject"] == 3
    # counted, and said at DEBUG only: the line on the outcome says the count (a failed save's)
    assert store.retries == 2
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 2 and "attempt 1/4" in retries[0].getMessage()
    assert all(r.levelno == logging.DEBUG for r in retries)

    # a permanent outage gives up after operation_attempts with one clear line
    s3_faults(store.client, lambda n, op: 503, operation="GetObject")
    with pytest.raises(CheckpointStoreError) as info:
        store.get_bytes("run/k")
    assert "SlowDown" in str(info.value) and "\n" not in str(info.value)


def test_s3_missing_bucket_is_a_clear_error(s3_env):
    store = open_store("s3://no-such-bucket-dflash/prefix", s3_options=FAST)
    for op in (
        store.check,
        lambda: store.get_bytes("x"),
        lambda: store.list("x/"),
        lambda: store.put_bytes("x", b""),
    ):
        with pytest.raises(CheckpointStoreError, match="bucket does not exist") as info:
            op()
        assert "s3://no-such-bucket-dflash" in str(info.value)
    with pytest.raises(CheckpointStoreError, match="bucket does not exist"):
        store.exists("x")


def test_s3_access_denied_is_a_clear_error(s3_server, s3_faults):
    store = open_store(s3_server, s3_options=FAST)
    s3_faults(store.client, lambda n, op: 403)
    with pytest.raises(CheckpointStoreError) as info:
        store.put_bytes("run/k", b"v")
    msg = str(info.value)
    assert "access denied (AccessDenied)" in msg and "AWS_PROFILE" in msg and "\n" not in msg
    assert not isinstance(info.value, StoreKeyNotFoundError)


def test_s3_unreachable_endpoint(s3_env, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    opts = S3Options(max_attempts=1, operation_attempts=2, backoff_s=0.01, connect_timeout_s=1)
    with pytest.raises(CheckpointStoreError, match=f"cannot reach the S3 endpoint http://127.0.0.1:{port}"):
        open_store("s3://some-bucket/p", s3_options=opts).get_bytes("k")


def test_s3_missing_credentials_or_profile(s3_env, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(CheckpointStoreError, match="no usable AWS credentials; set AWS_PROFILE"):
        open_store("s3://some-bucket/p", s3_options=FAST).get_bytes("k")
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(CheckpointStoreError, match=r"profile \(no-such-profile\) could not be found"):
        open_store("s3://some-bucket/p", s3_options=FAST)


def test_s3_errors_and_logs_never_show_credentials(s3_server, s3_faults, caplog):
    key_id, secret = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
    opts = S3Options(max_attempts=2, operation_attempts=2, backoff_s=0.01)
    store = open_store(s3_server, s3_options=opts)
    leaky = f"connect to http://{key_id}:{secret}@10.0.0.1:9000 failed; aws_secret_access_key={secret}"

    # a transient error whose message carries credentials: logged on retry, then raised
    s3_faults(store.client, lambda n, op: botocore.exceptions.EndpointConnectionError(endpoint_url=leaky))
    with caplog.at_level(logging.DEBUG, logger="dflash"), pytest.raises(CheckpointStoreError) as info:
        store.put_bytes("run/k", b"v")
    # and a non-botocore error with the same text
    store2 = open_store(s3_server, s3_options=opts)
    s3_faults(store2.client, lambda n, op: RuntimeError(leaky))
    with caplog.at_level(logging.DEBUG, logger="dflash"), pytest.raises(CheckpointStoreError) as info2:
        store2.get_bytes("run/k")
    texts = [str(info.value), str(info2.value)] + [r.getMessage() for r in caplog.records]
    assert any("retrying" in t for t in texts) and "RuntimeError" in str(info2.value)
    for text in texts:
        assert secret not in text and key_id not in text, text


def test_redact_patterns(monkeypatch):
    monkeypatch.setenv("AWS_SESSION_TOKEN", "FwoGZXIvYXdzEJr//////////session-token-value")
    text = (
        "AKIAIOSFODNN7EXAMPLE wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY "
        "http://admin:hunter22@minio:9000/x aws_secret_access_key=abc password: 'p4ss' "
        '"hf_token": "hf_abcdef" X-Amz-Signature=deadbeef tok FwoGZXIvYXdzEJr//////////session-token-value'
    )
    out = redact(text)
    for secret in (
        "AKIAIOSFODNN7EXAMPLE",
        "wJalrXUtnFEMI",
        "hunter22",
        "=abc",
        "p4ss",
        "hf_abcdef",
        "deadbeef",
    ):
        assert secret not in out, secret
    assert "session-token-value" not in out
    assert "http://***@minio:9000/x" in out
    # things that are not secrets survive
    keep = "mask_token: 5 max_tokens=64 sha256 " + "ab" * 32 + " git 0123456789abcdef0123456789abcdef01234567"
    assert redact(keep) == keep


def test_redact_config_blanks_secret_keys_only():
    cfg = {
        "tokenizer": "Qwen/Qwen3-8B",
        "mask_token": "<|mask|>",
        "mask_token_id": 151669,
        "s3": {"aws_secret_access_key": "abc", "endpoint": "http://u:p@host"},
        "wandb_api_key": "k",
        "layers": (1, 2),
        "lr": 6e-4,
        "flag": None,
    }
    out = redact_config(cfg)
    assert (
        out["tokenizer"] == "Qwen/Qwen3-8B"
        and out["mask_token"] == "<|mask|>"
        and out["mask_token_id"] == 151669
    )
    assert out["s3"] == {"aws_secret_access_key": "***", "endpoint": "http://***@host"}
    assert (
        out["wandb_api_key"] == "***"
        and out["layers"] == [1, 2]
        and out["lr"] == 6e-4
        and out["flag"] is None
    )


def test_s3_options_validation():
    with pytest.raises(ValueError, match="retry_mode"):
        S3Options(retry_mode="fast")
    with pytest.raises(ValueError, match="multipart"):
        S3Options(multipart_chunk_mb=1)
    with pytest.raises(ValueError, match="operation_attempts"):
        S3Options(operation_attempts=0)
