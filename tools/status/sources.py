"""Where ``dflash-status`` reads a run from: the run dir's run.json, pids and logs, the spool's states and
heartbeats, and whether a process is still alive (on this host: by pid; elsewhere: by heartbeat age)."""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from dflash.common.contract.liveness import HOST, heartbeat_alive
from dflash.common.contract.spool import Spool, SpoolError
from dflash.common.contract.spool_scan import SpoolScan

log = logging.getLogger(__name__)
STATES = SpoolScan.STATES  # ("tmp", "ready", "claimed", "quarantine")


class StatusError(ValueError):
    """A user error (bad run dir, unreadable run.json): printed as one line, exit status 2."""


def spool_snapshot(root: str | Path, *, heartbeat_timeout_s: float = 120.0) -> dict[str, Any]:
    """``Spool.stats()`` reshaped for this screen, without creating anything (``create=False``).

    ``{"root", "exists", "error", "states": {state: {"shards", "bytes"}}, "buckets": {bucket: {state:
    shards}}, "claimed_by": {consumer_id: shards}, "producers_registered", "producers_done",
    "producers_dead": {id: how its parent saw it die}, "processes":
    [heartbeat rows of Spool.stats()]}``; ``exists`` False (and ``error`` set) for a missing or foreign dir.
    """
    out: dict[str, Any] = {
        "root": str(root),
        "exists": False,
        "error": None,
        "states": {s: {"shards": 0, "bytes": 0} for s in STATES},
        "buckets": {},
        "claimed_by": {},
        "producers_registered": [],
        "producers_done": [],
        "producers_dead": {},
        "processes": [],
    }
    try:
        sp = Spool(root, create=False)
        st = sp.stats(heartbeat_timeout_s=heartbeat_timeout_s)
        pid_alive = {(str(hb["role"]), str(hb["id"])): _heartbeat_pid_alive(hb) for hb in sp.heartbeats()}
    except (SpoolError, OSError) as e:  # missing, not a spool, or removed mid-scan (run cleaned up)
        out["error"] = str(e)
        return out
    out["exists"] = True
    for state in STATES:
        row = st["states"].get(state, {"shards": 0, "bytes": 0, "buckets": {}})
        out["states"][state] = {"shards": row["shards"], "bytes": row["bytes"]}
        for bucket, b in row["buckets"].items():
            if bucket != "other" and b["shards"]:
                counts = out["buckets"].setdefault(str(bucket), {})
                counts[state] = b["shards"]
    out["buckets"] = dict(sorted(out["buckets"].items(), key=lambda kv: int(kv[0])))
    out["claimed_by"] = {c: v["shards"] for c, v in sorted(st["claimed_by"].items())}
    out["producers_registered"] = [str(p) for p in st["producers"]["registered"]]
    out["producers_done"] = sorted(str(p) for p in st["producers"]["done"])
    out["producers_dead"] = {str(p): how for p, how in st["producers"].get("dead", {}).items()}
    for hb in st["processes"]:
        key = (str(hb["role"]), str(hb["id"]))
        out["processes"].append({**hb, "time": st["time"] - hb["age_s"], "pid_alive": pid_alive.get(key)})
    # samples lost to quarantine in this launch, as the consumers counted them (corrupt shards)
    for k in ("samples_quarantined", "shards_quarantined"):
        out[k] = sum(
            int(hb.get("counters", {}).get(k) or 0) for hb in st["processes"] if hb.get("role") == "consumer"
        )
    return out


def _heartbeat_pid_alive(hb: dict[str, Any]) -> bool | None:
    """Whether the heartbeat's process still runs, whatever the heartbeat's age: True/False on this host
    (pid and start time, as the spool checks them), None for another host's process (cannot tell)."""
    if hb.get("host") != HOST or "pid" not in hb:
        return None
    return heartbeat_alive(hb, timeout_s=float("inf"))


def read_run_json(run_dir: Path) -> dict[str, Any]:
    f = run_dir / "run.json"
    if not f.exists():
        return {}
    try:
        data = json.loads(f.read_text())
    except ValueError as e:
        raise StatusError(f"{f} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise StatusError(f"{f} must hold a JSON object")
    return data


def find_spool_dir(run_dir: Path, override: str | Path | None = None) -> Path | None:
    """``--spool`` wins; else ``run.json["spool"]`` (a relative path is taken relative to the run dir);
    else None (status then shows metrics only)."""
    if override is not None:
        return Path(override)
    spool = read_run_json(run_dir).get("spool")
    return run_dir / spool if spool else None


def read_pids(run_dir: Path) -> dict[str, int]:
    """``RUN_DIR/pids``: one ``<name> <pid>`` per line (order of the two tokens does not matter)."""
    out: dict[str, int] = {}
    try:
        lines = (run_dir / "pids").read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        toks = line.replace("=", " ").replace(":", " ").split()
        nums = [t for t in toks if t.isdigit()]
        names = [t for t in toks if not t.isdigit()]
        if nums:
            out[names[0] if names else f"pid-{nums[0]}"] = int(nums[0])
    return out


def pid_alive(pid: int | None, host: str | None) -> bool | None:
    """True/False for a pid on this host; None when unknown (no pid, or another host's process)."""
    if not pid or (host and host != socket.gethostname()):
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
