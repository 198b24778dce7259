"""Metrics as append-only JSONL: one writer per process, a tolerant reader, and human-unit formatting.

Every process of a run appends one JSON object per log interval to ``<run_dir>/metrics/<proc>.jsonl``
(``consumer-<rank>``, ``producer-<id>``). JSONL because it is append-only (a crash loses at most the line
being written), greppable, and readable by ``dflash-status``/``dflash-plan``/plots while the run is live.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)


def _jsonable(obj: Any) -> Any:
    """json.dumps fallback: numpy/torch scalars and arrays, paths. Keeps torch an optional import here."""
    if hasattr(obj, "tolist"):  # torch.Tensor, numpy arrays and numpy scalars
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"metrics value of type {type(obj).__name__} is not JSON-serializable")


class MetricsLog:
    """Append-only JSONL writer, one line per record, flushed on every line.

    The file is opened line-buffered and each record is written with a single ``write`` of the whole
    line, so a process crash loses at most the line it was writing; the OS page cache keeps everything
    already written even if the process dies (no fsync: we guard against process crashes, not power
    loss). When reopening a file whose last line was cut by a crash, a newline is written first so the
    torn fragment and the next record do not merge into one unparsable line.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torn = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, 2)
                torn = f.read(1) != b"\n"
        self._f: TextIO | None = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        if torn:
            self._f.write("\n")

    def write(self, record: Mapping[str, Any] | None = None, /, **fields: Any) -> dict[str, Any]:
        """Append ``record`` merged with ``fields``; adds ``time`` (unix seconds) when absent. Returns it."""
        if self._f is None:
            raise ValueError(f"MetricsLog {self.path} is closed")
        rec: dict[str, Any] = {**(record or {}), **fields}
        rec.setdefault("time", time.time())
        self._f.write(json.dumps(rec, default=_jsonable) + "\n")
        self._f.flush()
        return rec

    def event(self, name: str, **fields: Any) -> dict[str, Any]:
        """Append an event line, e.g. ``event("checkpoint", step=1000, url=...)`` -> {"event": "checkpoint", ...}."""
        return self.write({"event": name}, **fields)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_file(path: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad += 1  # a line torn by a crash (last line, or merged with the first line after resume)
                continue
            if isinstance(rec, dict):
                records.append(rec)
            else:
                bad += 1
    if bad:
        log.debug("%s: skipped %d unparsable line(s)", path, bad)
    return records


def read_metrics(path_or_dir: str | Path) -> list[dict[str, Any]]:
    """Records of one JSONL file, or of every ``*.jsonl`` in a directory (name order).

    Unparsable lines (a truncated last line, a torn line merged with the next after a restart) are
    skipped. From a directory each record gets ``"_file"``: the file's stem (``consumer-0``).
    Raises FileNotFoundError when the path does not exist.
    """
    p = Path(path_or_dir)
    if p.is_dir():
        out: list[dict[str, Any]] = []
        for stem, recs in read_run_metrics(p).items():
            out.extend({**r, "_file": stem} for r in recs)
        return out
    if not p.exists():
        raise FileNotFoundError(f"no metrics file or directory at {p}")
    return _read_file(p)


def read_run_metrics(metrics_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """``{stem: records}`` for every ``*.jsonl`` in ``metrics_dir``; {} when the directory does not exist
    (a run that has not logged yet)."""
    d = Path(metrics_dir)
    if not d.is_dir():
        return {}
    return {f.stem: _read_file(f) for f in sorted(d.glob("*.jsonl")) if f.is_file()}


# ---- human units -----------------------------------------------------------------------------------


def is_number(x: Any) -> bool:
    """A real int or float of a metrics record (a JSON bool is not a count)."""
    return isinstance(x, int | float) and not isinstance(x, bool)


def _finite(x: Any) -> bool:
    return is_number(x) and math.isfinite(x)


def format_rate(x: float | None) -> str:
    """41234.5 -> '41.2K', 1.3e6 -> '1.3M', 950 -> '950'."""
    if not _finite(x):
        return "?"
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def format_bytes(n: float | None) -> str:
    """Decimal units (what `df -H` shows): 3.1e9 -> '3.1 GB', 512 -> '512 B'."""
    if not _finite(n):
        return "?"
    for div, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def format_duration(s: float | None) -> str:
    """45 -> '45s', 840 -> '14m', 4320 -> '1h12m', 93600 -> '1d02h'."""
    if not _finite(s) or s < 0:
        return "?"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def average_tok_s(rec: Mapping[str, Any]) -> float | None:
    """A producer's tokens/s averaged since it started: ``avg_tok_s``, else ``tokens / elapsed_s``.

    Why not ``tok_s``: that is the rate since the previous heartbeat, which swings with every spool-budget
    wait and shard write; a person (and a plot) wants the rate the producer actually sustains. None when
    the record carries neither (never the instantaneous figure in its place).
    """
    avg = rec.get("avg_tok_s")
    if _finite(avg):
        return float(avg)
    tokens, elapsed = rec.get("tokens"), rec.get("elapsed_s")
    if _finite(tokens) and _finite(elapsed) and elapsed > 0:
        return tokens / elapsed
    return None


def mean_acc(acc: Any) -> float | None:
    """``acc`` is logged per block position (a list); the console shows the mean."""
    if isinstance(acc, list | tuple):
        vals = [a for a in acc if _finite(a)]
        return sum(vals) / len(vals) if vals else None
    return acc if _finite(acc) else None


def _num(x: Any, spec: str) -> str:
    if isinstance(x, int | float) and not isinstance(x, bool):
        return format(x, spec)  # nan/inf print as such: a NaN loss must be visible
    return "?"


def format_console_line(rec: Mapping[str, Any], *, elapsed_s: float, eta_s: float | None = None) -> str:
    """The consumer's console line for one metrics record, e.g.

    ``[14m] step=1200/9000 epoch=2/6 loss=2.31 acc=0.61 τ=3.42 lr=5.8e-04 | prod=41.2K tok/s cons=38.9K tok/s |
    spool=12 shards/3.1 GB | ETA 1h12m``

    Fields absent from ``rec`` are left out. ``tok_s`` is the consumer rate; ``prod_tok_s`` (optional)
    is the producers' total rate as the consumer sees it (e.g. summed from spool heartbeats).
    """
    parts = [f"[{format_duration(elapsed_s)}]"]
    if "step" in rec:
        parts.append(f"step={rec['step']}" + (f"/{rec['total_steps']}" if rec.get("total_steps") else ""))
    if rec.get("epoch") is not None and rec.get("epochs") is not None:
        parts.append(f"epoch={rec['epoch']}/{rec['epochs']}")
    if "loss" in rec:
        parts.append(f"loss={_num(rec['loss'], '.3g')}")
    if "acc" in rec:
        parts.append(f"acc={_num(mean_acc(rec['acc']), '.2f')}")
    if "tau" in rec:
        parts.append(f"τ={_num(rec['tau'], '.2f')}")
    if "lr" in rec:
        parts.append(f"lr={_num(rec['lr'], '.1e')}")
    line = " ".join(parts)
    rates = []
    if rec.get("prod_tok_s") is not None:
        rates.append(f"prod={format_rate(rec['prod_tok_s'])} tok/s")
    if rec.get("tok_s") is not None:
        rates.append(f"cons={format_rate(rec['tok_s'])} tok/s")
    if rec.get("fill") is not None:
        rates.append(f"fill={100 * float(rec['fill']):.1f}%")
    if rates:
        line += " | " + " ".join(rates)
    if rec.get("spool_shards") is not None or rec.get("spool_bytes") is not None:
        shards = rec.get("spool_shards")
        spool = f"spool={shards if shards is not None else '?'} shards"
        if rec.get("spool_bytes") is not None:
            spool += f"/{format_bytes(rec['spool_bytes'])}"
        line += " | " + spool
    if eta_s is not None:
        line += f" | ETA {format_duration(eta_s)}"
    return line
