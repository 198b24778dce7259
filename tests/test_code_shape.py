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
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("common", "producer", "consumer", "tools", "dflash")
MODULE_LINES, FUNCTION_LINES = 400, 60

LONG_MODULES: dict[str, str] = {  # module -> why it stays one module past MODULE_LINES
    "common/drafter/dflash.py": "ships in every export as the drafter's remote code: all of its math in one "
    "self-contained file",
    "common/contract/spool.py": "the shard flow, one method per transition, plus the one-line methods that "
    "hand the records' and the scan's calls to those parts so that every caller keeps one Spool",
    "common/drafter/serving_check.py": "one check per row of docs/export-and-eval.md's table of what each "
    "public loader reads, in the table's order, so the two are read side by side",
    "consumer/config.py": "the one config of the consumer process: every flag's field, default, help text "
    "and check, section by section, in the one file a user reads for them",
    "consumer/trainer.py": "the training loop and the order it builds its parts in, read top to bottom; each "
    "decision it delegates (saves, log lines, the agreement, the schedule) is a part of its own",
}
LONG_FUNCTIONS: dict[str, str] = {}  # "module::function" -> why it stays one function past FUNCTION_LINES
MANY_PROJECT_BASES: dict[str, str] = {}  # "module::Class" -> why it has more than one project base
WRITABLE_PARTS: dict[str, str] = {}  # "module::Class.attr" -> why that class may write into the part it holds
PROCESSES = ("producer", "consumer")
MUTATORS = {"update", "append", "extend", "add", "pop", "clear", "setdefault", "remove", "discard", "insert"}


@functools.cache  # parsed once per test file: every rule reads the same, unchanged trees
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


def _project_classes(modules: dict[str, ast.Module]) -> set[str]:
    return {n.name for tree in modules.values() for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def _records(modules: dict[str, ast.Module]) -> set[str]:
    """The project's dataclasses: records of data (counters, a config), a part's own state when it makes
    one."""
    return {
        n.name
        for tree in modules.values()
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef)
        and any(_base_name(d.func if isinstance(d, ast.Call) else d) == "dataclass" for d in n.decorator_list)
    }


def _parts(cls: ast.ClassDef, ours: set[str], records: set[str]) -> set[str]:
    """The attributes of ``cls`` that hold another part: ``self.x = ProjectClass(...)`` of a class that is
    not a plain record, or ``self.x = x`` of a parameter typed with a project class (handed in: not its
    own)."""
    typed = {
        a.arg
        for f in cls.body
        if isinstance(f, ast.FunctionDef)
        for a in (*f.args.args, *f.args.kwonlyargs)
        if a.annotation is not None
        and {n.id for n in ast.walk(a.annotation) if isinstance(n, ast.Name)} & ours
    }
    pairs = []  # (target, value), tuple assignments unpacked: self.a, self.b = a, b
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += zip(t.elts, node.value.elts, strict=False)
                else:
                    pairs.append((t, node.value))
    parts = set()
    for t, value in pairs:
        held = (isinstance(value, ast.Call) and _base_name(value.func) in ours - records) or (
            isinstance(value, ast.Name) and value.id in typed
        )
        if held and isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self":
            parts.add(t.attr)
    return parts


def writes_into_parts(modules: dict[str, ast.Module]) -> list[str]:
    """``self.part.field = ...`` (or ``+=``), and ``self.part.field.update(...)``-like mutations, in the
    processes' classes: a part that writes another part's fields."""
    ours, records = _project_classes(modules), _records(modules)
    found = []
    for rel, tree in modules.items():
        if not rel.startswith(PROCESSES):
            continue
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            parts = {p for p in _parts(cls, ours, records) if f"{rel}::{cls.name}.{p}" not in WRITABLE_PARTS}
            for node in ast.walk(cls):
                targets = node.targets if isinstance(node, ast.Assign) else []
                targets = [node.target] if isinstance(node, ast.AugAssign) else targets
                call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                if call and node.func.attr in MUTATORS:
                    targets = [node.func.value]
                for t in targets:
                    chain = []
                    while isinstance(t, ast.Attribute):
                        chain.append(t.attr)
                        t = t.value
                    if getattr(t, "id", None) == "self" and len(chain) >= 2 and chain[-1] in parts:
                        what = "self." + ".".join(reversed(chain)) + (f".{node.func.attr}()" if call else "")
                        found.append(f"{rel}::{cls.name} line {node.lineno}: {what}")
    return sorted(found)


def test_no_part_writes_another_parts_fields():
    """A part calls another part's method (``heartbeat.update(...)``); it never sets or mutates the other's
    fields (the interval logger used to update a dict inside the shard feed)."""
    found = writes_into_parts(_modules())
    assert not found, "writes into another part's fields:\n" + "\n".join(found)


def test_a_long_module_or_function_has_a_stated_reason():
    modules = _modules()
    big = {rel: n for rel in modules if (n := _lines(rel)) > MODULE_LINES}
    unexplained = {rel: n for rel, n in big.items() if rel not in LONG_MODULES}
    assert not unexplained, (
        f"modules over {MODULE_LINES} lines (split by job, or say why here): {unexplained}"
    )
    stale = sorted(set(LONG_MODULES) - set(big))
    assert not stale, f"LONG_MODULES names modules no longer over {MODULE_LINES} lines: {stale}"
    long = long_functions(modules)
    unexplained = {name: n for name, n in long.items() if name not in LONG_FUNCTIONS}
    assert not unexplained, (
        f"functions over {FUNCTION_LINES} lines (split by job, or say why here): {unexplained}"
    )
    stale = sorted(set(LONG_FUNCTIONS) - set(long))
    assert not stale, f"LONG_FUNCTIONS names functions no longer over {FUNCTION_LINES} lines: {stale}"


def test_no_class_has_two_project_bases_without_a_reason():
    found = classes_with_many_project_bases(_modules())
    unexplained = {name: bases for name, bases in found.items() if name not in MANY_PROJECT_BASES}
    assert not unexplained, (
        f"classes built from several project classes (compose them instead): {unexplained}"
    )
    stale = sorted(set(MANY_PROJECT_BASES) - set(found))
    assert not stale, f"MANY_PROJECT_BASES names classes that no longer have several project bases: {stale}"


FMT_SKIPS_AT_MOST = 10


def test_fmt_skip_is_rare_and_says_why():
    """``ruff format`` decides the layout of a line (ops/test.sh checks it); a ``# fmt: skip`` is for the
    rare table a formatter would make unreadable, at most FMT_SKIPS_AT_MOST in the tree, each with a
    comment on the line above saying why."""
    skips = []
    for path in sorted(p for room in (*PACKAGE, "tests", "ops") for p in (ROOT / room).rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if line.rstrip().endswith("# fmt: skip"):
                skips.append((path.relative_to(ROOT).as_posix(), i + 1, lines[i - 1].strip() if i else ""))
    assert len(skips) <= FMT_SKIPS_AT_MOST, (
        f"{len(skips)} '# fmt: skip' (at most {FMT_SKIPS_AT_MOST}): {skips}"
    )
    unexplained = [f"{rel}:{n}" for rel, n, above in skips if not above.startswith("#")]
    assert not unexplained, f"'# fmt: skip' without a reason on the line above: {unexplained}"


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
    parts = {
        "consumer/a.py": ast.parse(
            "class Feed: ...\nclass Log:\n    def __init__(self, feed: Feed):\n        self.feed = feed\n"
            "        self.mine = Feed()\n        self.counts = {}\n"
            "    def log(self):\n        self.feed.counters.update(step=1)\n        self.mine.n = 2\n"
            "        self.counts.update(x=1)\n        self.feed.flush()\n"
        )
    }
    assert writes_into_parts(parts) == [
        "consumer/a.py::Log line 8: self.feed.counters.update()",
        "consumer/a.py::Log line 9: self.mine.n",
    ]


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
