"""A stand-in producer worker for in-process tests of dflash-produce's parent (producer/supervisor.py):
it speaks the real pipe protocol and passes the real worker's fault points (common/fault.py) in the
real order, without a model, a tokenizer or a spool write, so a launch of two of them takes a second.

Not collected (no test_ prefix); spawned children import it by name (the test folder is on sys.path)."""

from __future__ import annotations

ROWS = 10  # each stand-in's slice
SUMMARY = {
    "rows": ROWS,
    "samples": ROWS,
    "ok": ROWS,
    "dropped": 0,
    "skipped": 0,
    "reasons": {},
    "first": {},
    "campaign": {"samples": ROWS, "tokens": 100 * ROWS, "loss_tokens": 50 * ROWS},
}


def standin_worker(cfg, worker, conn, log_level: str, parent_pid: int) -> None:
    """The real worker's phases and events: start, tokenize, report, wait for go, load, loaded, first
    shard, done (each phase a ``fault_point`` where the real worker has one)."""
    from dflash.common.fault import fault_point

    names, pid = worker.fault_name, worker.producer_id
    fault_point(names, "start")
    conn.send(("hb", pid, {"phase": "tokenize", "samples": 0, "total": 0}))
    fault_point(names, "tokenized")
    conn.send(("tokenized", pid, SUMMARY))
    word = conn.recv()
    if word != "go":
        conn.send(("aborted", pid, {"done": False, "aborted": True}))
        return
    for phase in ("load", "loaded", "first-shard"):
        fault_point(names, phase)
    conn.send(("done", pid, {"done": True, "samples": ROWS, "tokens": 100 * ROWS, "shards": 1}))
