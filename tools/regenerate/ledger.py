"""The output of a long run and what makes it resumable: ``OUT`` (one finished row per line), beside it
``OUT.skipped.jsonl`` (rows decided never to write, and why), ``OUT.errors.jsonl`` (this run's failed rows
and why), ``OUT.settings.json`` (what made the answers) and ``OUT.lock``.

Why this shape: a row is written once it is finished, as one ``write`` of one whole line on a file opened
for appending, then fsynced, so a kill at any instant leaves whole lines and at most one torn last line;
opening the file cuts a torn line off. A re-run skips every row in ``OUT`` or the skipped file (so no row
is written twice, nor made twice) and asks again for the rest, which after a finished run are exactly the
failed rows. The lock keeps two runs from appending to one file.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from dflash.common.cli.exits import one_line
from dflash.tools.regenerate.rows import OUT_KEY

log = logging.getLogger(__name__)


class LedgerError(ValueError):
    """The output cannot be continued by this run (a user error: another run holds it, other settings)."""


def _repair(path: Path) -> None:
    """Cut a torn last line (a write cut by a kill) off ``path``."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        f.truncate(keep)
    log.warning("%s: cut a torn last line (%d bytes, a run killed while writing it)", path, len(data) - keep)


def _rows(path: Path) -> list[dict[str, Any]]:
    out = []
    if not path.exists():
        return out
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s:%d: not JSON, ignored (its row is made again)", path, no)
    return out


_TAIL = re.compile(rb'"' + OUT_KEY.encode() + rb'": \{"row": (\d+),')


def _written_rows(path: Path) -> set[int]:
    """The input rows in the output. Each line ends with its ``OUT_KEY`` record (rows.output_row writes it
    last), read from the line's tail: a re-run over millions of long rows does not parse them whole."""
    done: set[int] = set()
    if not path.exists():
        return done
    with open(path, "rb") as f:
        for no, line in enumerate(f, 1):
            found = _TAIL.search(line, max(0, len(line) - 4096))
            if found is None and line.strip():
                try:
                    found_row = json.loads(line)[OUT_KEY]["row"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    log.warning("%s:%d: not a row of this tool, ignored (its row is made again)", path, no)
                    continue
                done.add(int(found_row))
            elif found is not None:
                done.add(int(found.group(1)))
    return done


class _Appender:
    """One JSONL file appended one whole, fsynced line at a time."""

    def __init__(self, path: Path, *, truncate: bool = False):
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        self.path, self.fd = path, os.open(path, flags, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        written = os.write(self.fd, data)
        if written != len(data):  # a regular file takes it whole; a full disk does not
            raise OSError(f"{self.path}: short write ({written} of {len(data)} bytes)")
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


class Ledger:
    """The output files of one run (module docstring); ``done`` holds the rows an earlier run settled."""

    def __init__(self, out: Path, settings: dict[str, Any], compared: tuple[str, ...]):
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(f"{out}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise LedgerError(f"{out} is being written by another dflash-regenerate run") from None
        # whatever fails from here on (other settings, an unreadable file, Ctrl-C) closes what it opened: a
        # lock left held would refuse the next Ledger of this process as "another run"
        with ExitStack() as undo:
            undo.callback(os.close, self._lock)
            self._check_settings(out, settings, compared)
            self.skipped_path, self.errors_path = Path(f"{out}.skipped.jsonl"), Path(f"{out}.errors.jsonl")
            for path in (out, self.skipped_path):
                _repair(path)
            self.written = _written_rows(out)
            self.skipped = {r["row"]: r.get("reason", "?") for r in _rows(self.skipped_path) if "row" in r}
            self._rows = _Appender(out)
            undo.callback(self._rows.close)
            self._skips = _Appender(self.skipped_path)
            undo.callback(self._skips.close)
            self._errors = _Appender(self.errors_path, truncate=True)  # this run's failures only
            undo.pop_all()  # all open: close() closes them

    @staticmethod
    def _check_settings(out: Path, settings: dict[str, Any], compared: tuple[str, ...]) -> None:
        path = Path(f"{out}.settings.json")
        if path.exists():
            try:
                before = json.loads(path.read_text())
                if not isinstance(before, dict):
                    raise ValueError(f"a JSON {type(before).__name__}, not an object")
            except ValueError as err:  # not JSON (JSONDecodeError), not text (UnicodeDecodeError)
                raise LedgerError(
                    f"{path} is not JSON of the settings this tool writes ({one_line(err)}): give another "
                    f"--out, or remove it to continue {out} under this run's settings"
                ) from None
            differ = [k for k in compared if before.get(k) != settings.get(k)]
            if differ:
                was = ", ".join(f"{k}={before.get(k)!r}" for k in differ)
                now = ", ".join(f"{k}={settings.get(k)!r}" for k in differ)
                raise LedgerError(
                    f"{out} was made with {was}, not {now}: give another --out, "
                    "or the same settings to continue it"
                )
            return
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(settings, indent=1) + "\n")
        os.replace(tmp, path)

    def settled(self, index: int) -> bool:
        return index in self.written or index in self.skipped

    def write_row(self, row: dict[str, Any]) -> None:
        self._rows.write(row)
        self.written.add(row[OUT_KEY]["row"])

    def write_skip(self, index: int, reason: str) -> None:
        self._skips.write({"row": index, "reason": reason})
        self.skipped[index] = reason

    def write_error(self, index: int, reason: str, fields: dict[str, Any]) -> None:
        self._errors.write(
            {"row": index, "error": reason, **({"id": fields["id"]} if "id" in fields else {})}
        )

    def close(self) -> None:
        for appender in (self._rows, self._skips, self._errors):
            appender.close()
        os.close(self._lock)
