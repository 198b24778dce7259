"""The house rules a reviewer would otherwise check by hand: no module over 400 lines (the drafter module,
shipped as remote code, excepted), no function over 60 lines, no import of another module's `_private`
name, no mixin classes."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("common", "producer", "consumer", "tools", "dflash")
EXEMPT = {"common/drafter/dflash.py"}  # ships as one self-contained remote-code file


def _modules():
    for room in PACKAGE:
        for path in sorted((ROOT / room).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in EXEMPT:
                yield rel, path.read_text(encoding="utf-8")


def test_modules_and_functions_are_small():
    big = [(rel, n) for rel, src in _modules() if (n := len(src.splitlines())) > 400]
    long = [
        (rel, node.name, node.end_lineno - node.lineno + 1)
        for rel, src in _modules()
        for node in ast.walk(ast.parse(src))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert not big, f"modules over 400 lines: {big}"
    assert not long, f"functions over 60 lines: {long}"


def test_no_private_names_cross_modules_and_no_mixins():
    private, mixins = [], []
    for rel, src in _modules():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash"):
                private += [(rel, node.module, a.name) for a in node.names if a.name.startswith("_")]
            if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin"):
                mixins.append((rel, node.name))
    assert not private, f"imports of another module's private names: {private}"
    assert not mixins, f"mixin classes: {mixins}"
