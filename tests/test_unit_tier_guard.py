"""The unit tier's guard (conftest): a test without the pipeline mark cannot start a child process, by any
of the ways this code base starts one, so ``bash ops/test.sh --unit`` stays free of process start-up."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest
from conftest import ChildProcessStarted, _no_child_processes, pytest_collection_modifyitems


class _Item:
    nodeid = "tests/test_x.py::test_y"


class _Collected:
    """What the collection hook reads of a pytest item: its marks, fixtures and file."""

    def __init__(self, *marks: str, fixtures: tuple[str, ...] = ()):
        self.marks, self.fixturenames, self.path = set(marks), fixtures, "tests/test_x.py"

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None

    def add_marker(self, mark) -> None:
        self.marks.add(mark.name)


def test_subprocess_is_refused_and_named():
    with _no_child_processes(_Item()) as started:
        with pytest.raises(ChildProcessStarted, match="test_x.py::test_y.*pipeline mark"):
            subprocess.run([sys.executable, "-c", "pass"], check=False)
    assert started == ["subprocess._fork_exec"]


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_multiprocessing_is_refused(method):
    with _no_child_processes(_Item()) as started:
        with pytest.raises(ChildProcessStarted):
            multiprocessing.get_context(method).Process(target=print).start()
    assert started


def test_an_exception_handler_in_the_code_under_test_cannot_hide_it():
    with _no_child_processes(_Item()) as started:
        try:
            subprocess.run(["true"], check=False)
        except Exception:  # what code under test might do with an OSError
            pass
        except ChildProcessStarted:
            pass
    assert started  # the hook fails the test from this record even when the exception was swallowed


def test_everything_is_restored_after_the_block():
    before = (subprocess._fork_exec, os.fork, os.posix_spawn)
    with _no_child_processes(_Item()):
        assert subprocess._fork_exec is not before[0]
    assert (subprocess._fork_exec, os.fork, os.posix_spawn) == before


def test_gpu_slow_and_process_fixture_tests_are_pipeline_tests_and_unit_tests_are_not():
    """A GPU test compiles on CUDA, where inductor and Triton start compiler processes: it is a pipeline
    test (unguarded; the device runs ``-m gpu``), never part of the unit tier."""
    gpu, slow, served, unit = (
        _Collected("gpu"),
        _Collected("slow"),
        _Collected(fixtures=("s3_endpoint",)),
        _Collected(),
    )
    pytest_collection_modifyitems(None, [gpu, slow, served, unit])
    assert {"pipeline"} <= gpu.marks and {"pipeline"} <= slow.marks and {"pipeline"} <= served.marks
    assert "pipeline" not in unit.marks


@pytest.mark.pipeline
def test_a_pipeline_test_may_start_processes():
    assert subprocess.run([sys.executable, "-c", "pass"], check=False).returncode == 0
