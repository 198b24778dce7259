"""The console log line of the short-lived tools: ``HH:MM:SS <tool> LEVEL message`` on stderr.

Why one place: dflash-eval and dflash-export print the same line shape, and a format changed in one of
them only would make two tools read differently in one terminal.
"""

from __future__ import annotations

import logging


def log_to_console(tool: str, level: int = logging.INFO) -> None:
    """Log records of ``level`` and above to stderr as ``HH:MM:SS <tool> LEVEL message``."""
    logging.basicConfig(
        level=level, format=f"%(asctime)s {tool} %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
