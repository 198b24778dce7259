"""The numbers are locked: dflash-consume's ``Trainer``, run in this process on a seeded spool
(tests/golden_run.py: the feed, packing, the input pipeline, ``train_step``, the schedule sized from the
data), gives the per-step losses, gradient norms, rates and samples and the per-tensor weight changes
recorded in tests/data/golden_cpu_run.json. A change to anything on the loss path (labels, weights, the
mask, the loss, the optimizer, the schedule, packing, a default) fails here; one meant to change the
numbers regenerates the file with ``.venv/bin/python tests/golden_run.py --write`` and says why in its
commit (docs/training.md).

The verdict does not depend on the CPU's vector extensions. fp32 sums round differently under each of
ATen's CPU kernels (AVX-512, AVX2, none: ``ATEN_CPU_CAPABILITY``), and twelve steps of training carry the
difference along. The run uses one torch thread (``cpu_threads=1``), so the summation order cannot follow
the machine's core count (two threads measured the same bits here; one keeps it so at any size): each
kernel gives the same bits on every run and every machine. Measured on torch 2.13 CPU (the pin), one Xeon with AVX-512, the run under
``ATEN_CPU_CAPABILITY=default``, ``avx2`` and ``avx512`` (max over steps and over the three pairs):

    per-step loss         abs 6.2e-5   rel 6.8e-6
    per-step grad norm    abs 3.9e-3   rel 1.1e-4
    per-tensor change     abs 1.3e-6   rel 1.1e-5
    rates, samples, schedule length    identical

(``avx2`` here reproduces a real AVX2 box: the run this file replaced differed from its AVX-512 recording
by 3.24e-5 abs / 5.08e-6 rel under it, as on the AVX2 box; limiting MKL and oneDNN too,
``MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``, changes no bit.) The tolerances below are about
ten times those. What a real change does, measured the same way (max over steps / the first step):
``gamma`` 7.0 -> 7.5 moves the loss by 2.6e-2 / 2.6e-4 relative, the grad norm by 3.6e-1 / 2.5e-3, a
tensor's change by up to 1.2e-2; one anchor more (``num_anchors`` 16 -> 17) the loss by 2.4e-1 / 4.8e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from golden_run import DOCS, GOLDEN, SHAPES, SHARDS, run

from dflash.consumer.config import FeedConfig
from dflash.consumer.packing import Sample, best_fit

LOSS_TOLERANCE = 1e-4
"""relative, per step: 15x the spread across CPU kernels (module docstring)"""
GRAD_NORM_TOLERANCE = 1e-3
"""relative, per step: 9x the spread across CPU kernels"""
UPDATE_TOLERANCE = 1e-4
"""relative, per trainable tensor (the norm of its change over the run): 9x the spread"""
REGENERATE = "if the change is meant to alter the numbers: .venv/bin/python tests/golden_run.py --write"


def _rows(want: list[float], got: list[float]) -> str:
    return "\n".join(
        f"  step {i + 1:>2}: recorded {w:.9g}  now {g:.9g}  (rel {(g - w) / w:+.1e})"
        for i, (w, g) in enumerate(zip(want, got, strict=True))
    )


def test_the_seeded_cpu_run_gives_the_recorded_numbers():
    want = json.loads(GOLDEN.read_text())
    got = run()
    where = f"(recorded on {want['where']}, now {got['where']})"
    assert got["steps"] == want["steps"] and got["samples"] == want["samples"], (
        f"the steps trained other samples (packing, the feed or the ledger changed): recorded "
        f"{want['samples']}, now {got['samples']}\n{REGENERATE}"
    )
    assert got["schedule_total_steps"] == want["schedule_total_steps"]
    assert got["lrs"] == pytest.approx(want["lrs"], rel=1e-9), (
        "the rates differ (the schedule changed):\n" + _rows(want["lrs"], got["lrs"]) + f"\n{REGENERATE}"
    )
    assert got["losses"] == pytest.approx(want["losses"], rel=LOSS_TOLERANCE), (
        f"the losses differ from the recorded run beyond {LOSS_TOLERANCE:g} {where}:\n"
        + _rows(want["losses"], got["losses"])
        + f"\n{REGENERATE}"
    )
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=GRAD_NORM_TOLERANCE), (
        f"the gradient norms differ beyond {GRAD_NORM_TOLERANCE:g} {where}:\n"
        + _rows(want["grad_norms"], got["grad_norms"])
        + f"\n{REGENERATE}"
    )
    assert got["update_norms"] == pytest.approx(want["update_norms"], rel=UPDATE_TOLERANCE), (
        f"the weights moved differently (per-tensor change beyond {UPDATE_TOLERANCE:g}) {where}\n{REGENERATE}"
    )


def _streams_for_every_arrival_order() -> set[tuple]:
    """Every sequence of streams the feed can pack from the golden spool, over every timing of its decode
    thread: before each stream any number of further shards may have been decoded (the feed stops
    draining once its pool holds ``pool_streams`` streams' worth), and with the producer done it packs
    whatever its pool holds (consumer/feed.py: ``next_packed``)."""
    context = SHAPES["context_tokens"]
    target = max(2, FeedConfig.pool_streams) * context
    split = FeedConfig.min_split_tokens
    docs = [torch.zeros(n) for n in DOCS]  # only the lengths matter to packing
    shards = [
        [Sample(d, d, d, k * len(DOCS) + j, Path(f"s{k}")) for j, d in enumerate(docs)] for k in range(SHARDS)
    ]
    outcomes: set[tuple] = set()

    def pack(pool: list[Sample], loaded: int, streams: tuple) -> None:
        choices = [(pool, loaded)]
        while sum(s.num_tokens for s in pool) < target and loaded < SHARDS:
            pool, loaded = pool + shards[loaded], loaded + 1
            choices.append((pool, loaded))
        for pool, loaded in choices:
            if not pool:
                if loaded == SHARDS:
                    outcomes.add(streams)
                continue
            chosen, rest = best_fit(pool, context, split)
            pack(rest, loaded, (*streams, tuple((s.sample_index, s.start, s.num_tokens) for s in chosen)))

    pack([], 0, ())
    return outcomes


def test_the_golden_spool_packs_the_same_streams_whatever_the_decode_timing():
    """The golden run's samples cannot depend on the decode thread's speed: every arrival order of its
    shards gives one sequence of full streams, with a split document in each shard."""
    outcomes = _streams_for_every_arrival_order()
    assert len(outcomes) == 1, f"{len(outcomes)} different packings, depending on the decode timing"
    (streams,) = outcomes
    assert all(sum(n for _, _, n in s) == SHAPES["context_tokens"] for s in streams)
    assert any(start > 0 for s in streams for _, start, _ in s), "no document is split"
