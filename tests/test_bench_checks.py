"""A benchmark check says PASS only inside its own bound (ops/bench/producer_bench.py `acceptance`, and the
kernel check's verdict, ops/bench/kernel_check.py): a value under a threshold is FAIL, a missing one n/a, and
fla's accuracy is judged per captured layer against the reference kernels' own bf16 error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops" / "bench"))
from kernel_check import ERROR_FLOOR, FLA_ERROR_RATIO, verdict  # noqa: E402
from producer_bench import acceptance, markdown  # noqa: E402


def _lines(res: dict) -> list[str]:
    res["acceptance"] = acceptance(res)
    return [line for line in markdown(res).splitlines() if line.startswith("- ")]


def _result(**ratios) -> dict:
    return {
        "preset": "hybrid27b",
        "model": "m",
        "date": "d",
        "device_name": "gpu",
        "dtype": "bf16",
        "torch": "t",
        "transformers": "t",
        "args": {"batch_tokens": 1},
        "layer_ids": [1],
        "depth_scale": 1,
        "results": {},
        "ratios": ratios,
        "gpu_memory": {},
    }


def test_a_ratio_under_its_threshold_fails_and_a_missing_one_is_not_a_pass():
    lines = _lines(_result(full_vs_reference=1.49, full_tok_s_full_depth=9001.0))
    assert any(line.startswith("- FAIL: fast kernels >= 1.5x") for line in lines)
    assert any(line.startswith("- PASS: producer >= 9,000 tok/s") for line in lines)
    assert any(line.startswith("- n/a: producer >= 0.95x its own") for line in lines)


def _captures(errors: list[float], seed: int) -> torch.Tensor:
    """Two captured layers of 64 features around a fixed truth, each off by its relative error."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(16, 128, generator=g)
    out = _truth().clone()
    for k, e in enumerate(errors):
        t, n = _truth()[:, k * 64 : (k + 1) * 64], noise[:, k * 64 : (k + 1) * 64]
        out[:, k * 64 : (k + 1) * 64] = t + n * (e * t.norm() / n.norm())
    return out


def _truth() -> torch.Tensor:
    return torch.randn(16, 128, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "fla_errors,ok",
    [
        ([0.012, 0.028], True),  # within 1.5x the reference's own error at both layers
        ([0.012, 0.05], False),  # layer 2: 2.5x the reference's error: a kernel off beyond bf16
        ([0.5, 0.5], False),  # a wrong kernel: far off
    ],
)
def test_fla_is_judged_per_layer_against_the_reference_kernels_own_bf16_error(fla_errors, ok):
    reference, fla = _captures([0.01, 0.02], seed=1), _captures(fla_errors, seed=2)
    got = verdict([1, 5], _truth(), reference, fla, fast=True)
    assert got["ok"] is ok
    assert got["per_layer"][1]["reference_bf16"] == pytest.approx(0.01, rel=1e-3)
    assert got["per_layer"][5]["fla_bf16"] == pytest.approx(fla_errors[1], rel=1e-3)
    assert FLA_ERROR_RATIO == 1.5 and ERROR_FLOOR == 1e-3


def test_a_check_where_fla_did_not_run_is_not_a_pass_and_tiny_errors_pass_by_the_floor():
    same = _captures([1e-4, 1e-4], seed=3)
    assert (
        verdict([1, 5], _truth(), same, same, fast=False)["ok"] is None
    )  # the reference twice: nothing checked
    tiny = verdict(
        [1, 5], _truth(), _captures([1e-5, 1e-5], seed=4), _captures([5e-4, 5e-4], seed=5), fast=True
    )
    assert tiny["ok"] is True  # 50x a negligible error, but under the floor
    res = _result()
    res["results"]["kernel_check"] = {"layers": 8, **verdict([1, 5], _truth(), same, same, fast=False)}
    assert any(line.startswith("- n/a: fla as accurate as") for line in _lines(res))


def _fake_reference(monkeypatch, *, prints_shape: bool = True) -> list[dict]:
    """consumer_bench's subprocess.run answered in-process as ref_consumer_step.py prints: its line names
    the REF_SHAPE it was given (the script from before REF_SHAPE names none and measures 32b)."""
    import subprocess

    import consumer_bench

    seen: list[dict] = []

    def run(cmd, **kw):
        shape = kw["env"].get("REF_SHAPE", "32b")
        seen.append({"cmd": cmd, "shape": shape})
        ms = {"32b": 195.3, "hybrid27b": 170.0}[shape]
        head = f"shape {shape} S={cmd[-2]} N={cmd[-1]} Q=4096: " if prints_shape else ""
        out = f"first step s 9.5\n{head}{ms} ms/step, 400 TFLOP/s, MFU(781) 51%, peak 60.0 GB, ctx tok/s 20972\n"
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(consumer_bench.subprocess, "run", run)
    return seen


def test_the_ab_reference_runs_at_the_presets_own_shape_and_only_that_shape_gets_a_ratio(monkeypatch):
    """consumer_ab's reference for --preset hybrid27b is the reference step at REF_SHAPE=hybrid27b; a ratio
    is computed only for a run of the reference's shape; a preset the reference has no shape for gets no
    reference (and so no ratio)."""
    from consumer_ab import reference_record
    from consumer_bench import vs_reference

    seen = _fake_reference(monkeypatch)
    ref = reference_record("/nowhere", "hybrid27b", 4096, 256, 60)
    assert seen[-1]["shape"] == "hybrid27b" and seen[-1]["cmd"][-2:] == ["4096", "256"]
    assert ref["shape"] == "hybrid27b" and ref["ms_per_step"] == 170.0
    assert vs_reference(ref, {"preset": "hybrid27b", "ms_per_step_median": 136.0}) == 1.25
    assert vs_reference(ref, {"preset": "32b", "ms_per_step_median": 136.0}) is None  # another shape
    ref32 = reference_record("/nowhere", "32b", 4096, 256, 60)
    assert (
        seen[-1]["shape"] == "32b"
        and vs_reference(ref32, {"preset": "32b", "ms_per_step_median": 155.0}) == 1.26
    )
    skipped = reference_record("/nowhere", "8b", 4096, 256, 60)
    assert len(seen) == 2 and "no 8b shape" in skipped["skipped"]
    assert vs_reference(skipped, {"preset": "8b", "ms_per_step_median": 100.0}) is None


def test_a_reference_script_that_ignores_ref_shape_is_an_error_not_a_32b_figure(monkeypatch):
    from consumer_ab import reference_record

    _fake_reference(monkeypatch, prints_shape=False)
    rec = reference_record("/nowhere", "hybrid27b", 4096, 256, 60)
    assert "measured shape 32b, asked for hybrid27b" in rec["error"] and "ms_per_step" not in rec
    assert reference_record("/nowhere", "32b", 4096, 256, 60)["ms_per_step"] == 195.3
