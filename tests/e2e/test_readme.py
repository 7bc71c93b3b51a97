"""What the README and the docs pages tell a reader to run exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def test_quick_start_names_the_make_targets() -> None:
    quick = README.read_text().split("## Quick start", 1)[1].split("##", 1)[0]
    for target in ("make setup", "make demo", "make test", "make docs"):
        assert target in quick


def test_every_make_target_the_readme_and_the_docs_name_exists() -> None:
    """A command the README or a docs page tells a reader to run (``make test-quick``, ...)."""
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.MULTILINE))
    named: set[str] = set()
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        text = page.read_text()
        named |= set(re.findall(r"(?:`|^    )make ([a-z][a-z-]*)", text, re.MULTILINE))
    assert {"test", "test-quick", "docs", "images"} <= named
    assert named <= targets, named - targets


def test_the_readme_links_only_to_files_that_exist() -> None:
    """The README is a map into docs/: each relative link it gives lands on a file."""
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    assert links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert missing == []
