"""Shared pytest fixtures: a real S3 endpoint (moto's server) and small generic helpers.

Why a subprocess and not moto's in-process mock: the checkpoint code must be tested over real HTTP
(retries, multipart, error responses), and processes the tests spawn (consumers, producers) inherit
AWS_ENDPOINT_URL and reach the same server.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Fake credentials, shaped like real ones so that redaction tests exercise the real patterns.
FAKE_ACCESS_KEY_ID = "AKIAFAKE0TEST0KEY000"
FAKE_SECRET_ACCESS_KEY = "fAkE/sEcReT+Key0123456789abcdefGHIJKLMNO"


PIPELINE_FIXTURES = frozenset({"s3_endpoint", "demo_spool"})
"""Fixtures that start a child process (the moto server, a producer run): a test using one, directly or
through another fixture, is a pipeline test."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "pipeline: starts a child process (a CLI, a producer, a server), or runs a whole training or "
        "producing pass in-process (tens of seconds): left out of the unit tier (bash ops/test.sh --unit "
        "runs -m 'not pipeline'); set automatically for slow tests and users of the process fixtures, and "
        "a test that spawns without it fails",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks pipeline tests (see ``pytest_configure``), then orders the files (``file_order``), each file's
    tests in their own order: pytest-xdist hands whole files to its workers in this order (ops/test.sh),
    and starting the long ones first keeps one worker from running a long file alone at the end.

    A GPU test is a pipeline test too: on CUDA, inductor and Triton start compiler processes (compile
    workers, ptxas) whenever a test compiles, and a GPU test never belongs to the CPU unit tier (it skips
    there); the device runs them with ``-m gpu``."""
    for item in items:
        uses_process_fixture = PIPELINE_FIXTURES & set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("slow") or item.get_closest_marker("gpu") or uses_process_fixture:
            item.add_marker(pytest.mark.pipeline)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    position = {path: i for i, path in enumerate(file_order(items, workers))}
    items.sort(key=lambda item: position[item.path])  # stable: the order within a file is kept


LONGEST_FILES = (
    "test_chaos.py",
    "test_consumer_train.py",
    "test_demo.py",
    "test_bad_data.py",
    "test_faults.py",
    "test_epochs_pipeline.py",
    "test_precision.py",
    "test_producer_compile.py",
)
"""The test files of most worker time, longest first (seconds per test file of the last fresh-clone run,
docs/benchmarks.md): handed out first, so that no long file starts late and runs alone at the end."""


def file_order(items: list[pytest.Item], workers: int) -> list[Path]:
    """The order pytest-xdist hands whole files to its workers in (``--dist loadfile
    --no-loadscope-reorder``, ops/test.sh): the longest files, then the other files with slow tests, then
    the rest, each group in collection order.

    xdist gives a worker its next file as soon as two or fewer of its tests are pending, so a file of one
    or two tests among the first ``workers`` (chaos's one test) gets the next file of the queue behind it
    at once, to run after it: that file is a short one (no pipeline test), not the next long one, which
    would otherwise wait for the whole chaos run while another worker idles at the end."""
    tests: dict[Path, list[pytest.Item]] = {}
    for item in items:
        tests.setdefault(item.path, []).append(item)
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    longest = sorted(
        (p for p in tests if os.path.basename(p) in rank), key=lambda p: rank[os.path.basename(p)]
    )
    slow = [p for p in tests if p not in longest and any(i.get_closest_marker("slow") for i in tests[p])]
    short = [p for p in tests if not any(i.get_closest_marker("pipeline") for i in tests[p])]
    order = longest[:workers]
    for path in longest[:workers]:
        if len(tests[path]) <= 2 and short:
            order.append(short.pop(0))
    order += [p for p in longest[workers:] + slow + list(tests) if p not in order]
    return list(dict.fromkeys(order))


_FILE_SECONDS: dict[str, float] = {}
"""Seconds per test file: its tests' set-up, call and tear-down, summed as the reports arrive (under xdist,
on the controller, which receives every worker's reports)."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Where a run's time went, file by file (a file is xdist's unit of work, ops/test.sh): ``--durations``
    names single tests, this says which files make the run long, module fixtures included."""
    slow = sorted(((s, path) for path, s in _FILE_SECONDS.items() if s >= 5.0), reverse=True)
    if not slow or hasattr(config, "workerinput"):
        return
    terminalreporter.write_sep(
        "=",
        f"seconds per test file (>= 5 s; all {len(_FILE_SECONDS)} files: "
        f"{sum(_FILE_SECONDS.values()):.0f} s)",
    )
    for seconds, path in slow:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")


class ChildProcessStarted(BaseException):
    """Raised where a test without the ``pipeline`` mark starts a child process (a BaseException, so code
    under test that handles OSError or Exception cannot swallow it)."""


@contextlib.contextmanager
def _no_child_processes(item: pytest.Item) -> Iterator[list[str]]:
    """Within the block, every way this process starts another (subprocess and multiprocessing's spawn and
    forkserver go through ``_posixsubprocess.fork_exec``, subprocess through its own name for it; the fork context through ``os.fork``; posix_spawn)
    raises ``ChildProcessStarted`` and is recorded in the yielded list."""
    import _posixsubprocess

    started: list[str] = []
    patched = [
        (subprocess, "_fork_exec"),  # subprocess's own reference to _posixsubprocess.fork_exec
        (_posixsubprocess, "fork_exec"),
        (os, "fork"),
        (os, "posix_spawn"),
        (os, "posix_spawnp"),
    ]
    originals = [(mod, name, getattr(mod, name)) for mod, name in patched if hasattr(mod, name)]

    def refuse(what: str):
        def _refuse(*_args, **_kwargs):
            started.append(what)
            raise ChildProcessStarted(
                f"{item.nodeid} started a child process ({what}) without the pipeline mark: mark it "
                "@pytest.mark.pipeline (it then runs in the full suite, not the unit tier)"
            )

        return _refuse

    for mod, name, _orig in originals:
        setattr(mod, name, refuse(f"{mod.__name__}.{name}"))
    try:
        yield started
    finally:
        for mod, name, orig in originals:
            setattr(mod, name, orig)


def _guarded(item: pytest.Item):
    if item.get_closest_marker("pipeline"):
        return contextlib.nullcontext([])
    return _no_child_processes(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with _guarded(item) as started:
        yield
    if started:
        pytest.fail(
            f"{item.nodeid}: fixture set-up started a child process ({started[0]}) without the pipeline mark"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _guarded(item) as started:
        yield
    if started:
        pytest.fail(f"{item.nodeid} started a child process ({started[0]}) without the pipeline mark")


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, *, timeout_s: float = 10.0, poll_s: float = 0.05, what: str = "condition") -> None:
    """Poll ``predicate`` until it returns truthy; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")


def _parent_death_signal():
    """Linux: a pre-exec hook that has the server SIGTERMed if pytest dies without running finalizers.
    libc is loaded here, in the parent, so the forked child runs no imports."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    return lambda: libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _http_up(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
        return True
    except urllib.error.HTTPError:
        return True  # it answered
    except OSError:
        return False


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of a moto server subprocess shared by the session; always stopped."""
    log_path = tmp_path_factory.mktemp("moto") / "moto_server.log"
    proc = None
    try:
        for _attempt in range(3):  # the free port can be taken between probing and binding
            port = free_port()
            endpoint = f"http://127.0.0.1:{port}"
            with open(log_path, "ab") as log_file:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=_parent_death_signal(),
                )
            deadline = time.monotonic() + 30
            while proc.poll() is None and time.monotonic() < deadline and not _http_up(endpoint):
                time.sleep(0.05)
            if proc.poll() is None and _http_up(endpoint):
                break
            _stop(proc)
            proc = None
        if proc is None:
            pytest.fail(f"moto server did not start; log: {Path(log_path).read_text()[-2000:]}")
        yield endpoint
    finally:
        if proc is not None:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point the standard AWS environment at the moto server with fake credentials (child processes
    inherit it). Hides any real AWS config of the machine. Returns the endpoint url."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET_ACCESS_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return s3_endpoint


@pytest.fixture(scope="session")
def _s3_admin_client(s3_endpoint: str):
    """One client for test set-up (bucket creation), with the fake credentials passed explicitly."""
    import boto3

    return boto3.session.Session().client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id=FAKE_ACCESS_KEY_ID,
        aws_secret_access_key=FAKE_SECRET_ACCESS_KEY,
    )


@pytest.fixture
def s3_server(s3_env: str, _s3_admin_client) -> str:
    """A fresh bucket on the session's moto server: yields ``s3://<bucket>/<prefix>``. Each test gets its
    own bucket, so tests are isolated without restarting the server."""
    bucket = f"dflash-test-{uuid.uuid4().hex[:12]}"
    _s3_admin_client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/ckpt"


class _RawBody:
    """The minimal urllib3-like body botocore's AWSResponse reads."""

    def __init__(self, data: bytes):
        self._data = data

    def stream(self, *_args, **_kwargs):
        yield self._data


_S3_ERROR_CODES = {403: "AccessDenied", 404: "NoSuchKey", 500: "InternalError", 503: "SlowDown"}


def inject_s3_faults(client, decide, *, operation: str = "*"):
    """Make chosen requests of a boto3 S3 ``client`` fail, through botocore's ``before-send`` hook (so
    botocore's retry logic and boto3's transfer manager see a real failed HTTP exchange).

    ``decide(n, op)`` is called for the n-th (1-based, per operation name) request of ``op`` (e.g.
    "PutObject") and returns None to send it, an HTTP status (answered with an S3 error of that status),
    a ``(status, code)`` pair, or an exception instance to raise. Returns the per-operation counts dict.
    """
    import threading

    from botocore.awsrequest import AWSResponse

    lock = threading.Lock()
    counts: dict[str, int] = {}

    def hook(request, event_name: str = "", **_kwargs):
        op = event_name.rsplit(".", 1)[-1]
        with lock:
            counts[op] = n = counts.get(op, 0) + 1
        outcome = decide(n, op)
        if outcome is None:
            return None
        if isinstance(outcome, BaseException):
            raise outcome
        status, code = (
            outcome if isinstance(outcome, tuple) else (outcome, _S3_ERROR_CODES.get(outcome, "Error"))
        )
        body = (
            b""
            if request.method == "HEAD"
            else (
                f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                f"<Message>injected {code}</Message><RequestId>test</RequestId></Error>"
            ).encode()
        )
        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _RawBody(body))

    client.meta.events.register(f"before-send.s3.{operation}", hook)
    return counts


@pytest.fixture
def s3_faults():
    """The :func:`inject_s3_faults` helper, as a fixture so test modules need not import conftest."""
    return inject_s3_faults


# ------------------------------------------------------------------------------------ pipeline fixtures
def built_once_per_run(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]
) -> Path:
    """``build(path)`` once per test run, its result shared by every pytest-xdist worker: the first worker
    to ask builds it under an flock, the others wait for that build and reuse it. Why: a session fixture is
    per worker, so each worker used to build its own (the demo spool is a producer run of 20-80 s on the
    2-core box). A run without xdist builds it in its own temp folder; a build that failed half-way is
    redone by the next worker to ask (and fails there too, reported by that worker's tests)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.mktemp(name) / name
        build(path)
        return path
    root = tmp_path_factory.getbasetemp().parent / f"shared-{name}"  # this run's, shared by its workers
    root.mkdir(exist_ok=True)
    path, built = root / name, root / "built"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not built.exists():
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            built.touch()
    return path


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's tiny Qwen3 target saved once per test run (config, tokenizer, safetensors)."""
    from dflash.tools.demo.assets import materialize_tiny_target

    return built_once_per_run(tmp_path_factory, "tiny-target", materialize_tiny_target)


@pytest.fixture(scope="session")
def demo_spool(tmp_path_factory: pytest.TempPathFactory, tiny_target: Path) -> Path:
    """A finished spool of REAL shards: dflash-produce ran the tiny target over the bundled chat data.

    Built once per test run (one producer run, 20-80 s) and read by every worker: tests copy it
    (``copy_spool``) before consuming from it, and read its shards only."""
    from pipeline_helpers import produce_cmd, run

    from dflash.tools.demo.assets import demo_dataset_path

    def produce(spool: Path) -> None:
        proc = run(produce_cmd(spool, tiny_target, demo_dataset_path(), "--run", "fixture"), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    return built_once_per_run(tmp_path_factory, "demo-spool", produce)


@pytest.fixture
def copy_spool(tmp_path: Path):

    def _copy(src: Path) -> Path:
        dst = tmp_path / "spool"
        shutil.copytree(src, dst)
        return dst

    return _copy
