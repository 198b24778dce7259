"""``dflash-regenerate``: every row's assistant turns written again by the target, turn by turn, with up
to the engine's ``window`` rows worked on at once (engine.py): each row's next turn is asked as soon as its
last answer is in, each row is written the moment its last turn is in (not when the turns of the other
rows are), and a new row takes a finished one's place, so an engine always has a window's worth of
independent requests to batch or keep in flight. The answers are waited for with the progress line's
clock: a line every ``--progress-s``, however long a turn takes.

Accounting: every input row ends in exactly one of the output (regenerated), the skipped file (a shape the
producer cannot read, a template that raises, or with ``--on-length drop`` a cut turn) or this run's
errors file (failed: the engine gave no answer; retried by a re-run), and the last line adds them up.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dflash.common.cli.exits import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, error_line, fail, print_error
from dflash.common.cli.logs import log_to_console
from dflash.common.metrics import format_duration, format_rate
from dflash.common.target.data import DataError
from dflash.tools.regenerate.config import PROG, SETTINGS, RegenerateConfig
from dflash.tools.regenerate.dialogue import Dialogue
from dflash.tools.regenerate.endpoint_engine import EndpointEngine
from dflash.tools.regenerate.engine import EngineDown, EngineError
from dflash.tools.regenerate.ledger import Ledger, LedgerError
from dflash.tools.regenerate.local_engine import LocalEngine
from dflash.tools.regenerate.reply import Reply, Request, assistant_message
from dflash.tools.regenerate.rows import SourceRow, output_row, read_rows

log = logging.getLogger(__name__)


@dataclass
class Tally:
    """What this run did, and the progress line it prints."""

    total: int
    before: int  # rows an earlier run settled (written or skipped)
    progress_s: float
    regenerated: int = 0
    failed: int = 0
    skipped: Counter = field(default_factory=Counter)
    cut_kept: int = 0  # rows kept with a turn cut at --max-new-tokens
    truncated: int = 0  # rows ended early, or on a call, where the source's tool results no longer fit
    tokens: int = 0
    start: float = field(default_factory=time.monotonic)
    last_line: float = field(default_factory=time.monotonic)

    def done(self) -> int:
        return self.regenerated + self.failed + sum(self.skipped.values())

    def until_line(self) -> float:
        """Seconds until the next progress line is due (the longest wait for an answer)."""
        return max(0.0, self.last_line + self.progress_s - time.monotonic())

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self.last_line < self.progress_s:
            return
        self.last_line = now
        elapsed = now - self.start
        rate = self.done() / elapsed if elapsed > 0 else 0.0
        left = self.total - self.before - self.done()
        eta = f", ETA {format_duration(left / rate)}" if rate > 0 else ""
        log.info(
            "%d/%d rows (this run: regenerated %d, failed %d, skipped %d), %.2f rows/s, %s tok/s%s",
            self.before + self.done(),
            self.total,
            self.regenerated,
            self.failed,
            sum(self.skipped.values()),
            rate,
            format_rate(self.tokens / elapsed if elapsed > 0 else 0.0),
            eta,
        )


def _to_ask(rows: Iterator[SourceRow], ledger: Ledger, tally: Tally) -> Iterator[SourceRow]:
    """The rows still to do; rows that cannot be asked are written as skipped here."""
    for row in rows:
        if ledger.settled(row.index):
            continue
        if row.messages is None:
            ledger.write_skip(row.index, row.reason)
            tally.skipped[row.reason] += 1
            continue
        yield row


class _Rows:
    """The rows being worked on (key: row index): each with its dialogue and its turn out at the engine."""

    def __init__(self, cfg: RegenerateConfig, ledger: Ledger, tally: Tally):
        self.cfg, self.ledger, self.tally = cfg, ledger, tally
        self.live: dict[int, tuple[SourceRow, Dialogue, Request]] = {}

    def start(self, row: SourceRow, due: list) -> None:
        self._next(row, Dialogue(row.messages or [], row.tools), due)

    def _next(self, row: SourceRow, dialogue: Dialogue, due: list) -> None:
        """Its next turn goes to ``due``; with every turn answered, the row is written now."""
        request = dialogue.next_request()
        if request is None:
            self.ledger.write_row(output_row(row, dialogue.out, dialogue.record()))
            self.tally.regenerated += 1
            self.tally.cut_kept += "length" in dialogue.finish
            self.tally.truncated += dialogue.truncated
            self.live.pop(row.index, None)
            return
        self.live[row.index] = (row, dialogue, request)
        due.append((row.index, request))

    def answered(self, index: int, reply: Reply, due: list) -> None:
        row, dialogue, request = self.live.pop(index)
        cfg, tally = self.cfg, self.tally
        tally.tokens += reply.tokens
        if reply.error is not None:
            self.ledger.write_error(index, reply.error, row.fields)
            tally.failed += 1
        elif reply.skip is not None or (reply.finish == "length" and cfg.on_length == "drop"):
            reason = reply.skip or f"a turn hit --max-new-tokens {cfg.max_new_tokens}"
            self.ledger.write_skip(index, reason)
            tally.skipped[reason] += 1
        else:
            message = reply.message or assistant_message(
                reply.text or "", opened_think=reply.opened_think, tools=bool(request.tools)
            )
            dialogue.accept(message, reply.finish, reply.tokens)
            self._next(row, dialogue, due)


def regenerate(
    cfg: RegenerateConfig, engine, rows: Iterator[SourceRow], ledger: Ledger, tally: Tally
) -> None:
    """Every row of ``rows`` written, skipped or failed (module docstring); ``engine`` as engine.py has
    it. Raises EngineDown when the engine cannot go on, KeyboardInterrupt on Ctrl-C: the rows written by
    then are whole lines of the output."""
    todo = _to_ask(rows, ledger, tally)
    work = _Rows(cfg, ledger, tally)
    more, due = True, []
    while True:
        while more and len(work.live) < engine.window:  # new rows take the finished ones' places
            row = next(todo, None)
            if row is None:
                more = False
            else:
                work.start(row, due)
        if due:  # one submit of all that is due: a batching engine batches it together
            engine.submit(due)
            due = []
        if not work.live:
            break
        for index, reply in engine.next_results(timeout=tally.until_line()):
            work.answered(index, reply, due)
        tally.maybe_log()


def accounting(tally: Tally, ledger: Ledger) -> str:
    """``regenerated N, failed N, skipped N = input N``: the rows of the input, each counted once."""
    written = sum(1 for i in ledger.written if i < tally.total)
    skipped = sum(1 for i in ledger.skipped if i < tally.total)
    line = f"regenerated {written}, failed {tally.failed}, skipped {skipped}"
    settled = written + tally.failed + skipped
    return (
        f"{line} = input {tally.total}" if settled == tally.total else f"{line} of input {tally.total} so far"
    )


def _details(tally: Tally, ledger: Ledger) -> str:
    parts = [
        f"this run: regenerated {tally.regenerated} rows, {tally.tokens} tokens in {format_duration(time.monotonic() - tally.start)}"
    ]
    if tally.cut_kept:
        parts.append(f"{tally.cut_kept} kept with a turn cut at --max-new-tokens")
    if tally.truncated:
        parts.append(
            f"{tally.truncated} ended early or on a tool call without its result (the target's tool calls "
            "left the source's tool results)"
        )
    if tally.skipped:
        parts.append("skipped: " + ", ".join(f"{why} {n}" for why, n in tally.skipped.most_common()))
    if tally.failed:
        parts.append(f"failed rows and why: {ledger.errors_path} (the same command retries them)")
    return "; ".join(parts)


def open_engine(cfg: RegenerateConfig):
    return LocalEngine(cfg) if cfg.model is not None else EndpointEngine(cfg)


def _open(cfg: RegenerateConfig) -> tuple[int, Iterator[SourceRow], Ledger]:
    """(rows in the input, the rows, the output's ledger). A dataset or an output that stops the start-up
    is bad input, whatever the error's type: a DataError or a LedgerError naming --dataset or --out, so one
    line and exit 2, never a traceback."""
    try:
        total, rows = read_rows(cfg.dataset, split=cfg.split, fmt=cfg.format, limit=cfg.limit)
    except DataError:
        raise
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read --dataset {cfg.dataset}: {error_line(err)}") from err
    try:
        ledger = Ledger(Path(cfg.out), cfg.settings(), SETTINGS)
    except LedgerError:
        raise
    except (OSError, ValueError) as err:  # a folder where the file goes, a read-only disk, ...
        raise LedgerError(f"cannot write --out {cfg.out}: {error_line(err)}") from err
    return total, rows, ledger


def run(cfg: RegenerateConfig) -> int:
    log_to_console(PROG)
    try:
        total, rows, ledger = _open(cfg)
    except (DataError, LedgerError) as err:
        fail(PROG, err)
    except KeyboardInterrupt:
        print("stopped while starting, before any row was asked; the same command starts again", flush=True)
        return EXIT_INTERRUPTED
    todo = total - sum(1 for i in (*ledger.written, *ledger.skipped) if i < total)
    tally = Tally(total=total, before=total - todo, progress_s=cfg.progress_s)
    try:
        if todo:
            log.info("%d of %d rows to regenerate into %s", todo, total, cfg.out)
            engine = open_engine(cfg)
            try:
                regenerate(cfg, engine, rows, ledger, tally)
            finally:
                engine.close()
    except EngineError as err:
        fail(PROG, err)
    except EngineDown as err:
        print_error(PROG, f"{err}; stopped: {accounting(tally, ledger)}; the same command continues")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"stopped: {accounting(tally, ledger)}; the same command continues", flush=True)
        return EXIT_INTERRUPTED
    except Exception as err:  # noqa: BLE001 - one line, the traceback with --log-level DEBUG
        log.debug("regeneration failed", exc_info=True)
        print_error(PROG, error_line(err))
        return EXIT_FAILURE
    finally:  # every written line is fsynced already: closing lets the lock go (a caller may run again)
        ledger.close()
    print(_details(tally, ledger), flush=True)
    print(accounting(tally, ledger), flush=True)
    return EXIT_FAILURE if tally.failed else EXIT_OK
