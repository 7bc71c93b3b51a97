"""Where the generators read from: the repository root, its Python files, the explanation files.

The generators parse source files (``ast``) instead of importing them: the shim
and the sidecar's message sites sit in modules that import torch or talk to a
store at import time, and a parse is all a table of literal strings needs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def python_files(package: str) -> Iterator[Path]:
    """Every module of ``package`` (a top-level directory), in a stable order."""
    yield from sorted((ROOT / package).rglob("*.py"))


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def relative(path: Path) -> str:
    """``path`` as the repository names it (``shim/log.py``), for the tables."""
    return path.relative_to(ROOT).as_posix()


def explanations(name: str) -> dict[str, Any]:
    """The hand-written file ``<name>.yaml`` beside this module: a mapping keyed by code names."""
    data = yaml.safe_load((HERE / f"{name}.yaml").read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{name}.yaml: the top level must be a mapping")
    return data


def cell(text: str) -> str:
    """``text`` fit for one Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def plain(text: str) -> str:
    """Text from the code (a rule, a help string) for a table cell: ``<bucket>`` is no HTML tag."""
    return cell(text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"))


def code(text: str) -> str:
    """``text`` as inline code in a table cell: one line, backticks inside it made quotes (they
    would close the span); a pipe stays as it is, tables do not split inside a code span."""
    inner = " ".join(text.split()).replace("`", "'")
    return f"`{inner}`"
