"""The page of every message the shim and the sidecar print: what it says, means, and asks.

The messages come from ``messages.py`` (their call sites); the meaning and the
action from ``messages.yaml``, keyed by the message's key. The shim's
``failed(key, exc)`` lines share one explanation, and their keys are listed
so that a line found in a log can be looked up.
"""

from __future__ import annotations

import re
from typing import Any

from tools.docsgen import messages
from tools.docsgen.source import cell, code, explanations

# printf-style fields of a format string: shown as an ellipsis, the value being run-time text.
FIELD = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdrgfx]")
# A sidecar format string that is only a field: its entry says what the line reads like.
BARE = "%s"


def readable(template: str) -> str:
    return FIELD.sub("…", template)


def missing() -> list[str]:
    """Message keys with no entry in ``messages.yaml``, entries naming no message (``stale``),
    and entries that lack what their row needs."""
    explained = explanations("messages")
    problems = []
    parts = (
        ("shim", messages.shim_messages()),
        ("shim_lines", messages.shim_lines()),
        ("sidecar", messages.sidecar_messages()),
    )
    for part, found in parts:
        written = explained.get(part) or {}
        problems += [f"{part}: {key}" for key in sorted(set(found) - set(written))]
        problems += [f"stale {part}: {key}" for key in sorted(set(written) - set(found))]
        for key, entry in written.items():
            if not (isinstance(entry, dict) and entry.get("means") and entry.get("do")):
                problems.append(f"{part}: {key} needs means and do")
            elif key in found and BARE in found[key].templates and not entry.get("reads"):
                problems.append(f"{part}: {key} prints only a field: say what it reads like")
    return problems


def _said(templates: list[str], entry: dict[str, Any]) -> str:
    shown = [t for t in templates if t != BARE]
    text = " / ".join(code(readable(t)) for t in shown)
    if entry.get("reads"):
        text = (text + "; " if text else "") + "e.g. " + code(entry["reads"])
    return text


def _shim_table(explained: dict[str, Any]) -> list[str]:
    lines = ["| key | message | means | what to do |", "|---|---|---|---|"]
    for key, message in sorted(messages.shim_messages().items()):
        entry = explained[key]
        said = _said(message.templates, entry)
        lines.append(f"| `{key}` | {said} | {cell(entry['means'])} | {cell(entry['do'])} |")
    return lines


def _lines_table(explained: dict[str, Any]) -> list[str]:
    lines = ["| line | where | means | what to do |", "|---|---|---|---|"]
    for key, message in sorted(messages.shim_lines().items()):
        entry = explained[key]
        said = _said(message.templates, entry)
        where = key.split(":", 1)[0]
        lines.append(f"| {said} | `{where}` | {cell(entry['means'])} | {cell(entry['do'])} |")
    return lines


def _sidecar_table(explained: dict[str, Any]) -> list[str]:
    lines = ["| level | message | where | means | what to do |", "|---|---|---|---|---|"]
    for key, message in sorted(messages.sidecar_messages().items()):
        entry = explained[key]
        said = _said(message.templates, entry)
        where = key.split(":", 1)[0]
        row = f"| {message.level} | {said} | `{where}` | {cell(entry['means'])} | "
        lines.append(row + f"{cell(entry['do'])} |")
    return lines


def render() -> str:
    explained = explanations("messages")
    failed = explained["failed"]
    keys = messages.shim_failures()
    listed = "\n".join(f"- `{key}`" for key in sorted(keys))
    parts = [
        "# Messages reference",
        "",
        "<!-- generated from the shim's say_once/failed call sites and the sidecar's "
        "warnings and errors by tools/docsgen/messages.py; explanations in "
        "tools/docsgen/messages.yaml -->",
        "",
        explained["intro"],
        "",
        "## In the trainer's log (the shim)",
        "",
        "Each line reads `[jitckpt] pid <pid>: <message>` on the training process's stderr, "
        "at most once per process and key (`…` stands for run-time text).",
        "",
        *_shim_table(explained["shim"]),
        "",
        "### Other lines",
        "",
        "Printed each time they happen (a save, a stop, a resume), with the same prefix.",
        "",
        *_lines_table(explained["shim_lines"]),
        "",
        "### `… failed (…); training continues without it`",
        "",
        f"{failed['means']} {failed['do']}",
        "",
        "The parts that can fail this way, as the line names them:",
        "",
        listed,
        "",
        "## In the sidecar's log (`jitckpt-agent`)",
        "",
        "Lines `<time> WARNING|ERROR jitckpt-agent sidecar.<module>: <message>` on the "
        "sidecar's stderr (`kubectl logs <pod> -c jitckpt-agent`).",
        "",
        *_sidecar_table(explained["sidecar"]),
        "",
    ]
    return "\n".join(parts)
