"""The compatibility matrix: each framework and configuration against what jitckpt gives it.

The claims are ``matrix.yaml``'s; this module checks them and renders the page.
Every "yes" must name at least one test (``path::function`` or
``path::Class::method``) and every named test must exist: found by parsing the
test file, which costs milliseconds, where ``pytest --collect-only`` would
import torch. The package versions are read from ``constraints.txt`` (and the
Makefile's torchtitan pin), the versions the tests ran with.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.docsgen.source import ROOT, cell, explanations, parse

COLUMNS = {
    "jit": "JIT checkpoint",
    "periodic": "periodic saves in the background",
    "exact": "exact resume",
    "reshard": "resharding",
}
# What a cell may say, and the words it renders as: "proven" (yes) needs tests, the others a
# reason (tests optional). Not "yes"/"no" as keys: YAML reads those as booleans.
PROVEN = "proven"
VERDICTS = {
    PROVEN: "yes",
    "unsupported": "no",
    "untested": "not tested",
    "own": "the framework's own",
}
PIN = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)")
MAKEFILE_PIN = re.compile(r"^[A-Z_]+ := ([A-Za-z0-9_.-]+)==(\S+)", re.MULTILINE)


@dataclass(frozen=True)
class Cell:
    verdict: str
    note: str
    tests: tuple[str, ...]


def versions() -> dict[str, str]:
    """Pinned versions by normalized name: ``constraints.txt``, then the Makefile's own pins."""
    found: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        match = PIN.match(line)
        if match:
            found[_normal(match.group(1))] = match.group(2)
    for name, version in MAKEFILE_PIN.findall((ROOT / "Makefile").read_text(encoding="utf-8")):
        found.setdefault(_normal(name), version)
    return found


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def rows() -> list[dict[str, Any]]:
    data = explanations("matrix")["rows"]
    if not isinstance(data, list):
        raise ValueError("matrix.yaml: rows must be a list")
    return data


def cell_of(row: dict[str, Any], column: str) -> Cell:
    """A row's claim for ``column``, checked: a known verdict, tests for "yes", a note otherwise."""
    value = row.get(column)
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(f"matrix.yaml: {row.get('name')}: {column} must be one verdict")
    verdict, body = next(iter(value.items()))
    if verdict not in VERDICTS:
        raise ValueError(f"matrix.yaml: {row.get('name')}: unknown verdict {verdict!r}")
    body = body if isinstance(body, dict) else {}
    tests = tuple(body.get("tests") or ())
    note = str(body.get("note") or "")
    if verdict == PROVEN and not tests:
        raise ValueError(f"matrix.yaml: {row.get('name')}: {column} is yes without a test")
    if verdict != PROVEN and not note:
        raise ValueError(f"matrix.yaml: {row.get('name')}: {column} is {verdict} without a note")
    return Cell(verdict, note, tests)


def defined_tests(path: Path) -> set[str]:
    """``function`` and ``Class::method`` names of the tests a file defines."""
    names = set()
    for node in parse(path).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(f"{node.name}::{item.name}")
    return {name for name in names if name.split("::")[-1].startswith("test")}


def linked_tests() -> list[str]:
    """Every test node id the matrix names, in the order it first names them."""
    seen: dict[str, None] = {}
    for row in rows():
        for column in COLUMNS:
            for test in cell_of(row, column).tests:
                seen.setdefault(test, None)
    return list(seen)


def missing_tests() -> list[str]:
    """Named tests that do not exist (the file or the function), and packages with no pin."""
    problems = []
    for test in linked_tests():
        path, _, name = test.partition("::")
        file = ROOT / path
        if not file.is_file() or name not in defined_tests(file):
            problems.append(f"no test {test}")
    pins = versions()
    for row in rows():
        problems += [f"no pin for {p}" for p in row.get("packages", []) if _normal(p) not in pins]
    return problems


def _render_cell(value: Cell, numbers: dict[str, int]) -> str:
    refs = ", ".join(f"[{numbers[t]}](#test-{numbers[t]})" for t in value.tests)
    text = VERDICTS[value.verdict]
    if value.note:
        text += f": {value.note}"
    return cell(text + (f" ({refs})" if refs else ""))


def render() -> str:
    pins = versions()
    numbers = {test: index for index, test in enumerate(linked_tests(), start=1)}
    header = "| framework or configuration | tested with | " + " | ".join(COLUMNS.values()) + " |"
    lines = [
        "# Compatibility matrix",
        "",
        "<!-- generated from tools/docsgen/matrix.yaml and constraints.txt by "
        "tools/docsgen/matrix.py; every linked test is checked to exist -->",
        "",
        explanations("matrix")["intro"],
        "",
        header,
        "|" + "---|" * (len(COLUMNS) + 2),
    ]
    for row in rows():
        tested = ", ".join(f"{p} {pins[_normal(p)]}" for p in row.get("packages", [])) or "-"
        cells = " | ".join(_render_cell(cell_of(row, c), numbers) for c in COLUMNS)
        lines.append(f"| {cell(row['name'])} | {tested} | {cells} |")
    lines += ["", "## The tests", ""]
    for test, n in numbers.items():  # one paragraph each: attr_list gives it the anchor
        lines += [f"**{n}.** `{test}`", f"{{: #test-{n} }}", ""]
    return "\n".join(lines) + "\n"
