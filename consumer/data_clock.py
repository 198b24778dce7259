"""Where the data path's time goes, and why the training loop waited for its next step.

The consumer's inputs come through two background threads in a chain (consumer/feed.py,
consumer/input_pipeline.py):

- the **feed thread** claims a shard (``claim``), finds the spool empty and polls again (``spool_empty``:
  the producers are behind), decodes it (``decode``), or waits to hand it on (``handoff``: it is ahead);
- the **pipeline thread** waits for decoded shards (``wait_shards``), packs a stream (``pack``), builds its
  draft batch (``build``: anchors, blocks, labels), starts the copy to the device (``copy``), or waits to
  hand the step on (``handoff``).

Each thread keeps a ``StageClock``: the time it spent in each stage, readable from another thread at any
moment (the stage it is in counts up to now). The training loop snapshots both clocks when it starts and
stops waiting for an input (``DataPathClock.during``) and charges the wait to what the chain did meanwhile:
the pipeline thread's own stages directly, its time waiting for shards to the feed thread's stages over the
same window. So an interval's ``wait_ms_by_cause`` says, e.g., "56 ms/step waited: decode 40, pack 10,
copy 6": which stage to make faster (or spread over cores), measured where it happened, not guessed from
totals. A stage that was not running while the loop waited is not charged, however long it takes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

FEED_STAGES = ("claim", "spool_empty", "decode", "handoff")
PIPELINE_STAGES = ("wait_shards", "pack", "build", "copy", "handoff")
CAUSES = ("spool_empty", "claim", "decode", "pack", "build", "copy", "other")
"""What a wait is charged to: the producers being behind (``spool_empty``), a stage of the data path, or
``other`` (neither thread was in a stage that explains it, e.g. the step was handed over as the wait
ended)."""


class StageClock:
    """Seconds one thread spent in each named stage; ``snapshot()`` may be called from any thread."""

    def __init__(self, stages: tuple[str, ...]) -> None:
        self._totals = dict.fromkeys(stages, 0.0)
        self._current: str | None = None
        self._since = 0.0
        self._lock = threading.Lock()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time spent inside the block counts as ``name`` (stages do not nest: the outer one pauses)."""
        if name not in self._totals:
            raise KeyError(f"unknown stage {name!r}: one of {', '.join(self._totals)}")
        outer = self._switch(name)
        try:
            yield
        finally:
            self._switch(outer)

    def _switch(self, name: str | None) -> str | None:
        now = time.perf_counter()
        with self._lock:
            previous = self._current
            if previous is not None:
                self._totals[previous] += now - self._since
            self._current, self._since = name, now
        return previous

    def snapshot(self) -> dict[str, float]:
        """Each stage's seconds so far, the running one counted up to now."""
        now = time.perf_counter()
        with self._lock:
            out = dict(self._totals)
            if self._current is not None:
                out[self._current] += now - self._since
        return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


@dataclass
class DataPathClock:
    """The two threads' clocks, and the training loop's waits charged to their stages (module docstring)."""

    feed: StageClock = field(default_factory=lambda: StageClock(FEED_STAGES))
    pipeline: StageClock = field(default_factory=lambda: StageClock(PIPELINE_STAGES))

    def __post_init__(self) -> None:
        self._charged = dict.fromkeys(CAUSES, 0.0)
        self._busy_start = (self.feed.snapshot(), self.pipeline.snapshot())

    @contextmanager
    def during(self) -> Iterator[None]:
        """Wrap the training loop's wait for its next input: the wait is charged to what the chain did."""
        feed0, pipe0 = self.feed.snapshot(), self.pipeline.snapshot()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.charge(
                time.perf_counter() - t0,
                _delta(self.feed.snapshot(), feed0),
                _delta(self.pipeline.snapshot(), pipe0),
            )

    def charge(self, waited_s: float, feed: dict[str, float], pipeline: dict[str, float]) -> None:
        """Split ``waited_s`` over the causes in proportion to the stages' time in the same window: the
        pipeline thread's pack/build/copy directly, its ``wait_shards`` over the feed thread's claim,
        decode and empty-spool polls. Time either thread spent handing off (it was ahead) is no cause."""
        direct = {k: pipeline[k] for k in ("pack", "build", "copy")}
        upstream = {k: feed[k] for k in ("spool_empty", "claim", "decode")}
        total_direct = sum(direct.values()) + pipeline["wait_shards"]
        if waited_s <= 0:
            return
        if total_direct <= 0:
            self._charged["other"] += waited_s
            return
        for k, v in direct.items():
            self._charged[k] += waited_s * v / total_direct
        shards_share = waited_s * pipeline["wait_shards"] / total_direct
        total_up = sum(upstream.values())
        if total_up > 0:
            for k, v in upstream.items():
                self._charged[k] += shards_share * v / total_up
        else:
            self._charged["other"] += shards_share

    def interval(self, steps: int) -> dict:
        """Per step over the interval since the last call: the waits by cause (ms, causes that cost
        >= 0.05 ms), the dominant cause, and each thread's busy stages (ms), the data path's headroom."""
        n = max(1, steps)
        feed, pipe = self.feed.snapshot(), self.pipeline.snapshot()
        busy_feed = _delta(feed, self._busy_start[0])
        busy_pipe = _delta(pipe, self._busy_start[1])
        self._busy_start = (feed, pipe)
        by_cause = {k: round(1e3 * v / n, 1) for k, v in self._charged.items() if 1e3 * v / n >= 0.05}
        self._charged = dict.fromkeys(CAUSES, 0.0)
        out: dict = {
            "wait_ms_by_cause": by_cause,
            "feed_ms": {k: round(1e3 * busy_feed[k] / n, 1) for k in ("claim", "decode", "spool_empty")},
            "pipeline_ms": {
                k: round(1e3 * busy_pipe[k] / n, 1) for k in ("wait_shards", "pack", "build", "copy")
            },
        }
        if by_cause:
            out["wait_cause"] = max(by_cause, key=by_cause.__getitem__)
        return out


def describe_wait(rec: dict) -> str:
    """The console's words for an interval's wait: ``wait 56 ms/step (decode 40, pack 10, copy 6)``."""
    line = f"wait {rec['host_wait_ms']:.0f} ms/step"
    causes = sorted(rec.get("wait_ms_by_cause", {}).items(), key=lambda kv: -kv[1])
    shown = [f"{k} {v:.0f}" for k, v in causes if v >= 0.5]
    return f"{line} ({', '.join(shown)})" if shown else line
