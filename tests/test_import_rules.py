"""The layer rules of docs/architecture.md, enforced: which room may import which, no import cycle between
modules, and function-local imports only where something forces them.

Every ``import`` of a ``dflash`` module anywhere in a module counts, function-local ones included: a lazy
import hides an arrow, it does not remove it.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "common": "dflash.common",
    "producer": "dflash.producer",
    "consumer": "dflash.consumer",
    "tools": "dflash.tools",
}
LIBRARY = {
    "common.redact",
    "common.fault",
    "common.child_process",
    "common.compile",
    "common.metrics",
    "common.cli",
    "common.contract",
    "common.checkpoints",
    "common.drafter",
    "common.target",
}
# room -> the rooms it may import (besides itself); docs/architecture.md draws the same arrows
ALLOWED: dict[str, set[str]] = {
    "common.redact": set(),
    "common.metrics": set(),
    "common.child_process": set(),
    "common.fault": set(),
    "common.compile": {"common.cli"},
    "common.cli": {"common.redact"},
    "common.contract": {"common.redact", "common.cli"},
    "common.checkpoints": {"common.redact", "common.cli", "common.contract"},
    "common.drafter": {"common.contract"},
    "common.target": {"common.redact", "common.cli", "common.contract", "common.drafter"},
    "producer": LIBRARY,
    "consumer": LIBRARY,
    "tools": LIBRARY | {"producer", "consumer"},
}
# modules allowed function-local imports, and why (anything else imports at the top)
LOCAL_IMPORTS_OK = {
    "dflash.producer.cli": "parses its flags before importing the launch (transformers, datasets, torch)",
    "dflash.consumer.cli": "parses its flags before importing torch and the trainer",
    "dflash.consumer.launch": "torch only once CUDA_VISIBLE_DEVICES names the process's one GPU",
    "dflash.tools.eval.cli": "parses its flags before importing torch",
    "dflash.tools.export.cli": "parses its flags before importing torch",
    "dflash.tools.regenerate.cli": "parses its flags before importing torch and transformers",
    "dflash.tools.demo.assets": "dflash-regenerate's engine (it imports the producer's launch) only to build the assets",
    "dflash.tools.demo.cli": "parses its flags before importing torch, transformers and boto3",
    "dflash.tools.spool.cli": "torch (the checkpoint's trained set) only for `audit --checkpoint`",
    "dflash.tools.spool.view": "zarr only for `inspect`",
    "dflash.tools.status.cli": "matplotlib only with --plots",
    "dflash.common.contract.spool": "the spool never imports zarr or torch; eval shards' sample ids only in eval_sample_ids",
    "dflash.common.checkpoints.store": "s3.py imports boto3: only when an S3 store is opened",
    "dflash.common.compile": "the CLIs build CompileConfig before parsing: torch._dynamo only in the helper that imports it",
    "dflash.common.target.data": "DataConfig is imported by the producer's CLI before parsing",
    "dflash.common.target.head": "the drafter module (transformers' Qwen3 model, torch._dynamo) only where a head is built: dflash-produce's parent reads the fingerprint alone",
    "dflash.producer.config": "imported by the CLI before parsing: torch only in Worker.torch_dtype",
    "dflash.consumer.config": "imported by the CLI before parsing: torch only in OptimConfig.param_dtype",
    "dflash.producer.supervisor": "the worker entry runs in a spawned child: its imports are the child's",
    "dflash.consumer.interval_log": "wandb (seconds to import) only for a run that logs to it",
    "dflash.common.drafter.loss": "liger-kernel and Triton (CUDA only, optional) only for --loss-impl liger",
}


@functools.cache  # parsed once per test file: every rule reads the same, unchanged trees
def _modules() -> dict[str, ast.Module]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            name = ".".join([package, *rel.parts]).removesuffix(".__init__")
            out[name] = ast.parse(path.read_text())
    return out


def room(module: str) -> str:
    """dflash.common.drafter.model -> common.drafter; dflash.common.metrics -> common.metrics."""
    parts = module.split(".")
    return ".".join(parts[1:3]) if parts[1] == "common" else parts[1]


def _imports(tree: ast.Module) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("dflash.")}


def test_every_room_is_known():
    rooms = {room(m) for m in _modules()} - {"common"}
    assert rooms <= set(ALLOWED), f"rooms without rules: {sorted(rooms - set(ALLOWED))}"


def violations(modules: dict[str, ast.Module]) -> list[str]:
    """Every import of one room by another that ALLOWED does not permit."""
    broken = []
    for name, tree in modules.items():
        here = room(name)
        for target in _imports(tree):
            if target not in modules:
                continue  # `from package import name`: the name is counted as its own module when it is one
            there = room(target)
            if there != here and there not in ALLOWED.get(here, set()):
                broken.append(f"{name} imports {target} ({here} -> {there})")
    return broken


def test_rooms_import_only_what_the_rules_allow():
    broken = violations(_modules())
    assert not broken, "layer rules broken (docs/architecture.md):\n" + "\n".join(broken)


def test_no_import_cycle_between_modules():
    """Imports form no cycle, function-local ones included: a module-level cycle works only by the accident
    of import order, and a lazy import that closes a circle only hides it (two modules that need each
    other are one job, or share a third module)."""
    modules = _modules()
    graph = {m: {t for t in _imports(tree) if t in modules and t != m} for m, tree in modules.items()}
    state: dict[str, int] = defaultdict(int)  # 0 new, 1 on the path, 2 done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state[n] == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(n) :], n]))
            if state[n] == 0:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if state[m] == 0:
            visit(m)


def test_function_local_imports_only_where_forced():
    modules = _modules()
    lazy = set()
    for name, tree in modules.items():
        top = {id(n) for n in tree.body}
        if any(isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in top for n in ast.walk(tree)):
            lazy.add(name)
    unexplained = sorted(lazy - set(LOCAL_IMPORTS_OK))
    assert not unexplained, f"function-local imports without a reason in LOCAL_IMPORTS_OK: {unexplained}"
    stale = sorted(set(LOCAL_IMPORTS_OK) - lazy)
    assert not stale, f"LOCAL_IMPORTS_OK names modules without local imports: {stale}"


def test_the_checker_reports_a_broken_arrow():
    """The checker itself, on a made-up tree: a drafter module that imports the consumer (even inside a
    function), a producer that imports the consumer and a library module that imports a tool are reported;
    an allowed arrow is not."""
    fake = {
        "dflash.common.drafter.model": ast.parse(
            "def f():\n    from dflash.consumer.trainer import Trainer\n"
        ),
        "dflash.producer.worker": ast.parse("import dflash.consumer.trainer\n"),
        "dflash.common.target.head": ast.parse(
            "from dflash.tools.status import collect\nfrom dflash.common.drafter.model import x\n"
        ),
        "dflash.consumer.trainer": ast.parse(""),
        "dflash.tools.status": ast.parse(""),
    }
    broken = violations(fake)
    assert len(broken) == 3, broken
    assert not any(
        "drafter.model (" in b
        for b in broken
        if b.startswith("dflash.common.target.head imports dflash.common.drafter")
    )


def test_the_drafter_module_is_self_contained():
    """common/drafter/dflash.py is copied into every export as its remote code: it imports the
    standard library, torch and transformers only (no dflash module, no relative import, nothing else a
    serving box may lack), at any depth."""
    import sys

    tree = ast.parse((ROOT / "common" / "drafter" / "dflash.py").read_text())
    tops = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tops.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            tops.add(node.module.split(".")[0] if node.level == 0 and node.module else "<relative import>")
    allowed = {"torch", "transformers"} | set(sys.stdlib_module_names)
    assert {"torch", "transformers"} <= tops, "torch and transformers not found: the check is not looking"
    assert tops <= allowed, f"the drafter module imports {sorted(tops - allowed)}"
