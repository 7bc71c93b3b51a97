"""The commands the docs tell a reader to type, read out of the pages' code blocks.

A page gives a command in a code block: indented by four spaces after a blank
line, or in a fenced ``sh`` block. Each line that starts with one of
``PROGRAMS`` is a command; a line ending in ``\\`` continues on the next, and
a `` # comment`` after it is the page talking to the reader, not the shell.
The test that runs them (tests/controlplane/test_docs_commands.py) keys them
by the text read here, so a command added to a page, or one changed, is a
command the test has not seen until someone says how it runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ("jitckpt", "kubectl", "helm", "make")
SHELL_FENCES = ("sh", "bash", "shell", "console")
_FENCE = re.compile(r"^\s*```(\S*)")
_COMMAND = re.compile(rf"^(?:{'|'.join(PROGRAMS)})\s")


@dataclass(frozen=True)
class DocCommand:
    """One command as a page gives it: where, and its text on one line."""

    page: str  # relative to the repository root
    line: int  # 1-based, where the command starts
    text: str


def pages(root: Path = ROOT) -> list[Path]:
    """Every page a reader is sent to: the README, deploy/README.md and the docs site."""
    return [
        root / "README.md",
        root / "deploy" / "README.md",
        *sorted((root / "docs").rglob("*.md")),
    ]


def strip_comment(line: str) -> str:
    """``line`` without a trailing `` # ...`` outside quotes (bash's own rule for ``#``)."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _code_lines(text: str) -> list[tuple[int, str]]:
    """The lines of ``text`` inside shell code blocks, dedented, with their line numbers."""
    found: list[tuple[int, str]] = []
    fence: str | None = None  # the language of the fenced block we are in
    indented = False  # inside an indented block (it began after a blank line)
    previous_blank = True
    for number, line in enumerate(text.splitlines(), start=1):
        opened = _FENCE.match(line)
        if opened is not None:
            fence = None if fence is not None else opened.group(1)
            indented, previous_blank = False, False
            continue
        if fence is not None:
            if fence in SHELL_FENCES:
                found.append((number, line.strip()))
            continue
        if line.startswith("    ") and (indented or previous_blank):
            indented = True
            found.append((number, line.strip()))
        elif line.strip():
            indented = False
        previous_blank = not line.strip()
    return found


def commands_of(page: Path, root: Path = ROOT) -> list[DocCommand]:
    """The commands ``page`` gives, continuation lines joined."""
    found: list[DocCommand] = []
    lines = _code_lines(page.read_text())
    i = 0
    while i < len(lines):
        number, line = lines[i]
        i += 1
        if not _COMMAND.match(line):
            continue
        parts = [strip_comment(line)]
        while parts[-1].endswith("\\") and i < len(lines):
            parts[-1] = parts[-1][:-1].rstrip()
            parts.append(strip_comment(lines[i][1]))
            i += 1
        found.append(DocCommand(str(page.relative_to(root)), number, " ".join(parts)))
    return found


def every_command(root: Path = ROOT) -> list[DocCommand]:
    return [command for page in pages(root) for command in commands_of(page, root)]
