"""Exact sample accounting over the lives of a run, from the consumers' sample ledgers (not collected).

A run's *timeline* is the chain of checkpoints it grows from. Life L resumed from step r_L (its first
ledger step - 1) and is durable up to d_L, the step the next life resumed from (the final checkpoint for
the last life); its ledger lines with step <= d_L are durable, later ones are its *lost tail* (trained,
then lost with a kill -9 before the next checkpoint, so redone by the next life). "Duplicates" are
samples trained twice along the final timeline (in two durable sets) or twice within one life;
"missing" are eligible samples in no durable set. Exactly once means both are 0 (docs/reliability.md).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

STARTED = re.compile(r"^started (\S+) \(pid (\d+)\)", re.M)


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSONL file; a line torn by a kill -9 is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def launches_from_output(text: str) -> list[dict[str, int]]:
    """The processes of each launch ops/run_all.sh printed ("started NAME (pid N)"), in order."""
    out: list[dict[str, int]] = []
    for name, pid in STARTED.findall(text):
        if name == "producer":
            out.append({})
        out[-1][name] = int(pid)
    return out


def audit(run_dir: Path, launches: list[dict[str, int]], final_step: int, eligible: set[int], ranks=(0,)):
    """Check the ledgers of ``launches`` against the timeline; returns a dict of the counts (raises
    AssertionError with the first broken rule)."""
    life_of = {}
    for i, launch in enumerate(launches):
        for r in ranks:
            life_of[launch[f"consumer-{r}"]] = i
    lines: list[list[dict]] = [[] for _ in launches]
    for r in ranks:
        for rec in read_jsonl(run_dir / "metrics" / f"ledger-r{r}.jsonl"):
            assert rec["pid"] in life_of, f"ledger line of an unknown process {rec['pid']}"
            lines[life_of[rec["pid"]]].append({**rec, "rank": r})
    active = [i for i, ls in enumerate(lines) if ls]
    assert active, "no life trained anything"
    resumed = {i: min(x["step"] for x in lines[i]) - 1 for i in active}
    durable_step = {a: resumed[b] for a, b in zip(active, active[1:], strict=False)}
    durable_step[active[-1]] = final_step
    assert max(x["step"] for x in lines[active[-1]]) == final_step, (
        "the last life did not end at the final checkpoint"
    )
    so_far: set[int] = set()
    duplicates = 0
    tails: dict[int, int] = {}
    for i in active:
        r, d = resumed[i], durable_step[i]
        for k in ranks:
            steps = sorted(x["step"] for x in lines[i] if x["rank"] == k)
            assert steps == list(range(r + 1, r + 1 + len(steps))), (
                f"life {i} rank {k}: steps not consecutive"
            )
        per_life = Counter(s for x in lines[i] for s in x["samples"])
        twice = [s for s, n in per_life.items() if n > 1]
        assert not twice, f"life {i} trained samples twice: {sorted(twice)[:10]}"
        durable = {s for x in lines[i] if x["step"] <= d for s in x["samples"]}
        tail = {s for x in lines[i] if x["step"] > d for s in x["samples"]}
        duplicates += len(durable & so_far)
        assert not durable & so_far, f"life {i} re-trained durable samples {sorted(durable & so_far)[:10]}"
        assert not tail & so_far, f"life {i}'s lost tail re-trained durable samples"
        so_far |= durable
        tails[i] = len(tail)
    missing = eligible - so_far
    assert not missing, f"{len(missing)} eligible samples never trained durably: {sorted(missing)[:20]}"
    assert so_far <= eligible, f"trained samples that are not eligible: {sorted(so_far - eligible)[:20]}"
    return {
        "lives": len(active),
        "duplicates": duplicates,
        "missing": len(missing),
        "lost_tails": tails,
        "resumed": resumed,
        "durable": durable_step,
    }


def eligible_samples(
    data: Path, target: Path, cache: Path, *, max_length: int, min_loss_tokens: int = 32
) -> set[int]:
    """The samples producers keep, from a clean tokenization pass with the producers' settings."""
    return set(eligible_lengths(data, target, cache, max_length=max_length, min_loss_tokens=min_loss_tokens))


def eligible_lengths(
    data: Path, target: Path, cache: Path, *, max_length: int, min_loss_tokens: int = 32
) -> dict[int, int]:
    """Row -> tokens of every sample the producers keep (a clean tokenization pass, the producers' settings)."""
    from transformers import AutoTokenizer

    from dflash.common.target.chat import tokenize_slice
    from dflash.common.target.data import DataConfig, load_raw_dataset

    cfg = DataConfig(
        dataset=str(data), max_length=max_length, min_loss_tokens=min_loss_tokens, cache_dir=str(cache)
    )
    ds = load_raw_dataset(cfg)
    out = tokenize_slice(ds, AutoTokenizer.from_pretrained(target), cfg, np.arange(len(ds)))
    return {
        int(i): len(ids)
        for i, ids, s in zip(out["sample_index"], out["input_ids"], out["status"], strict=True)
        if s == "ok"
    }
