"""What a spawned child process of ours does first: die with its parent, and keep the libraries' locks
out of /dev/shm.

Both exist because a launch can end with SIGKILL of its whole process group (a terminal closed, a job
scheduler's kill, ``run_all.sh`` stopping a pipeline): nothing in the child may outlive the parent, and
nothing may be left behind in RAM-backed /dev/shm.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when ``parent_pid`` (its parent) dies, however it dies (Linux).

    Why: a child that outlives a parent killed with SIGKILL keeps working on a launch that is over (a
    producer worker would keep publishing shards and write its DONE marker, possibly into the fresh spool
    of the pipeline's next life). SIGKILL, not SIGTERM: an orphan must not finish even the write it is in.
    """
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def anonymous_library_locks() -> None:
    """Make the ``multiprocessing.Lock()``/``RLock()`` that libraries create for themselves anonymous.

    A spawned child inherits "spawn" as its default start method, and a spawn-context lock is a *named*
    POSIX semaphore: a file in /dev/shm that only the resource tracker removes, at a clean exit. tqdm's
    write lock (datasets' progress bars) and numcodecs' blosc lock are made that way, so each process-group
    SIGKILL leaked them (found by tests/test_producer_cli.py's semaphore spy). A fork-context lock is
    unlinked at creation. Only the default context changes: our own processes name their context
    explicitly (``multiprocessing.get_context("spawn")``), and no library in a child starts processes.
    """
    multiprocessing.set_start_method("fork", force=True)
