"""Command-line flags generated from config dataclasses: each option is written once, as a field.

Why a small generator of our own rather than tyro or jsonargparse: the CLIs keep exactly the flags they
always had (``--no-compile`` for ``compile: bool = True``, ``--heartbeat-timeout`` for
``heartbeat_timeout_s``, comma lists such as ``--layer-ids 1,9,17``), which those libraries spell their
own way, and ``--help`` must not import anything heavy (tests/test_cli_help.py). This module is the
standard library only: ~150 lines against a new dependency.

A field becomes ``--field-name``; its type gives the parser (``int``, ``float``, ``str``, ``X | None``,
``bool`` as a switch, ``list[int]`` as a comma list); its attribute docstring (the string literal right
below the field, as in torchtitan's configs) is the help text; its default is the flag's default, shown by
:class:`DefaultsHelpFormatter`; a ``Literal`` type is its choices. ``field(metadata=flag(...))`` changes
what the field cannot say itself: another name, a positional, or leaving the field off the command line.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

from dflash.common.cli.help import DefaultsHelpFormatter

__all__ = ["Flag", "add_flags", "check_choices", "command_parser", "flag", "from_args", "int_list"]


@dataclass(frozen=True, kw_only=True)
class Flag:
    """How one config field appears on the command line (``field(metadata=flag(...))``)."""

    name: str | None = None
    """The option (``--heartbeat-timeout``), default ``--`` + the field name with dashes."""
    help: str | None = None
    """Help text when the field's docstring is not the right words for a command line."""
    metavar: str | None = None
    positional: bool = False
    negate: bool = False
    """A ``bool`` field defaulting to True becomes ``--no-<name>`` (store_false)."""
    cli: bool = True
    """False: the field is not a flag (the CLI fills it, or it is for library callers only)."""
    parse: Callable[[str], Any] | None = None
    """str -> value, instead of the type's own parser."""
    required: bool | None = None
    """Required on the command line (default: the field has no default)."""
    nargs: str | None = None
    """argparse ``nargs`` (e.g. "?" for an optional value or positional)."""
    const: Any = None
    """argparse ``const``: the value of ``--flag`` given without one (with ``nargs="?"``)."""


def flag(**kw: Any) -> dict[str, Flag]:
    """``metadata`` for ``dataclasses.field``: ``field(default=..., metadata=flag(name="--x"))``."""
    return {"flag": Flag(**kw)}


def int_list(text: str) -> list[int]:
    """'1,9,17' -> [1, 9, 17] (the parser of ``list[int]`` fields)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, e.g. 1,9,17, got {text!r}"
        ) from None


def _plain(doc: str) -> str:
    """A docstring as one line of plain help text (reST literals and double spaces removed)."""
    text = " ".join(doc.split())
    return re.sub(r"`+([^`]*)`+", r"\1", text).replace("%", "%%")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass and its bases: {field: text of the string below it}."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (frozen app): flags keep the names, lose the help
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = _plain(nxt.value.value)
    return docs


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _parser_of(tp: Any) -> Callable[[str], Any] | None:
    if tp in (int, float, str):
        return tp
    if typing.get_origin(tp) is list and typing.get_args(tp) == (int,):
        return int_list
    if typing.get_origin(tp) is typing.Literal:
        return str
    raise TypeError(f"no command-line parser for {tp!r}: give the field flag(parse=...) or flag(cli=False)")


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_choices(cfg: Any) -> None:
    """Raise ValueError, one line naming the field and its choices, when a ``Literal``-typed field of the
    dataclass instance ``cfg`` holds a value outside its type (None passes for ``Literal[...] | None``).

    Why: the ``Literal`` is the one list of choices; argparse checks flags against it (add_flags) and
    this checks library callers, so no config lists its choices twice (in the flag and in
    ``__post_init__``). Call it from ``__post_init__``."""
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        tp, optional = _unwrap_optional(hints[f.name])
        if typing.get_origin(tp) is not typing.Literal:
            continue
        value = getattr(cfg, f.name)
        allowed = typing.get_args(tp)
        if value not in allowed and not (optional and value is None):
            names = ", ".join(str(a) for a in allowed)
            raise ValueError(f"{type(cfg).__name__}.{f.name}={value!r}: must be one of {names}")


def _meta(f: dataclasses.Field) -> Flag:
    return f.metadata.get("flag") or Flag()


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    exclude: Iterable[str] = (),
    defaults: dict[str, Any] | None = None,
) -> None:
    """Add one flag per field of the dataclass ``cls`` (dest = the field name), in field order.

    ``exclude`` leaves fields out (the CLI fills them from other flags); ``defaults`` overrides a
    field's default on this command line only (e.g. the demo's smaller shapes)."""
    hints = _hints(cls)
    docs = field_docs(cls)
    skip = set(exclude)
    for f in dataclasses.fields(cls):
        meta = _meta(f)
        if f.name in skip or not meta.cli:
            continue
        default = (defaults or {}).get(f.name, _default(f))
        tp, _optional = _unwrap_optional(hints[f.name])
        kw: dict[str, Any] = {
            "dest": f.name,
            "help": meta.help or docs.get(f.name) or f.name.replace("_", " "),
        }
        name = meta.name or "--" + f.name.replace("_", "-")
        if tp is bool:
            if meta.negate or default is True:
                name = meta.name or "--no-" + f.name.replace("_", "-")
                parser.add_argument(name, action="store_false", default=True, **kw)
            else:
                parser.add_argument(name, action="store_true", default=False, **kw)
            continue
        kw["type"] = meta.parse or _parser_of(tp)
        if typing.get_origin(tp) is typing.Literal:  # the one list of choices (check_choices reads it too)
            kw["choices"] = list(typing.get_args(tp))
        if meta.metavar or meta.name:
            kw["metavar"] = meta.metavar or meta.name.lstrip("-").replace("-", "_").upper()
        if meta.nargs is not None:
            kw["nargs"] = meta.nargs
        if meta.const is not None:
            kw["const"] = meta.const
        if meta.positional:
            kw.pop("dest")
            if meta.nargs == "?":
                kw["default"] = default if default is not dataclasses.MISSING else None
            parser.add_argument(f.name, **kw)
            continue
        required = meta.required if meta.required is not None else default is dataclasses.MISSING
        if required:
            kw["required"] = True
        else:
            kw["default"] = default
        parser.add_argument(name, **kw)


def command_parser(prog: str, description: str, *configs: type) -> argparse.ArgumentParser:
    """A console script's parser: the shared help style (``DefaultsHelpFormatter``) and one flag per field
    of each config dataclass, in order. A command whose flags need more (``defaults=``, a subcommand)
    builds on the returned parser with ``add_flags``."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=DefaultsHelpFormatter
    )
    for cls in configs:
        add_flags(parser, cls)
    return parser


def from_args(cls: type, args: argparse.Namespace, **fixed: Any) -> Any:
    """An instance of ``cls`` from the parsed flags of ``add_flags(…, cls)``; ``fixed`` fills (or
    overrides) the fields that are not flags. ``__post_init__`` validates the whole as for any caller."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in fixed:
            values[f.name] = fixed[f.name]
        elif hasattr(args, f.name) and _meta(f).cli:
            values[f.name] = getattr(args, f.name)
    return cls(**values)
