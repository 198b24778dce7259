"""The spool's records of who runs on it: the run record (which run the spool belongs to), launches and their
locks, the producers registered for a launch and their DONE markers, the campaign they counted, and every
process's heartbeat. ``Spool`` (spool.py) is the shard flow and holds one ``SpoolRecords`` for everything
else in ``state/``: the records share no invariant with the flow but the directory, so they are a part of
their own with their own lock.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import threading
import time
import uuid
from pathlib import Path

from dflash.common.contract.liveness import (
    BOOT_ID,
    HOST,
    SpoolLock,
    lock_holder,
    lock_is_held,
    proc_stat,
)
from dflash.common.contract.names import check_id

log = logging.getLogger(__name__)


_ROLE_RE = re.compile(r"^[a-z]+$")


_RATE_WINDOW_S = 5.0


class SpoolError(RuntimeError):
    """The spool directory is missing, is not a spool, or an operation would break its invariants."""


class RunMismatchError(SpoolError):
    """The spool belongs to another run (or to this run with another model, dataset or plan)."""


class SpoolBusyError(SpoolError):
    """A live process of another launch holds the spool's lock for this role."""


RUN_FILE = "run.json"


LOCK_PREFIX = "lock-"

BUDGET_PHASE = "waiting for spool budget"
"""A producer's heartbeat phase while its writers wait for the spool to drain below its byte budget: it
gives nothing more until the consumers train (and ack) what they hold."""
DEAD_PHASE = "dead"
"""The phase dflash-produce writes for a worker it saw die without a word (kill -9, OOM killer): the last
record of that worker's metrics file."""
IDLE_PHASES = frozenset({BUDGET_PHASE, "done", "stopped", "aborted", DEAD_PHASE})
"""Producer phases that give no data soon: a consumer waiting to fill a stream stops waiting when every
live producer is in one of them (consumer/feed.py)."""


IDENTITY_KEYS = ("run", "model", "target_fingerprint", "layer_ids", "dataset", "plan")
"""What makes two launches the same run (state/run.json): a launch that differs in any field that both
sides record is another run. A consumer records only ``run``; a producer fills in the rest, and a consumer
checks its ``--target`` against ``model`` / ``target_fingerprint`` (the weights of the target's embedding
and lm_head, common/target/head.py) before its first step."""


FLAG_OF = {
    "model": "--model",
    "target_fingerprint": "--model (its weights' fingerprint)",
    "layer_ids": "--layer-ids",
    "epochs": "--epochs",
    "shuffle_seed": "--shuffle-seed",
    "eval_samples": "--eval-samples",
    "rows": "dataset rows (--limit)",
    "max_length": "--max-length",
    "min_loss_tokens": "min supervised tokens (2 x --block-size)",
    "format": "--format",
    "train_reasoning": "--no-train-reasoning",
    "spec": "--dataset",
    "fingerprint": "dataset content (fingerprint)",
}
"""The flag (or what) behind each field of a run record, for the line that names a difference."""


def _conflict(recorded, given) -> bool:
    """Two values of a run-record field disagree: for a dict (plan, dataset), on a key both have (a key one
    side lacks is filled in: an older record, or a consumer that records only the run)."""
    if isinstance(recorded, dict) and isinstance(given, dict):
        return any(recorded[k] != given[k] for k in recorded.keys() & given.keys())
    return recorded != given


def differences(recorded: dict, given: dict, keys: list[str]) -> list[str]:
    """``--max-length 512 recorded, 1024 given`` for each differing field (nested plan/dataset fields one
    by one), so a refused launch says exactly what to change."""
    out = []
    for key in keys:
        a, b = recorded.get(key), given.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [
                f"{FLAG_OF.get(k, k)} {_short(a.get(k))} recorded, {_short(b.get(k))} given"
                for k in sorted(a.keys() & b.keys())
                if a[k] != b[k]
            ]
        else:
            out.append(f"{FLAG_OF.get(key, key)} {_short(a)} recorded, {_short(b)} given")
    return out


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:12] + "…"


def describe_run(rec: dict) -> str:
    """One phrase for a run record: ``run 'x' (model m, dataset d, 612 rows)``."""
    parts = []
    if rec.get("model"):
        parts.append(f"model {rec['model']}")
    ds = rec.get("dataset") or {}
    if ds:
        parts.append(f"dataset {ds.get('spec', '?')} [{str(ds.get('fingerprint', '?'))[:12]}]")
    plan = rec.get("plan") or {}
    if "rows" in plan:
        parts.append(f"{plan['rows']} rows")
    if rec.get("layer_ids") is not None:
        parts.append(f"layers {rec['layer_ids']}")
    return f"run {rec.get('run')!r}" + (f" ({', '.join(parts)})" if parts else "")


def read_json(path: Path) -> dict | None:
    """A record's JSON, or None when it is not there (yet) or torn (a writer crashed before the rename)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class SpoolRecords:
    """``state/`` of a spool: run record, launch locks, producer registration and DONE markers, campaign,
    heartbeats. One per ``Spool`` (its ``records``), shared by that process's threads."""

    def __init__(self, root: Path, state_dir: Path) -> None:
        self.root, self.state_dir = root, state_dir
        self._lock = threading.RLock()
        self._rate_ref: dict[tuple[str, str], tuple[float, dict]] = {}
        self._rates: dict[tuple[str, str], dict] = {}
        self._started = time.time()

    def read_run(self) -> dict | None:
        """state/run.json: the run this spool belongs to (None for a spool no launch has bound yet)."""
        return read_json(self.state_dir / RUN_FILE)

    def bind_run(self, identity: dict, *, who: str = "this launch") -> dict:
        """Bind the spool to ``identity`` (``run`` plus any of model, layer_ids, dataset, plan) or check
        it against the run already recorded. Fields recorded on both sides must be equal, else
        RunMismatchError with one line naming both runs; fields the record lacks are filled in (a
        consumer binds the run name first, the producer adds the rest). Returns the record."""
        if not identity.get("run"):
            raise ValueError("bind_run needs identity['run']")
        ident = {k: identity[k] for k in IDENTITY_KEYS if identity.get(k) is not None}
        path = self.state_dir / RUN_FILE
        with self._lock:
            for _ in range(10):
                rec = self.read_run()
                if rec is None:
                    new = {**ident, "created": time.time(), "launches": 0}
                    tmp = path.with_name(f".{RUN_FILE}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
                    tmp.write_text(json.dumps(new) + "\n")
                    try:
                        os.link(tmp, path)  # exactly one creator wins
                    except FileExistsError:
                        continue
                    finally:
                        tmp.unlink(missing_ok=True)
                    return new
                differ = [k for k in IDENTITY_KEYS if k in ident and k in rec and _conflict(rec[k], ident[k])]
                if "run" in differ:
                    raise RunMismatchError(
                        f"spool {self.root} belongs to {describe_run(rec)}; {who} is {describe_run(ident)} "
                        "(another run): use another --spool, or discard this one (ops/run_all.sh --fresh-spool)"
                    )
                if differ:
                    raise RunMismatchError(
                        f"spool {self.root} belongs to run {rec['run']!r}, and {who} is the same run name with "
                        f"another {', '.join(differ)}: {'; '.join(differences(rec, ident, differ))} (a run's "
                        "settings are fixed: give the same, use another --spool, or discard this one with "
                        "ops/run_all.sh --fresh-spool)"
                    )
                # fill in what the record lacks, merge dicts
                missing = {k: v for k, v in ident.items() if k not in rec or rec[k] != v}
                missing = {
                    k: {**rec[k], **v} if isinstance(v, dict) and isinstance(rec.get(k), dict) else v
                    for k, v in missing.items()
                }
                if not missing:
                    return rec
                rec = {**rec, **missing}
                atomic_write_text(path, json.dumps(rec) + "\n")
                return rec
        raise SpoolError(f"spool {self.root}: could not bind state/{RUN_FILE} (concurrent writers?)")

    def next_launch(self) -> int:
        """Count a producer launch in state/run.json and return its number (1, 2, ...): producer ids carry
        it, so shard names and DONE markers of different launches never collide. Call under the
        producer's lock, after bind_run."""
        with self._lock:
            rec = self.read_run() or {}
            n = int(rec.get("launches", 0)) + 1
            atomic_write_text(self.state_dir / RUN_FILE, json.dumps({**rec, "launches": n}) + "\n")
            return n

    def acquire_lock(self, name: str, holder: str) -> SpoolLock:
        """Take ``<spool>/lock-<name>`` (flock, non-blocking) for the rest of this process's life, or raise
        SpoolBusyError naming the live holder. ``holder`` (one line) is written into the file."""
        check_id("lock name", name)
        path = self.root / f"{LOCK_PREFIX}{name}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SpoolBusyError(
                f"spool {self.root} is in use by a live launch: {lock_holder(path)} holds {path.name}"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{holder} (pid {os.getpid()} on {HOST}, since {time.strftime('%H:%M:%S')})\n".encode())
        return SpoolLock(path, fd)

    def live_locks(self) -> dict[str, str]:
        """Locks held by live processes right now: {lock name: holder line}."""
        out = {}
        for p in sorted(self.root.glob(f"{LOCK_PREFIX}*")):
            if lock_is_held(p):
                out[p.name[len(LOCK_PREFIX) :]] = lock_holder(p)
        return out

    def register_producers(self, producer_ids: list[str]) -> None:
        """The set of producers whose DONE markers mean 'no more shards' (state/producers.json)."""
        ids = sorted({check_id("producer_id", p) for p in producer_ids})
        if not ids:
            raise ValueError("register_producers needs at least one producer id")
        old = self.registered_producers()
        if old and old != ids:
            log.info("registering producers %s (was %s)", ids, old)
        atomic_write_text(self.state_dir / "producers.json", json.dumps({"producers": ids}) + "\n")

    def write_campaign(self, node_rank: int, record: dict) -> None:
        """state/campaign-n<node>.json: what this node's producers' slices give per epoch (samples, tokens,
        loss_tokens, epochs, num_nodes); the same on every launch of the run (see dflash.common.contract.epochs)."""
        atomic_write_text(self.state_dir / f"campaign-n{int(node_rank)}.json", json.dumps(record) + "\n")

    def read_campaign(self) -> list[dict] | None:
        """Every node's campaign record, or None until all ``num_nodes`` nodes have written theirs."""
        recs = [r for p in sorted(self.state_dir.glob("campaign-n*.json")) if (r := read_json(p))]
        if not recs or len({int(r["node_rank"]) for r in recs}) < int(recs[0].get("num_nodes", 1)):
            return None
        return recs

    def registered_producers(self) -> list[str]:
        try:
            return list(json.loads((self.state_dir / "producers.json").read_text())["producers"])
        except FileNotFoundError:
            return []

    def mark_done(self, producer_id: str) -> None:
        """Write state/DONE-<id>; call after the producer's last publish."""
        check_id("producer_id", producer_id)
        atomic_write_text(self.state_dir / f"DONE-{producer_id}", f"{time.time():.3f}\n")

    def clear_done(self, producer_id: str) -> None:
        """Remove a stale DONE marker and epoch marker (a producer restarted on a resumed run)."""
        (self.state_dir / f"DONE-{check_id('producer_id', producer_id)}").unlink(missing_ok=True)
        (self.state_dir / f"epoch-{producer_id}.json").unlink(missing_ok=True)

    def mark_epoch_done(self, producer_id: str, epoch: int) -> None:
        """state/epoch-<id>.json: every shard of ``epoch`` (and the ones before) this producer will write is
        published. The producers' epoch barrier (producer/epoch_barrier.py) reads it."""
        check_id("producer_id", producer_id)
        atomic_write_text(
            self.state_dir / f"epoch-{producer_id}.json", json.dumps({"epoch_done": int(epoch)}) + "\n"
        )

    def epochs_done(self) -> dict[str, int]:
        """{producer id: the last epoch it has fully published} for the producers that said so."""
        out = {}
        for name in os.listdir(self.state_dir):
            if name.startswith("epoch-") and name.endswith(".json"):
                rec = read_json(self.state_dir / name)
                if rec is not None and isinstance(rec.get("epoch_done"), int):
                    out[name[len("epoch-") : -len(".json")]] = rec["epoch_done"]
        return out

    def mark_dead(self, producer_id: str, how: str) -> None:
        """state/dead-<id>.json: the producer's parent saw it die without a word (kill -9, OOM killer) and
        says how; it writes no DONE marker. Why a record: consumers waiting on its marker, the epoch
        barrier and dflash-status can then name it at once, not guess from a heartbeat's age (a worker
        killed before its first heartbeat has none)."""
        check_id("producer_id", producer_id)
        rec = {"id": producer_id, "how": how, "time": time.time()}
        atomic_write_text(self.state_dir / f"dead-{producer_id}.json", json.dumps(rec) + "\n")

    def dead_producers(self) -> dict[str, str]:
        """{producer id: how it died} for the producers their parent saw die (``mark_dead``)."""
        out = {}
        for name in os.listdir(self.state_dir):
            if name.startswith("dead-") and name.endswith(".json"):
                rec = read_json(self.state_dir / name)
                if rec is not None:
                    out[name[len("dead-") : -len(".json")]] = str(rec.get("how", "died"))
        return out

    def done_producers(self) -> list[str]:
        return sorted(n[len("DONE-") :] for n in os.listdir(self.state_dir) if n.startswith("DONE-"))

    def producers_done(self) -> bool:
        registered = self.registered_producers()
        return bool(registered) and set(registered) <= set(self.done_producers())

    def heartbeat(self, role: str, proc_id: str, counters: dict) -> None:
        """Atomically write state/<role>-<id>.json: pid, host, time, process start time, the counters
        and their rates per second over the last few seconds."""
        if not _ROLE_RE.match(role):
            raise ValueError(f"role must be lowercase letters, got {role!r}")
        check_id("proc_id", proc_id)
        now = time.time()
        key = (role, proc_id)
        numeric = {
            k: v for k, v in counters.items() if isinstance(v, int | float) and not isinstance(v, bool)
        }
        with self._lock:
            ref_t, ref_c = self._rate_ref.setdefault(key, (self._started, {k: 0 for k in numeric}))
            if now - ref_t >= _RATE_WINDOW_S or key not in self._rates:
                dt = max(now - ref_t, 1e-9)
                self._rates[key] = {k: (v - ref_c.get(k, 0)) / dt for k, v in numeric.items()}
                if now - ref_t >= _RATE_WINDOW_S:
                    self._rate_ref[key] = (now, numeric)
            rates = self._rates[key]
        st = proc_stat(os.getpid())
        hb = {
            "role": role,
            "id": proc_id,
            "pid": os.getpid(),
            "host": HOST,
            "boot_id": BOOT_ID,
            "start_ticks": st[1] if st else None,
            "started": self._started,
            "time": now,
            "counters": counters,
            "rates": rates,
        }
        atomic_write_text(self.state_dir / f"{role}-{proc_id}.json", json.dumps(hb) + "\n")

    def heartbeats(self) -> list[dict]:
        out = []
        for name in sorted(os.listdir(self.state_dir)):
            if name.endswith(".json") and not name.startswith(".") and name != "producers.json":
                hb = read_json(self.state_dir / name)
                if hb is not None and "role" in hb:
                    out.append(hb)
        return out
