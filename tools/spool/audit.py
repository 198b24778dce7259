"""``dflash-spool audit RUN_DIR``: the exactly-once audit of a run from its consumers' sample ledgers.

Each consumer rank writes ``metrics/ledger-r<rank>.jsonl``: one line per committed optimizer step (step,
pid, epoch, the sample ids it trained). A *life* is one launch of the consumer group: rank 0's lines of one
pid, with the other ranks' lines of the launch (matched by the step they started from). Life L resumed from
step r_L (its first step - 1) and is *durable* up to the step the next life resumed from (the last life: up
to the final checkpoint, or its last step). Lines past that are its *lost tail*: trained, then lost with a
crash before the next checkpoint, redone by the next life. Along the durable parts every sample must be
trained once: *twice* counts a sample durable in two lives or twice in one life; with ``--checkpoint``,
*missing* counts samples of the final checkpoint's trained set no durable line trained, and *unsaved*
durable samples the checkpoint does not hold (docs/reliability.md, "The guarantee").
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """A ledger's lines; a line torn by a kill -9 is skipped."""
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if (
            isinstance(rec, dict)
            and isinstance(rec.get("step"), int)
            and isinstance(rec.get("samples"), list)
        ):
            out.append(rec)
    return out


@dataclass
class Life:
    resumed: int
    lines: list[dict[str, Any]] = field(default_factory=list)
    durable: int = 0


def lives(ledgers: dict[int, list[dict[str, Any]]]) -> list[Life]:
    """The launches of the group, in order (module docstring)."""
    out: list[Life] = []
    by_pid: list[tuple[int, int, list[dict]]] = []  # (rank, pid) segments in file order
    for rank, recs in sorted(ledgers.items()):
        for rec in recs:
            if not by_pid or by_pid[-1][0] != rank or by_pid[-1][1] != rec.get("pid"):
                by_pid.append((rank, rec.get("pid"), []))
            by_pid[-1][2].append({**rec, "rank": rank})
    main = [seg for seg in by_pid if seg[0] == min(ledgers)]
    for _, _, recs in main:
        out.append(Life(resumed=recs[0]["step"] - 1, lines=list(recs)))
    taken = [0] * len(out)
    for rank, _, recs in by_pid:
        if rank == min(ledgers):
            continue
        start = recs[0]["step"] - 1
        match = next((i for i, life in enumerate(out) if life.resumed == start and taken[i] < rank), None)
        if match is None:
            out.append(Life(resumed=start, lines=list(recs)))
            continue
        taken[match] = rank
        out[match].lines.extend(recs)
    return out


def audit(run_dir: str | Path, *, final_step: int | None = None, trained: set[int] | None = None) -> dict:
    """The counts of the audit (module docstring); ``final_step`` and ``trained``: the final checkpoint's."""
    metrics = Path(run_dir) / "metrics"
    ledgers = {
        int(p.stem.partition("-r")[2]): read_ledger(p) for p in sorted(metrics.glob("ledger-r*.jsonl"))
    }
    ledgers = {r: recs for r, recs in ledgers.items() if recs}
    if not ledgers:
        raise ValueError(
            f"no sample ledger in {metrics} (consumers write ledger-r<rank>.jsonl with --run-dir)"
        )
    found = lives(ledgers)
    for life, nxt in zip(found, found[1:], strict=False):
        life.durable = nxt.resumed
    found[-1].durable = final_step if final_step is not None else max(x["step"] for x in found[-1].lines)
    durable: Counter[int] = Counter()
    epoch_of: dict[int, int] = {}
    tails, in_a_life = [], set()
    for life in found:
        in_life = Counter(s for x in life.lines for s in x["samples"])
        in_a_life |= {s for s, n in in_life.items() if n > 1}  # twice in one life, lost tail included
        tails.append(sum(len(x["samples"]) for x in life.lines if x["step"] > life.durable))
        for x in life.lines:
            if x["step"] <= life.durable:
                durable.update(x["samples"])
                for s in x["samples"]:
                    epoch_of[s] = int(x.get("epoch", 0))
    per_epoch: dict[int, dict[str, int]] = defaultdict(lambda: {"trained": 0, "twice": 0})
    for s, n in durable.items():
        e = per_epoch[epoch_of.get(s, 0)]
        e["trained"] += 1
        e["twice"] += n > 1
    report: dict[str, Any] = {
        "lives": [
            {"resumed": life.resumed, "durable": life.durable, "lost_tail_samples": t}
            for life, t in zip(found, tails, strict=True)
        ],
        "samples": len(durable),
        "twice": sum(1 for n in durable.values() if n > 1),
        "twice_first": sorted(s for s, n in durable.items() if n > 1)[:10],
        "twice_in_a_life": len(in_a_life),
        "per_epoch": {str(e): v for e, v in sorted(per_epoch.items())},
        "final_step": found[-1].durable,
    }
    if trained is not None:
        missing, unsaved = trained - set(durable), set(durable) - trained
        report.update(
            missing=len(missing),
            missing_first=sorted(missing)[:10],
            unsaved=len(unsaved),
            unsaved_first=sorted(unsaved)[:10],
        )
    return report


def exactly_once(report: dict) -> bool:
    return (
        report["twice"] == 0
        and report["twice_in_a_life"] == 0
        and not report.get("missing")
        and not report.get("unsaved")
    )


def format_report(report: dict) -> str:
    lines = [
        f"{len(report['lives'])} launch(es) of the consumers; final step {report['final_step']}; "
        f"{report['samples']} samples trained durably"
    ]
    for i, life in enumerate(report["lives"]):
        tail = (
            f", lost tail {life['lost_tail_samples']} samples (redone)" if life["lost_tail_samples"] else ""
        )
        lines.append(f"  launch {i + 1}: steps {life['resumed'] + 1}..{life['durable']}{tail}")
    for e, v in report["per_epoch"].items():
        lines.append(f"  epoch {int(e) + 1}: {v['trained']} samples, {v['twice']} twice")
    verdict = "exactly once" if exactly_once(report) else "NOT exactly once"
    parts = [
        f"twice {report['twice']}" + (f" (e.g. {report['twice_first']})" if report["twice"] else ""),
        f"twice within one launch {report['twice_in_a_life']}",
    ]
    if "missing" in report:
        parts.append(
            f"missing {report['missing']}"
            + (f" (e.g. {report['missing_first']})" if report["missing"] else "")
        )
        parts.append(f"trained but not in the checkpoint {report['unsaved']}")
    else:
        parts.append("missing: not checked (give --checkpoint STORE)")
    lines.append(f"{verdict}: " + ", ".join(parts))
    return "\n".join(lines)
