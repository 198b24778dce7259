"""The consumer is configured as the producer is: one config per process, built from the flags and validated
before anything is touched; the compile switches are the one ``CompileConfig`` both processes share; a
choice is listed once, as a ``Literal``, wherever the flags come from."""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import io
import tomllib
import typing
from pathlib import Path

import pytest

from dflash.common.cli.flags import Flag
from dflash.common.compile import CompileBackend, CompileConfig
from dflash.consumer import cli as consume_cli
from dflash.consumer.config import SECTIONS, ConsumeConfig, ProcessConfig, TrainConfig, config_of
from dflash.producer import cli as produce_cli
from dflash.producer.config import ProduceConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
SELF_CONTAINED = {
    "common/drafter/dflash.py": "ships as an export's remote code (torch and transformers only): its "
    "sampling settings check their own choices, which dflash-eval's config (imported before torch) "
    "cannot import",
}


# flags each refused by the config (one line, exit 2), before the spool or the store is looked at
BAD_FLAGS = {
    "--save-every 0": "save-every must be a positive integer, got 0",
    "--keep-last 0": "keep-last must be a positive integer, got 0",
    "--bucket widest": "bucket must be random, oldest, fullest or a bucket number, got 'widest'",
    "--lr -1": "lr must be > 0, got -1.0",
    "--warmup-ratio 1": "warmup-ratio must be in [0, 1), got 1.0",
    "--eval-budget 0": "eval-budget must be in (0, 1], got 0.0",
    "--num-layers 2 --draft-layer-types sliding,full,full": (
        "draft-layer-types names 3 layers, num-layers is 2"
    ),
    "--context-tokens 0": "context-tokens must be a positive integer, got 0",
    "--profile-steps 40": "profile-steps must be FIRST:COUNT",
    "--max-steps 0": "max-steps must be >= 1, got 0",
    "--gpu seven": "--gpu must be a GPU index or 'cpu', got 'seven'",
    "--loss-impl liger": "loss-impl liger needs a CUDA device",
}


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else ["<absent>"]


@pytest.mark.parametrize("flags", sorted(BAD_FLAGS))
def test_an_invalid_flag_exits_2_with_one_line_and_touches_neither_spool_nor_store(tmp_path, capsys, flags):
    spool = tmp_path / "spool"
    spool.mkdir()  # there already (an empty folder a user made): the launch would bind it at once
    store = tmp_path / "store"
    argv = ["--gpu", "cpu", "--spool", str(spool), "--target", str(tmp_path / "target")]
    argv += ["--checkpoint", str(store), "--spool-wait-s", "0", *flags.split()]
    with pytest.raises(SystemExit) as exit_info:
        consume_cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash-consume: error: "), err
    assert BAD_FLAGS[flags] in err[0]
    assert _tree(spool) == [] and _tree(store) == ["<absent>"], "a bad flag touched the spool or the store"


def test_a_choice_argparse_refuses_exits_2_and_touches_nothing(tmp_path, capsys):
    spool = tmp_path / "spool"
    spool.mkdir()
    argv = ["--gpu", "cpu", "--spool", str(spool), "--target", str(tmp_path), "--resume", "maybe"]
    with pytest.raises(SystemExit) as exit_info:
        consume_cli.main(argv)
    assert exit_info.value.code == 2
    assert "invalid choice: 'maybe'" in capsys.readouterr().err
    assert _tree(spool) == []


def test_the_flags_parse_into_one_consume_config_with_each_section_its_own():
    args = consume_cli.build_parser().parse_intermixed_args(
        [
            "--gpu",
            "3",
            "--spool",
            "s",
            "--target",
            "t",
            "--checkpoint",
            "s3://b/p",
            "--save-every",
            "7",
            "--bucket",
            "2",
            "--block-size",
            "8",
            "--context-tokens",
            "512",
            "--lr",
            "1e-3",
            "--log-every",
            "5",
            "--gc-mode",
            "python",
            "--no-compile",
            "--compile-backend",
            "aot_eager",
        ]
    )
    cfg = config_of(args)
    assert isinstance(cfg, ConsumeConfig) and cfg.process == ProcessConfig(gpu="3")
    train = cfg.train
    assert (train.spool, train.target, train.run) == ("s", "t", None)  # the run: the spool's, at launch
    assert (train.checkpoints.store, train.checkpoints.save_every) == ("s3://b/p", 7)
    assert train.feed.claim_bucket == 2 and train.drafter.block_size == 8
    assert train.step.context_tokens == 512 and train.optim.lr == 1e-3 and train.logs.log_every == 5
    assert train.host.gc_mode == "python"
    assert type(train.compile_options) is CompileConfig and train.compile_options.compile is False
    assert train.compile_options.resolved_backend("cuda") == "eager"  # --no-compile wins
    assert not hasattr(train, "device"), "the device is decided at launch, not a flag"


def _config_classes(root: type) -> list[type]:
    """A config dataclass and the dataclasses its fields hold, depth first."""
    out = [root]
    for f in dataclasses.fields(root):
        tp = typing.get_type_hints(root)[f.name]
        if dataclasses.is_dataclass(tp):
            out += _config_classes(tp)
    return out


def _flag_fields(root: type) -> list[str]:
    return [
        f.name
        for cls in _config_classes(root)
        for f in dataclasses.fields(cls)
        if not dataclasses.is_dataclass(typing.get_type_hints(cls)[f.name])
        and (f.metadata.get("flag") or Flag()).cli
    ]


def _dests(parser: argparse.ArgumentParser) -> list[str]:
    return [a.dest for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize(
    "parser, config", [(consume_cli.build_parser, ConsumeConfig), (produce_cli.build_parser, ProduceConfig)]
)
def test_one_config_per_process_is_the_whole_command_line(parser, config):
    """Every option of the process's command line is one field of its one config tree, and each flat name
    is one field (the flags are flat, so two sections never share a name)."""
    fields = _flag_fields(config)
    assert len(fields) == len(set(fields)), f"a flag name in two sections: {fields}"
    assert sorted(_dests(parser())) == sorted(fields)


def test_both_processes_take_the_compile_switches_from_the_shared_compile_config():
    producer = [c for c in _config_classes(ProduceConfig) if issubclass(c, CompileConfig)]
    consumer = [c for c in _config_classes(ConsumeConfig) if issubclass(c, CompileConfig)]
    assert len(producer) == 1 and consumer == [CompileConfig]
    for cls in (*_config_classes(ProduceConfig), *_config_classes(ConsumeConfig)):
        own = set(vars(cls).get("__annotations__", {}))
        assert cls is CompileConfig or not own & {"compile", "compile_backend"}, (
            f"{cls.__name__} redefines them"
        )
    for build in (consume_cli.build_parser, produce_cli.build_parser):
        action = next(a for a in build()._actions if "--compile-backend" in a.option_strings)
        assert tuple(action.choices) == typing.get_args(CompileBackend)
    assert SECTIONS["compile_options"] is CompileConfig and "compile" not in {
        f.name for f in dataclasses.fields(TrainConfig)
    }


def _parsers(entry: str) -> list[argparse.ArgumentParser]:
    """Every parser a console script's main() parses with, its sub-commands' included."""
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
    out, todo = [], seen[:1]
    while todo:
        p = todo.pop()
        out.append(p)
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += list(a.choices.values())
    return out


def _string_collections(tree: ast.AST) -> list[tuple[int, frozenset[str]]]:
    """(line, strings) of every tuple, list or set literal of two or more strings outside a
    ``Literal[...]``."""
    literal_args: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and getattr(node.value, "id", getattr(node.value, "attr", "")) == "Literal"
        ):
            literal_args |= {id(n) for n in ast.walk(node.slice)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple | ast.List | ast.Set) and id(node) not in literal_args:
            values = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(values) >= 2 and len(values) == len(node.elts):
                out.append((node.lineno, frozenset(values)))
    return out


def test_no_choice_is_listed_twice():
    """Every command's choices come from a ``Literal`` (argparse offers them, ``check_choices`` refuses the
    rest from a library caller): no config field spells its choices in ``flag(choices=...)``, and no
    module repeats a command's choice list in a tuple, list or set of its own (an ``in ("auto", "none")``
    check beside the flag is the list written twice)."""
    choice_sets = {}
    for entry in SCRIPTS.values():
        for parser in _parsers(entry):
            for a in parser._actions:
                if a.choices and not isinstance(a, argparse._SubParsersAction):
                    choice_sets[frozenset(map(str, a.choices))] = f"{parser.prog} {a.option_strings[0]}"
    assert len(choice_sets) >= 5, "the records are not being read"
    twice = []
    for folder in ("common", "producer", "consumer", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() in SELF_CONTAINED:
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "flag":
                    if any(k.arg == "choices" for k in node.keywords):
                        twice.append(f"{path.relative_to(ROOT)}:{node.lineno} flag(choices=...)")
            for line, values in _string_collections(tree):
                if values in choice_sets:
                    twice.append(f"{path.relative_to(ROOT)}:{line} lists {choice_sets[values]}'s choices")
    assert not twice, "choices written twice:\n" + "\n".join(twice)
