"""Test-only fault injection: a process SIGKILLs itself when it reaches a named start-up phase.

``DFLASH_FAULT=<who>@<phase>[,<who>@<phase>...]`` makes the process named ``who`` kill itself with
SIGKILL at ``fault_point(who, phase)``: the death of ``kill -9`` or the OOM killer, at a moment named by
what the process has done rather than by a sleep. Names: ``producer`` / ``producer.<launch>`` (the
dflash-produce parent), ``n<node>p<i>`` / ``n<node>p<i>.<launch>`` (a worker; its producer id), and
``consumer<rank>``. A name with ``.<launch>`` fires only in that launch of the run (a restart is another
launch). ``DFLASH_FAULT_ONCE=<path>`` makes the faults fire in their order, each once across processes and
launches (the k-th creates ``<path>.<k>`` and fires only after the ones before it). Unset, a fault point
is one dictionary lookup. The phases: docs/reliability.md, "Start-up kills".

Why in the product and not in the tests: a kill -9 timed from outside lands in a phase by chance (a
busy box moves every phase), so a test could not say which phase it checked.
"""

from __future__ import annotations

import os
import signal


def fault_point(who: str | tuple[str, ...], phase: str) -> None:
    """SIGKILL this process if ``DFLASH_FAULT`` names one of ``who`` at ``phase`` (module docstring)."""
    spec = os.environ.get("DFLASH_FAULT")
    if not spec:
        return
    names = (who,) if isinstance(who, str) else who
    once = os.environ.get("DFLASH_FAULT_ONCE")
    for k, fault in enumerate(spec.split(",")):
        name, _, at = fault.strip().partition("@")
        if at != phase or name not in names:
            continue
        if once:
            if not all(os.path.exists(f"{once}.{j}") for j in range(k)):
                return  # an earlier fault has not fired yet
            try:
                os.close(os.open(f"{once}.{k}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue  # fired already
        os.kill(os.getpid(), signal.SIGKILL)
