"""The house rules a reviewer would otherwise check by hand.

Size is an alarm, not a rule: a module past 400 lines or a function past 60 is a question (does it do two
jobs?), answered either by splitting it by job or by a stated reason here; a reason for something no longer
that long is stale and fails too. Splitting one concern across files, or packing lines under
``# fmt: skip``, to get under a number makes the code harder to walk (docs/style.md).

Composition, not inheritance: no class has more than one base defined in this project (a class built from
two project classes reads attributes one of them set) unless a reason here allows it, and no class is a
mixin. No module imports another's ``_private`` name.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("common", "producer", "consumer", "tools", "dflash")
MODULE_LINES, FUNCTION_LINES = 400, 60

LONG_MODULES: dict[str, str] = {  # module -> why it stays one module past MODULE_LINES
    "common/drafter/dflash.py": "ships in every export as the drafter's remote code: all of its math in one "
    "self-contained file",
    "common/contract/spool.py": "the shard flow, one method per transition, plus the one-line methods that "
    "hand the records' and the scan's calls to those parts so that every caller keeps one Spool",
    "consumer/config.py": "the one config of the consumer process: every flag's field, default, help text "
    "and check, section by section, in the one file a user reads for them",
    "consumer/trainer.py": "the training loop and the order it builds its parts in, read top to bottom; each "
    "decision it delegates (saves, log lines, the agreement, the schedule) is a part of its own",
}
LONG_FUNCTIONS: dict[str, str] = {}  # "module::function" -> why it stays one function past FUNCTION_LINES
MANY_PROJECT_BASES: dict[str, str] = {}  # "module::Class" -> why it has more than one project base


def _modules() -> dict[str, ast.Module]:
    return {
        path.relative_to(ROOT).as_posix(): ast.parse(path.read_text(encoding="utf-8"))
        for room in PACKAGE
        for path in sorted((ROOT / room).rglob("*.py"))
    }


def _lines(rel: str) -> int:
    return len((ROOT / rel).read_text(encoding="utf-8").splitlines())


def long_functions(modules: dict[str, ast.Module]) -> dict[str, int]:
    return {
        f"{rel}::{node.name}": node.end_lineno - node.lineno + 1
        for rel, tree in modules.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > FUNCTION_LINES
    }


def _base_name(base: ast.expr) -> str | None:
    if isinstance(base, ast.Subscript):  # Generic[T], a parametrised base
        base = base.value
    return base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None


def classes_with_many_project_bases(modules: dict[str, ast.Module]) -> dict[str, list[str]]:
    """{"module::Class": its bases defined in the project} for each class with more than one."""
    ours = {n.name for tree in modules.values() for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    out = {}
    for rel, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [b for b in map(_base_name, node.bases) if b in ours]
                if len(bases) > 1:
                    out[f"{rel}::{node.name}"] = bases
    return out


def test_a_long_module_or_function_has_a_stated_reason():
    modules = _modules()
    big = {rel: n for rel in modules if (n := _lines(rel)) > MODULE_LINES}
    unexplained = {rel: n for rel, n in big.items() if rel not in LONG_MODULES}
    assert not unexplained, f"modules over {MODULE_LINES} lines (split by job, or say why here): {unexplained}"
    stale = sorted(set(LONG_MODULES) - set(big))
    assert not stale, f"LONG_MODULES names modules no longer over {MODULE_LINES} lines: {stale}"
    long = long_functions(modules)
    unexplained = {name: n for name, n in long.items() if name not in LONG_FUNCTIONS}
    assert not unexplained, f"functions over {FUNCTION_LINES} lines (split by job, or say why here): {unexplained}"
    stale = sorted(set(LONG_FUNCTIONS) - set(long))
    assert not stale, f"LONG_FUNCTIONS names functions no longer over {FUNCTION_LINES} lines: {stale}"


def test_no_class_has_two_project_bases_without_a_reason():
    found = classes_with_many_project_bases(_modules())
    unexplained = {name: bases for name, bases in found.items() if name not in MANY_PROJECT_BASES}
    assert not unexplained, f"classes built from several project classes (compose them instead): {unexplained}"
    stale = sorted(set(MANY_PROJECT_BASES) - set(found))
    assert not stale, f"MANY_PROJECT_BASES names classes that no longer have several project bases: {stale}"


def test_the_checkers_report_what_they_look_for():
    """The checkers themselves, on made-up modules: two project bases are reported whatever the class is
    named (a torch or stdlib base beside one project base is not), and a 61-line function is long."""
    fake = {
        "a.py": ast.parse("class Records: ...\nclass Scan: ...\nclass Spool(Records, Scan): ...\n"),
        "b.py": ast.parse("import torch\nfrom a import Scan\nclass Drafter(Scan, torch.nn.Module): ...\n"),
        "c.py": ast.parse("def f():\n" + "    x = 1\n" * 60),
    }
    assert classes_with_many_project_bases(fake) == {"a.py::Spool": ["Records", "Scan"]}
    assert long_functions(fake) == {"c.py::f": 61}


def test_no_private_names_cross_modules_and_no_mixins():
    private, mixins = [], []
    for rel, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash"):
                private += [(rel, node.module, a.name) for a in node.names if a.name.startswith("_")]
            if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin"):
                mixins.append((rel, node.name))
    assert not private, f"imports of another module's private names: {private}"
    assert not mixins, f"mixin classes: {mixins}"
