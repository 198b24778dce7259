"""Every document the code and the docs cite exists: a `docs/<name>.md` named anywhere in the repository's
tracked text files is a file of docs/, and no file cites the design notes that live outside the repository
(the old ARCHITECTURE.md: docs/architecture.md replaced it)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"\bdocs/([A-Za-z0-9_.-]+\.md)\b")


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    )
    files = out.stdout.split() if out.returncode == 0 else [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")]
    return [ROOT / f for f in files if f.endswith((".py", ".md", ".sh", ".toml")) and (ROOT / f).is_file()]


@pytest.mark.pipeline
def test_cited_docs_exist():
    missing = []
    for path in _tracked_text_files():
        for name in CITED.findall(path.read_text(errors="replace")):
            if not (ROOT / "docs" / name).is_file():
                missing.append(f"{path.relative_to(ROOT)} cites docs/{name}")
    assert not missing, "\n".join(missing)


@pytest.mark.pipeline
def test_no_citation_of_a_document_outside_the_repository():
    here = Path(__file__).resolve()
    stale = [
        str(p.relative_to(ROOT))
        for p in _tracked_text_files()
        if p != here and "ARCHITECTURE" in p.read_text(errors="replace")
    ]
    assert not stale, f"cite docs/architecture.md instead of ARCHITECTURE.md: {stale}"


def test_architecture_doc_names_every_room():
    """docs/architecture.md's table names each package folder of the code (a new room gets a row)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rooms = {f"`{p.relative_to(ROOT)}/`" for p in (ROOT / "common").iterdir() if (p / "__init__.py").exists()}
    rooms |= {"`producer/`", "`consumer/`", "`tools/`"}
    absent = sorted(r for r in rooms if r not in text)
    assert not absent, f"docs/architecture.md does not name {absent}"


def _table_rows() -> dict[str, str]:
    """docs/architecture.md's room table: {the folder or file the row names first: the row's text}."""
    rows = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = line.split("|")
        if line.startswith("| ") and len(cells) > 3 and "`" in cells[2]:
            rows[cells[2].split("`")[1]] = line
    return rows


def _row_of(module: Path, rows: dict[str, str]) -> str:
    """The table row a module belongs in: its room's folder (``common/target/``, ``tools/``), or the row
    naming a top-level library file (``common/metrics.py``)."""
    rel = module.relative_to(ROOT)
    if rel.parts[0] == "common" and len(rel.parts) == 2:
        return next((row for row in rows.values() if f"`{rel}`" in row), "")
    folder = "/".join(rel.parts[:2]) + "/" if rel.parts[0] == "common" else rel.parts[0] + "/"
    return rows.get(folder, "")


def test_architecture_doc_names_every_module():
    """Each module of the package is named in its room's row of docs/architecture.md, so the table a
    newcomer reads first is the code as it is (a module added or split gets its words there)."""
    rows = _table_rows()
    modules = [
        p for folder in ("common", "producer", "consumer", "tools") for p in (ROOT / folder).rglob("*.py")
    ]
    absent = sorted(
        str(p.relative_to(ROOT))
        for p in modules
        if p.name != "__init__.py"
        and f"`{p.name}`" not in _row_of(p, rows)
        and f"`{p.relative_to(ROOT)}`" not in _row_of(p, rows)
    )
    assert not absent, f"docs/architecture.md's table does not name {absent}"


CITED_TEST = re.compile(r"`(test_\w+\.py)?::(test_\w+)")


def test_cited_tests_exist():
    """Every test the docs cite by ``file::test_name`` (docs/reliability.md maps each fault case to the test
    that proves it; ```::name``` continues the file named before it) is a test function of that file under
    tests/, so a test renamed or merged away cannot leave a fault case silently unproven. docs/testing.md's
    "What moved where" names tests that no longer exist on purpose (what they became), so it is not read."""
    missing = []
    for doc in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        if doc.name == "testing.md":
            continue
        current = None
        for match in CITED_TEST.finditer(doc.read_text(errors="replace")):
            current = match.group(1) or current
            path = ROOT / "tests" / (current or "")
            if current is None or not path.is_file():
                missing.append(f"{doc.name}: {match.group(0)[1:]} (no such test file)")
            elif not re.search(rf"^def {match.group(2)}\(", path.read_text(), re.M):
                missing.append(f"{doc.name}: {current}::{match.group(2)}")
    assert not missing, "docs cite tests that do not exist:\n" + "\n".join(missing)
