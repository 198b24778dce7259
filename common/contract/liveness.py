"""Is a process of the spool still alive? Locks held by live launches, and heartbeats judged by pid, the
process's start time and the machine's boot id (a recycled pid or a reboot never looks alive), or by age.

Why more than a pid: a consumer that dies leaves claims that others must take back (at-least-once
delivery), but taking them from a live consumer would train its samples twice."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger(__name__)


class SpoolLock:
    """An exclusive ``flock`` on ``<spool>/lock-<name>``, held for the life of this process (or until
    ``release``). The kernel drops it when the process dies, however it dies: a dead launch never leaves a
    stale lock behind. The file holds one line naming the holder, for the refusal message."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def lock_holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "an unknown process"
    except OSError:
        return "an unknown process"


def lock_is_held(path: Path) -> bool:
    """Whether a live process holds the flock on ``path`` (probed with a non-blocking shared lock)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) from /proc, None if the pid does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def _read_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


HOST = socket.gethostname()


BOOT_ID = _read_boot_id()


def _pid_alive(pid: int, start_ticks: int | None) -> bool:
    if os.path.isdir("/proc"):
        try:
            st = proc_stat(pid)
        except PermissionError:  # /proc mounted with hidepid: cannot tell, trust the heartbeat age
            return True
        if st is None or st[0] in ("Z", "X"):  # gone, or a zombie nobody reaped yet
            return False
        return start_ticks is None or st[1] == start_ticks
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def heartbeat_alive(hb: dict, *, timeout_s: float, now: float | None = None) -> bool:
    """Dead if its pid is gone (or reused) on this host, or the heartbeat is older than ``timeout_s``."""
    now = time.time() if now is None else now
    if now - float(hb.get("time", 0.0)) > timeout_s:
        return False
    if hb.get("host") == HOST and hb.get("boot_id", BOOT_ID) == BOOT_ID and "pid" in hb:
        return _pid_alive(int(hb["pid"]), hb.get("start_ticks"))
    if hb.get("host") == HOST and hb.get("boot_id") != BOOT_ID:
        return False  # written before this machine rebooted
    return True
