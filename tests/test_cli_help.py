"""Every console script's ``--help`` answers: each option has help and shows its default, plain text, no
placeholders, and no torch/transformers import before parsing (so ``--help`` stays well under 1 s).

The import check replaces a wall-time assertion: it does not depend on how loaded the box is, and it is
what made ``--help`` slow (importing torch takes seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
PLACEHOLDERS = ("currently the same", "TODO", "FIXME", "XXX")
# dflash-demo (tools/demo/demo.py) has another owner: its help fixes land with their change, not here.
NOT_YET: dict[str, str] = {}  # script -> why its help is not there yet (an xfail), empty when all are

# Runs in a fresh interpreter: spies on every parser main() parses with, calls main(["--help"]) and dumps
# each parser (sub-commands included) as JSON, plus whether torch/transformers got imported.
PROBE = r"""
import argparse, contextlib, importlib, io, json, sys
seen = []
_parse = argparse.ArgumentParser.parse_known_args
def _spy(self, *a, **kw):
    seen.append(self)
    return _parse(self, *a, **kw)
argparse.ArgumentParser.parse_known_args = _spy
def walk(p):
    yield p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from walk(sub)
mod, func = sys.argv[1].split(":")
code = "no exit"
with contextlib.redirect_stdout(io.StringIO()):
    try:
        getattr(importlib.import_module(mod), func)(["--help"])
    except SystemExit as e:
        code = e.code
parsers = []
for p in walk(seen[0]) if seen else ():
    fmt = p._get_formatter()
    parsers.append({
        "prog": p.prog,
        "help": p.format_help(),
        "actions": [
            {"name": "/".join(a.option_strings) or a.dest, "help": a.help,
             "shown": fmt._expand_help(a) if a.help else "",
             "quiet_default": a.default is None or a.default is False or a.default == argparse.SUPPRESS
                              or isinstance(a, argparse._StoreTrueAction | argparse._StoreFalseAction),
             "is_help": isinstance(a, argparse._HelpAction)}
            for a in p._actions
        ],
    })
print(json.dumps({"exit": code, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules),
                  "parsers": parsers}))
"""


@pytest.fixture(scope="module")
def probes() -> dict[str, dict]:
    """One subprocess per console script (a fresh sys.modules each), run once for all tests."""
    out = {}
    for name, entry in SCRIPTS.items():
        r = subprocess.run(
            [sys.executable, "-c", PROBE, entry], capture_output=True, text=True, timeout=60, cwd=ROOT
        )
        assert r.returncode == 0, f"{name}: {r.stderr.strip()[-2000:]}"
        out[name] = json.loads(r.stdout)
    return out


def _owned(name: str) -> None:
    if name in NOT_YET:
        pytest.xfail(NOT_YET[name])


@pytest.mark.parametrize("name", sorted(SCRIPTS))
@pytest.mark.pipeline
def test_help_exits_0_without_torch(probes, name):
    p = probes[name]
    assert p["exit"] == 0, f"{name} --help exited {p['exit']}"
    assert p["parsers"], f"{name}: main() parsed no arguments"
    assert p["heavy"] == [], f"{name} --help imported {p['heavy']} before parsing: move it into the function"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
@pytest.mark.pipeline
def test_every_option_has_help_and_default(probes, name):
    for parser in probes[name]["parsers"]:
        for a in parser["actions"]:
            if a["is_help"]:
                continue
            assert a["help"] and a["help"].strip(), f"{parser['prog']} {a['name']}: no help text"
            if not a["quiet_default"] and a["name"].startswith("-"):
                assert "default" in a["shown"], f"{parser['prog']} {a['name']}: default not shown"
            assert "default: None" not in a["shown"], f"{parser['prog']} {a['name']}: 'default: None'"
            # a switch is off unless given: "(default: True)" on --no-compile read as "on by default"
            assert "default: True" not in a["shown"], f"{parser['prog']} {a['name']}: 'default: True'"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
@pytest.mark.pipeline
def test_help_is_plain_text(probes, name):
    _owned(name)
    for parser in probes[name]["parsers"]:
        text = parser["help"]
        assert "`" not in text, f"{parser['prog']}: markup in --help"
        for word in PLACEHOLDERS:
            assert word not in text, f"{parser['prog']}: placeholder {word!r} in --help"


def test_export_dtype_choices_match_the_exporter():
    """the export config lists the dtype names without importing torch; they must be the exporter's."""
    from dflash.tools.export.config import DTYPE_NAMES
    from dflash.tools.export.run import DTYPES

    assert sorted(DTYPE_NAMES) == sorted(DTYPES)


def test_formatter_skips_noise_defaults():
    import argparse

    from dflash.common.cli.help import DefaultsHelpFormatter, plain_text

    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--n", type=int, default=3, help="count")
    p.add_argument("--flag", action="store_true", help="a flag")
    p.add_argument("--no-thing", dest="thing", action="store_false", default=True, help="no thing")
    p.add_argument("--opt", default=None, help="optional")
    p.add_argument("--m", default=2, help="m (default: two)")
    text = " ".join(p.format_help().split())
    assert "count (default: 3)" in text
    assert "a flag (default" not in text and "optional (default" not in text
    assert "no thing (default" not in text
    assert "m (default: two)" in text and "two) (default" not in text
    assert plain_text("``dflash-x``: does `y`.\n\nmore") == "dflash-x: does y."


def test_positional_arguments_go_anywhere():
    """``dflash-export STORE --run R --step N OUT``: an optional positional after the flags is taken (plain
    ``parse_args`` said ``unrecognized arguments: OUT``)."""
    from dflash.tools.export import cli

    args = cli.build_parser().parse_intermixed_args(["s3://b/p", "--run", "r", "--step", "3", "out"])
    assert (args.checkpoint, args.run, args.step, args.out_dir) == ("s3://b/p", "r", 3, "out")
    with pytest.raises(SystemExit):  # main parses the same way: a missing store is its one-line error
        cli.main(["/nonexistent-store", "--run", "r", "--step", "3", "/nonexistent-out"])


def test_a_no_switch_says_what_giving_it_does():
    """A ``--no-X`` switch's help says what giving it does, not the field's docstring, which describes the
    default (``--no-train-reasoning`` read "train the reasoning of assistant turns ..." first). In-process:
    the two parsers that have such switches."""
    import argparse

    from dflash.common.cli.flags import field_docs
    from dflash.common.compile import CompileConfig
    from dflash.common.target.data import DataConfig
    from dflash.consumer.cli import build_parser as consume_parser
    from dflash.consumer.config import TrainConfig
    from dflash.producer.cli import build_parser as produce_parser
    from dflash.producer.config import BucketConfig, LaunchConfig, ProducerConfig

    docs: dict[str, str] = {}
    for cls in (CompileConfig, DataConfig, TrainConfig, BucketConfig, LaunchConfig, ProducerConfig):
        docs |= field_docs(cls)
    switches = [
        a
        for parser in (produce_parser(), consume_parser())
        for a in parser._actions
        if isinstance(a, argparse._StoreFalseAction)
    ]
    assert "--no-train-reasoning" in {o for a in switches for o in a.option_strings}
    for a in switches:
        assert a.help != docs.get(a.dest), f"{a.option_strings[0]}: its help describes the default"
    reasoning = next(a for a in switches if "--no-train-reasoning" in a.option_strings)
    assert reasoning.help.startswith("render each row as if the target had answered without thinking")
