"""The exit-code convention of every dflash command (README, "Errors and exit codes"), in one place.

0 done; 2 a user or input error (one line ``<prog>: error: ...``, no traceback); 1 a runtime failure (one
line naming what failed; ``--log-level DEBUG`` adds the traceback); 130 interrupted (Ctrl-C / SIGTERM).
Messages go through :func:`redact`, so no credential ever reaches a terminal or a log file.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from dflash.common.redact import redact

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def one_line(message: object) -> str:
    """The first non-empty line of ``message`` (an exception or text), whitespace collapsed, redacted;
    an exception without text gives its type name."""
    text = str(message).strip()
    first = text.splitlines()[0] if text else ""
    if not first and isinstance(message, BaseException):
        first = type(message).__name__
    return " ".join(redact(first).split())


def error_line(err: BaseException) -> str:
    """``<ExceptionType>: <one line>``: a runtime failure as a user reads it (the type says what broke)."""
    text = one_line(err) if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def print_error(prog: str, message: object) -> None:
    """Print ``<prog>: error: <one line>`` on stderr (for a ``main`` that returns its exit status)."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr, flush=True)


def fail(prog: str, message: object, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``<prog>: error: <one line>`` on stderr and exit with ``code``."""
    print_error(prog, message)
    sys.exit(code)
