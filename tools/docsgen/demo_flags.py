"""The table of ``jitckpt demo``'s flags, from its own argument parser.

The quick start page holds a marker where the table goes (``MARKER``); the
hook puts the table there at every build, so a flag added to
``local/demo/cli.py`` shows up without anyone editing the page.
"""

from __future__ import annotations

import argparse

from local.demo.cli import configure
from tools.docsgen.source import cell, code

MARKER = "<!-- demo-flags -->"
# For an option whose parser gives no help: its words are the setting's of the same name.
UNSAID = "as the setting of the same name ([settings reference](reference/settings.md))"


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction) or action.default in (None, []):
        return ""
    return f"`{action.default}`"


def render() -> str:
    """One row per option: the flag with its value's form, its default, and its help."""
    parser = argparse.ArgumentParser(prog="jitckpt demo")
    configure(parser)
    lines = ["| flag | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[-1]
        if action.choices:
            flag += " " + "|".join(str(c) for c in action.choices)
        elif action.nargs != 0:
            flag += " " + str(
                action.metavar or ("N" if action.type is int else action.dest.upper())
            )
        help_text = cell(action.help or UNSAID)
        lines.append(f"| {code(flag)} | {_default(action)} | {help_text} |")
    lines.append("| `-- ARGS...` | | after `--`: arguments for your script |")
    return "\n".join(lines)
