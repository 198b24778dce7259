"""The numbers are locked: the seeded CPU training run (tests/golden_run.py: the consumer's own drafter,
optimizer, loss, batch and step on the shipped tiny target) gives the losses and final weights recorded in
tests/data/golden_cpu_run.json. A change to anything on the loss path (labels, weights, the mask, the loss,
the optimizer, the schedule, a default) fails here; one meant to change the numbers regenerates the file
with ``.venv/bin/python tests/golden_run.py --write`` and says why in its commit (docs/training.md)."""

from __future__ import annotations

import json

import pytest
from golden_run import GOLDEN, run

LOSS_TOLERANCE = 1e-6  # relative: one machine gives the same bits; another CPU build may round differently
NORM_TOLERANCE = 1e-5  # relative, per weight tensor: used when torch or the CPU differ from the recording


def test_the_seeded_cpu_run_gives_the_recorded_numbers():
    want = json.loads(GOLDEN.read_text())
    got = run(want["steps"])
    rows = [
        f"step {i + 1:>2}: recorded {w:.9f}  now {g:.9f}  ({g - w:+.2e})"
        for i, (w, g) in enumerate(zip(want["losses"], got["losses"], strict=True))
    ]
    regenerate = "if the change is meant to alter the numbers: .venv/bin/python tests/golden_run.py --write"
    assert got["losses"] == pytest.approx(want["losses"], rel=LOSS_TOLERANCE), (
        "the losses differ from the recorded run:\n" + "\n".join(rows) + "\n" + regenerate
    )
    if got["where"] == want["where"]:  # same torch, same CPU kernels: the same bits
        assert got["weights_sha256"] == want["weights_sha256"], (
            f"the final weights differ from the recorded run (same torch and CPU {got['where']}), the losses "
            f"within {LOSS_TOLERANCE:g}\n{regenerate}"
        )
    else:  # another build may round differently: every weight tensor's norm within a tight tolerance
        assert got["weight_norms"] == pytest.approx(want["weight_norms"], rel=NORM_TOLERANCE), (
            f"the final weights' norms differ (recorded on {want['where']}, now {got['where']})\n{regenerate}"
        )
