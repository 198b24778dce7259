"""dflash-produce's console: the workers' heartbeats as one progress line (a tqdm bar on a terminal), and
their tokenization summaries as one (the launch's "N trainable rows; dropped ..." line).

Why apart from the supervisor: what the user reads is kept in one place; the supervisor only feeds it.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from dflash.common.metrics import format_bytes, format_duration, format_rate


class Progress:
    """Aggregates worker heartbeats into one line (and a tqdm bar on a terminal)."""

    def __init__(self, spool, ids: list[str], every_s: float):
        self.spool, self.every_s = spool, every_s
        self.hb: dict[str, dict] = {i: {} for i in ids}
        self.t0 = self.last = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            self.bar = tqdm(total=0, unit="sample", desc="produce", dynamic_ncols=True)

    def update(self, pid: str, hb: dict) -> None:
        self.hb[pid] = hb
        if self.bar is not None:
            self.bar.total = int(sum(h.get("total", 0) for h in self.hb.values()))
            self.bar.n = int(sum(h.get("samples", 0) + h.get("dropped", 0) for h in self.hb.values()))
            self.bar.set_postfix_str(self._rates(), refresh=True)

    def _rates(self) -> str:
        tok_s = sum(h.get("tok_s", 0.0) for h in self.hb.values())
        ready = sum(1 for _ in self.spool.ready_dir.iterdir()) if self.spool.ready_dir.is_dir() else 0
        return f"{format_rate(tok_s)} tok/s | spool {ready} shards / {format_bytes(self.spool.total_bytes())}"

    def maybe_print(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.bar is not None or (not force and now - self.last < self.every_s):
            return
        self.last = now
        total = sum(h.get("total", 0) for h in self.hb.values())
        done = sum(h.get("samples", 0) + h.get("dropped", 0) for h in self.hb.values())
        rate = done / max(now - self.t0, 1e-9)
        eta = f" | ETA {format_duration((total - done) / rate)}" if rate > 0 and total else ""
        drop = sum(h.get("dropped", 0) for h in self.hb.values())
        skip = sum(h.get("skipped", 0) for h in self.hb.values())
        print(
            f"[{format_duration(now - self.t0)}] samples {done}/{total} | {self._rates()} | "
            f"dropped {drop} skipped {skip}{eta}",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def merge_summaries(summaries: list[dict]) -> dict:
    """The workers' tokenization summaries as one: counts summed, reasons by count, the earliest example."""
    out = {"rows": 0, "samples": 0, "ok": 0, "dropped": 0, "skipped": 0, "reasons": {}, "first": {}}
    for sm in summaries:
        for k in ("rows", "ok", "dropped", "skipped"):
            out[k] += int(sm.get(k, 0))
        out["samples"] += int(sm.get("samples", sm.get("rows", 0)))
        for r, n in sm.get("reasons", {}).items():
            out["reasons"][r] = out["reasons"].get(r, 0) + n
        for r, ex in sm.get("first", {}).items():
            row = lambda e: int(e.split()[1].rstrip(":")) if e.startswith("row ") else 1 << 62  # noqa: E731
            if r not in out["first"] or row(ex) < row(out["first"][r]):
                out["first"][r] = ex
    out["reasons"] = dict(sorted(out["reasons"].items(), key=lambda kv: -kv[1]))
    return out
