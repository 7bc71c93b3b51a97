"""The README's configuration table lists every setting, with its default."""

from __future__ import annotations

import re
from pathlib import Path

from webhook.settings import SETTINGS

README = Path(__file__).parents[2] / "README.md"


def table_rows() -> dict[str, list[str]]:
    text = README.read_text()
    start = text.index("<!-- settings-table")
    rows: dict[str, list[str]] = {}
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        match = re.fullmatch(r"`([a-z0-9-]+)`", cells[0])
        if match:
            rows[match.group(1)] = cells
    return rows


def test_every_setting_has_a_row_with_its_default() -> None:
    rows = table_rows()
    assert set(rows) == set(SETTINGS), set(rows) ^ set(SETTINGS)
    for name, setting in SETTINGS.items():
        expected = "unset" if setting.default is None else f"`{setting.default}`"
        assert rows[name][1] == expected, (name, rows[name][1], expected)


def test_quick_start_names_the_make_targets() -> None:
    quick = README.read_text().split("## Quick start", 1)[1].split("##", 1)[0]
    for target in ("make setup", "make demo", "make test"):
        assert target in quick


def test_every_make_target_the_readme_names_exists() -> None:
    """A command the README tells a contributor to run (``make test-quick``, ...) is there."""
    makefile = (README.parent / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.MULTILINE))
    named = set(re.findall(r"(?:`|^    )make ([a-z][a-z-]*)", README.read_text(), re.MULTILINE))
    assert {"test", "test-quick"} <= named
    assert named <= targets, named - targets
