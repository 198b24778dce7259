"""How run.py talks to an engine: turns go in as they become due (``submit``) and answers come back as
they arrive (``next_results``), never a whole round at a time. Why: a row is written the moment its last
turn is in (a kill loses only the rows still being answered, not a round's finished ones), the next turn
of a row is asked as soon as its last answer is in (a slow answer holds only its own row), and the caller
keeps its clock while answers are out (the progress line every ``--progress-s``, however long a turn).

An engine has ``window`` (rows worked on at once), ``submit(items)``, ``next_results(timeout)`` and
``close()``. ``BatchEngine`` gives that to an engine that answers a list of requests per call (the local
engine's batched ``generate``): a thread calls ``complete`` on whatever is due, so the turns submitted while
a batch runs make the next batch. Standard library only (the tests' stand-in engines use it).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Hashable

from dflash.tools.regenerate.reply import Reply, Request

Item = tuple[Hashable, Request]
"""A turn to answer: the caller's key (its row) and the request."""
Result = tuple[Hashable, Reply]


class EngineError(ValueError):
    """The engine cannot start (a user error: a missing model, a GPU not there, no chat template)."""


class EngineDown(RuntimeError):
    """The engine cannot go on (an endpoint that stopped answering): the run stops with this one line,
    exit 1; the finished rows are kept and the same command continues."""


class _Raised:
    """An exception of the batch thread, carried to the caller (which raises it)."""

    def __init__(self, err: BaseException):
        self.err = err


class BatchEngine:
    """The submit / next_results side of an engine that answers a list of requests per ``complete`` call
    (module docstring). Subclasses set ``window`` and define ``complete``."""

    window: int = 1

    def complete(self, requests: list[Request]) -> list[Reply]:
        raise NotImplementedError

    def _start(self) -> None:
        if not hasattr(self, "_jobs"):
            self._jobs: queue.SimpleQueue = queue.SimpleQueue()
            self._results: queue.SimpleQueue = queue.SimpleQueue()
            # a daemon: a Ctrl-C ends the process without waiting for the batch being generated
            threading.Thread(target=self._batches, name="batches", daemon=True).start()

    def submit(self, items: list[Item]) -> None:
        self._start()
        self._jobs.put(items)

    def _batches(self) -> None:
        while True:
            items = list(self._jobs.get())
            while True:  # everything due by now goes into this batch
                try:
                    items += self._jobs.get_nowait()
                except queue.Empty:
                    break
            try:
                replies = self.complete([request for _, request in items])
            except BaseException as err:  # noqa: BLE001 - raised again in the caller's thread
                self._results.put(_Raised(err))
                return
            self._results.put([(key, reply) for (key, _), reply in zip(items, replies, strict=True)])

    def next_results(self, timeout: float) -> list[Result]:
        """The answers in by now, waiting up to ``timeout`` s for the first; [] if none came."""
        self._start()
        try:
            got = self._results.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return []
        if isinstance(got, _Raised):
            raise got.err
        return got

    def close(self) -> None:
        """Nothing to stop: the batch thread is a daemon, idle once nothing is due."""
