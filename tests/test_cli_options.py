"""Every console script keeps its options: the flags, defaults, choices and required-ness of each option
equal the list recorded when the flags were still written by hand (tests/data/cli_options.json, taken
from main at 5cf9171 before the CLIs were generated from the config dataclasses). An option added since is
listed in ADDED with the change that added it, so a flag can never disappear or change its default
unnoticed. A console script added since (dflash-regenerate) is recorded in the same file with the change that
adds it."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
RECORDED = json.loads((ROOT / "tests" / "data" / "cli_options.json").read_text())
ADDED: dict[str, dict[str, str]] = {  # prog -> {option: why it was added}
    "dflash-produce": {
        "--no-compile": "the target trunk is torch.compiled on CUDA by default; this keeps it eager",
        "--compile-backend": "auto = inductor on CUDA, eager on the CPU (as the consumer's)",
        "--compile-scope": "compile each decoder layer (default) or the whole truncated trunk",
        "--compile-shapes": "one dynamic graph (default) or one static graph per bucket shape",
        "--no-train-reasoning": "chat data: assistant reasoning_content is trained by default; this renders rows without it",
        "--compile-timeout-s": "the compiled trunk's warm-up is bounded: past it, the eager path with one warning line",
        "--target-precision": "an FP8 target (e4m3 linears, torch._scaled_mm): published FP8 checkpoints, or quantized at load",
        "--fp8-fallback": "where FP8 matmuls do not run: emulate FP8's numbers (one line) or refuse (exit 2)",
    },
    "dflash-plan": {"--bench": "plan each target shape from pipeline_bench / producer_bench figures"},
    "dflash-consume": {
        "--draft-layer-types": "sliding-window draft layers (auto: the public layout for hybrid targets)",
        "--sliding-window": "the window of the sliding draft layers",
        "--loss-impl": "chunked (default) or liger's one-pass Triton kernel; the "
        "compiled whole-graph 'fused' choice was removed (0.73x the reference step on the H200, RESULTS.md)",
        "--gc-mode": "Python's collector frozen after warm-up and run at log lines only (interval)",
        "--no-expandable-segments": "the CUDA caching allocator's expandable segments (on by default)",
        "--moment-dtype": "AdamW's moments under --precision bf16sr: bfloat16 (auto) or float32",
        "--decode-threads": "zarr's chunk-decoding threads in the training process",
        "--profile-steps": "torch.profiler kernel table of a few steps, written to the run dir",
        "--spool-wait-s": "a consumer started before its producers waits for the spool (bounded), not exit 2 at once",
        "--outage-saves": "a store outage is trained through for this many failed saves, then the state goes to local disk",
        "--outage-minutes": "the same bound in minutes since the first failed save",
        "--fallback-dir": "where the state goes when the store refuses it (the same command uploads it later)",
        "--resume-changes": "a resume under another drafter setting than the checkpoint's is refused unless named here",
        "--drafter-arch": "DFlash2 drafters (dynamic block convolutions, candidate selector) beside DFlash",
        "--selector-loss-alpha": "DFlash2: the selector cross-entropy's weight",
        "--selector-warmup-ratio": "DFlash2: the steps with the selector loss at weight 0",
        "--selector-ramp-ratio": "DFlash2: the steps over which its weight then rises to the alpha",
    },
    "dflash-eval": {
        "--temperature": "lossless speculative rejection sampling",
        "--top-p": "nucleus sampling with --temperature",
        "--draft-sampling": "drafts greedy (one-hot q) or sampled from the drafter",
        "--seed": "repeatable sampled evaluations",
        "--force": "evaluate a target whose weights differ from the drafter's",
    },
    "dflash-demo": {
        "--codec": "the shards' codec (fp8 or bf16): the demo's held-out τ compares them",
        "--seed": "the drafter's seed: the demo's τ over several seeds",
    },
    "dflash-regenerate": {
        "--max-connection-failures": "a server gone mid-run stops the run with one line naming it, not row after row",
    },
    "dflash-export": {
        "--check": "validate any drafter folder against what vLLM, SGLang and transformers read",
        "--target": "where the tokenizer files come from when the recorded target is not here",
    },
}
# prog -> {option: why it was removed}: once added (ADDED), measured, and taken out again
REMOVED: dict[str, dict[str, str]] = {
    "dflash-consume": {
        "--data-workers": "the data path in a spawned worker process measured 0.86x the reference "
        "step against the in-thread path's 1.04x (H200, 32B-class real loop, RESULTS.md); no bug found to explain it",
    },
}
SUBCOMMANDS_ADDED = {
    "dflash-spool gc": "list and remove abandoned spools",
    "dflash-spool free": "a stopped or failed run's shards freed (ops/run_all.sh)",
    "dflash-spool audit": "the exactly-once audit of a run's sample ledgers, for users (tests had their own)",
}
# prog -> {option: (what it is now, why it changed)}: a deliberate change of a recorded option
CHANGED: dict[str, dict[str, tuple[dict, str]]] = {
    "dflash-produce": {
        "--writer-threads": (
            {"default": "None", "choices": None, "required": False, "kind": "_StoreAction"},
            "default sized from the cores per GPU (producer/config.py writer_threads_for), 2 to 6",
        ),
    },
    "dflash-consume": {
        "--block-size": (
            {"default": "None", "choices": None, "required": False, "kind": "_StoreAction"},
            "per --drafter-arch: 16 for dflash (as before), 8 for dflash2 (the public DFlash2 recipes)",
        ),
        "--num-anchors": (
            {"default": "None", "choices": None, "required": False, "kind": "_StoreAction"},
            "per --drafter-arch: 256 for dflash (as before), 512 for dflash2 (the public DFlash2 recipes)",
        ),
        "--compile-backend": (
            {
                "default": "'auto'",
                "choices": ["aot_eager", "auto", "eager", "inductor"],
                "required": False,
                "kind": "_StoreAction",
            },
            "auto = inductor on CUDA, eager on the CPU (same CPU step time, no cold C++ build)",
        ),
        "--fill-wait-s": (
            {"default": "30.0", "choices": None, "required": False, "kind": "_StoreAction"},
            "a stream waits for a full pool while a producer produces (costs no throughput)",
        ),
        "--min-split-tokens": (
            {"default": "32", "choices": None, "required": False, "kind": "_StoreAction"},
            "99 % fill at 1024 and 4096 tokens (256 left up to a quarter of a 1024 stream empty)",
        ),
        "--precision": (
            {
                "default": "'auto'",
                "choices": ["amp", "auto", "bf16", "bf16sr", "fp32", "mixed"],
                "required": False,
                "kind": "_StoreAction",
            },
            "mixed (bf16 weights, fp32 master in the optimizer); bf16sr (bf16 weights, stochastic-rounding AdamW)",
        ),
    },
    "dflash-export": {
        "checkpoint": (
            {"default": "None", "choices": None, "required": False, "kind": "_StoreAction"},
            "optional, as --check FOLDER takes none (without --check it is still needed: exit 2)",
        ),
        "out_dir": (
            {"default": "None", "choices": None, "required": False, "kind": "_StoreAction"},
            "optional, as --check FOLDER takes none (without --check it is still needed: exit 2)",
        ),
    },
}


def _parsers(entry: str) -> dict[str, argparse.ArgumentParser]:
    """{prog: parser} of a console script, sub-commands included, from what its main() parses with."""
    seen: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_known_args

    def spy(self, *a, **kw):
        seen.append(self)
        return real(self, *a, **kw)

    mod, func = entry.split(":")
    argparse.ArgumentParser.parse_known_args = spy
    try:
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit):
            getattr(importlib.import_module(mod), func)(["--help"])
    finally:
        argparse.ArgumentParser.parse_known_args = real
    out: dict[str, argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser, prog: str) -> None:
        out[prog] = p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, f"{prog} {name}")

    walk(seen[0], entry_name(entry))
    return out


def entry_name(entry: str) -> str:
    return next(name for name, e in SCRIPTS.items() if e == entry)


SWITCHES = ("_StoreTrueAction", "_StoreFalseAction")


def normalized(opt: dict) -> dict:
    """A switch is a switch: ``--no-compile`` as store_true (dest no_compile, default False) or as
    store_false (dest compile, default True) is the same option to a user."""
    return {"kind": "switch"} if opt["kind"] in SWITCHES else opt


def options(p: argparse.ArgumentParser) -> dict[str, dict]:
    return {
        (a.option_strings or [a.dest])[0]: normalized(
            {
                "default": repr(a.default),
                "choices": sorted(map(str, a.choices)) if a.choices else None,
                "required": bool(a.required),
                "kind": type(a).__name__,
            }
        )
        for a in p._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
    }


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_options_are_the_recorded_ones(name):
    parsers = _parsers(SCRIPTS[name])
    recorded = {prog: opts for prog, opts in RECORDED.items() if prog.split()[0] == name}
    new = sorted(set(parsers) - set(recorded) - set(SUBCOMMANDS_ADDED))
    assert not new and set(recorded) <= set(parsers), f"{name}: sub-commands changed: {sorted(parsers)}"
    parsers = {prog: p for prog, p in parsers.items() if prog in recorded}
    for prog, parser in parsers.items():
        now = options(parser)
        lost = sorted(set(recorded[prog]) - set(now))
        assert not lost, f"{prog}: options lost: {lost}"
        new = sorted(set(now) - set(recorded[prog]) - set(ADDED.get(prog, {})))
        assert not new, f"{prog}: options added without an entry in ADDED: {new}"
        for opt, want in recorded[prog].items():
            if opt in CHANGED.get(prog, {}):
                want = CHANGED[prog][opt][0]
            assert now[opt] == normalized(want), f"{prog} {opt}: {now[opt]} != recorded {want}"


def test_added_options_exist():
    """ADDED names only options that are there (a stale entry would hide a later loss)."""
    for prog, opts in ADDED.items():
        name = prog.split()[0]
        now = options(_parsers(SCRIPTS[name])[prog])
        assert set(opts) <= set(now), f"{prog}: {sorted(set(opts) - set(now))} listed in ADDED but absent"


def test_removed_options_are_gone():
    """REMOVED names options a console script no longer takes (one coming back needs an entry in ADDED)."""
    for prog, opts in REMOVED.items():
        now = options(_parsers(SCRIPTS[prog.split()[0]])[prog])
        back = sorted(set(opts) & set(now))
        assert not back, f"{prog}: {back} listed in REMOVED but present"
