"""The file moves of the spool protocol, as functions of the folders they move between.

Why apart from :class:`~dflash.common.contract.spool.Spool`: each state change of a shard is one rename
(ready -> claimed/<owner>, claimed -> acked, claimed -> ready, any -> quarantine), and these functions are
that rename and what a crash halfway through leaves behind, nothing else; the Spool decides when to call
them. The order consumers claim in is here too: a pure function of the ready names.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from pathlib import Path

from dflash.common.contract.names import is_shard_name, parse_shard_name, shard_epoch, shard_sort_key
from dflash.common.contract.spool_records import RUN_FILE, atomic_write_text

log = logging.getLogger(__name__)

ACK_PREFIX = ".ack-"  # an ack's trash beside its claim (spools of earlier versions): finished on recovery
ACKED_SEP = "~"  # acked/<owner>~<shard name>~<uuid>: "~" is in no consumer id or shard name


def looks_like_spool(root: Path) -> bool:
    """The flow's folders exist under ``root`` (a spool some launch made), before opening it read-only."""
    return all((root / d).is_dir() for d in ("tmp", "ready", "claimed", "quarantine", "state"))


def remove(path: Path) -> None:
    """Delete a shard folder (or a file) and everything in it; gone already is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def check_bucket(bucket: int | None | str) -> None:
    """ValueError unless ``bucket`` is a claim's bucket choice: None, an int >= 0, "fullest" or "random"."""
    if not (
        bucket is None
        or bucket in ("fullest", "random")
        or (isinstance(bucket, int) and not isinstance(bucket, bool) and bucket >= 0)
    ):
        raise ValueError(f"bucket must be None, an int >= 0, 'fullest' or 'random', got {bucket!r}")


def claim_order(names: list[str], bucket: int | None | str) -> list[str]:
    """The ready shard ``names`` a consumer may claim, in the order it tries them: only the lowest epoch
    ready (epochs are trained in order, docs/training.md "A campaign"); ``bucket`` None: lowest name first,
    an int: that bucket only, "fullest": the bucket with the most ready shards first, "random": shuffled."""
    names = sorted(names, key=shard_sort_key)
    if bucket is not None and not isinstance(bucket, str):
        names = [n for n in names if parse_shard_name(n)[0] == bucket]
    if names:
        lowest = shard_epoch(names[0])
        names = [n for n in names if shard_epoch(n) == lowest]
    if bucket == "fullest":
        counts: dict[int, int] = {}
        for n in names:
            counts[parse_shard_name(n)[0]] = counts.get(parse_shard_name(n)[0], 0) + 1
        order = {b: i for i, b in enumerate(sorted(counts, key=lambda b: (-counts[b], b)))}
        names.sort(key=lambda n: (order[parse_shard_name(n)[0]], shard_sort_key(n)))
    elif bucket == "random":
        random.shuffle(names)
    return names


def quarantine_into(quarantine_dir: Path, path: Path, why: str, *, say: bool = True) -> Path:
    """Move a shard that cannot be decoded out of the flow; <name>.why says why (one line, with a
    timestamp). Returns the new path (the old one, with a warning, if the shard vanished meanwhile).
    ``say=False``: the caller logs the one line itself (with what it knows: the samples lost)."""
    path = Path(path)
    dest = quarantine_dir / path.name
    if dest.exists():
        dest = quarantine_dir / f"{time.time_ns()}-{path.name}"
    reason = " ".join(str(why).split())
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    # The .why first: a crash in between leaves the shard where it was (recovered, retried), never an
    # unexplained shard in quarantine/.
    why_path = dest.with_name(dest.name + ".why")
    atomic_write_text(why_path, f"{stamp} {reason}\n")
    try:
        os.rename(path, dest)
    except FileNotFoundError:
        why_path.unlink(missing_ok=True)
        log.warning("quarantine: %s is gone (recovered as dead and re-delivered?)", path)
        return path
    if say:
        log.warning("quarantined %s: %s", path.name, reason)
    return dest


def finish_acks_of(acked_dir: Path, owner: str) -> None:
    """Delete what a dead consumer left half-deleted in acked/ (a crash mid-ack: already trained)."""
    try:
        names = os.listdir(acked_dir)
    except FileNotFoundError:
        return
    for name in names:
        if name.split(ACKED_SEP, 1)[0] == owner:
            remove(acked_dir / name)


def return_to_ready(owner_dir: Path, ready_dir: Path, *, remove_dir: bool) -> int:
    """Move every shard claimed in ``owner_dir`` back to ready/ (an interrupted ack is finished instead);
    returns how many moved. ``remove_dir``: the owner's folder goes too once empty."""
    n = 0
    try:
        entries = os.listdir(owner_dir)
    except FileNotFoundError:
        return 0
    for name in entries:
        if name.startswith(ACK_PREFIX):
            remove(owner_dir / name)  # an ack interrupted mid-delete: finish it
        elif is_shard_name(name):
            try:
                os.rename(owner_dir / name, ready_dir / name)
                n += 1
            except FileNotFoundError:
                pass  # another consumer recovered it first
    if remove_dir:
        try:
            owner_dir.rmdir()
        except OSError:
            pass  # not empty (the owner came back) or already removed
    return n


def forget_flow(root: Path) -> None:
    """Delete a stopped run's flow under the spool folder ``root``: every entry of tmp/, ready/, acked/
    and claimed/, the quarantined shards (their .why reasons stay), and the state records of the flow
    (DONE markers, the producer registration, heartbeats); state/run.json and the lock files stay."""
    for d in (root / "tmp", root / "ready", root / "acked"):
        for e in list(os.scandir(d)) if d.is_dir() else []:
            remove(Path(e.path))
    claimed = root / "claimed"
    for e in list(os.scandir(claimed)) if claimed.is_dir() else []:
        if e.is_dir(follow_symlinks=False):
            remove(Path(e.path))
    quarantine = root / "quarantine"
    for e in list(os.scandir(quarantine)) if quarantine.is_dir() else []:
        if is_shard_name(e.name):  # their samples are re-produced; the .why stay
            remove(Path(e.path))
    for e in list(os.scandir(root / "state")):
        n = e.name
        if (
            n.startswith("DONE-")
            or n == "producers.json"
            or (n.endswith(".json") and "-" in n and n != RUN_FILE)
        ):
            Path(e.path).unlink(missing_ok=True)
