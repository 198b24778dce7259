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
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
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
    stale = [str(p.relative_to(ROOT)) for p in _tracked_text_files() if p != here and "ARCHITECTURE" in p.read_text(errors="replace")]
    assert not stale, f"cite docs/architecture.md instead of ARCHITECTURE.md: {stale}"


def test_architecture_doc_names_every_room():
    """docs/architecture.md's table names each package folder of the code (a new room gets a row)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rooms = {f"`{p.relative_to(ROOT)}/`" for p in (ROOT / "common").iterdir() if (p / "__init__.py").exists()}
    rooms |= {"`producer/`", "`consumer/`", "`tools/`"}
    absent = sorted(r for r in rooms if r not in text)
    assert not absent, f"docs/architecture.md does not name {absent}"
