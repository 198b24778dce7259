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

    def __init__(self, *marks: str, fixtures: tuple[str, ...] = (), path: str = "tests/test_x.py"):
        self.marks, self.fixturenames, self.path = set(marks), fixtures, path

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


def test_the_longest_files_go_first_and_a_one_test_file_gets_a_short_one_queued_behind_it():
    """xdist (loadfile) hands files out in this order and queues a worker's next file once two or fewer of
    its tests are pending: chaos's one test gets a short file (no pipeline test) behind it, not the next
    long one; the long files keep their order, then the other slow files, then the rest."""
    from conftest import file_order

    def tests(name: str, n: int, *marks: str) -> list[_Collected]:
        return [_Collected(*marks, path=f"tests/{name}") for _ in range(n)]

    items = [
        *tests("test_a_unit.py", 3),
        *tests("test_b_slow.py", 2, "slow", "pipeline"),
        *tests("test_chaos.py", 1, "slow", "pipeline"),
        *tests("test_consumer_train.py", 6, "pipeline"),
        *tests("test_demo.py", 2, "slow", "pipeline"),
        *tests("test_faults.py", 8, "slow", "pipeline"),
        *tests("test_y_unit.py", 4),
        *tests("test_z_pipeline.py", 3, "pipeline"),
    ]
    assert file_order(items, workers=3) == [
        "tests/test_chaos.py",
        "tests/test_consumer_train.py",
        "tests/test_demo.py",
        "tests/test_a_unit.py",  # behind chaos (its one test)
        "tests/test_y_unit.py",  # behind the demo (two tests)
        "tests/test_faults.py",
        "tests/test_b_slow.py",
        "tests/test_z_pipeline.py",
    ]
    assert file_order(items, workers=1)[:3] == [
        "tests/test_chaos.py",
        "tests/test_a_unit.py",
        "tests/test_consumer_train.py",
    ]
