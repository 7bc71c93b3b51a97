"""The reference of every setting: annotations, labels, the webhook's ConfigMap, trainer env.

Names, defaults and rules come from the code that parses them
(``webhook/settings.py``, ``webhook/config.py``, the shim's ``ENV_*``
constants); what each one is for comes from ``settings.yaml``, keyed by the
same names, since the code's own help strings are one-liners for error messages.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic_core import PydanticUndefined

from tools.docsgen.source import cell, explanations, parse, plain, python_files, relative
from webhook import settings
from webhook.config import WebhookConfig

# shim/layout.py's env names are written by the webhook; a user sets only the shim's own knobs.
WEBHOOK_WRITTEN_ENV = "shim/layout.py"
ENV_PREFIX = "JITCKPT_"


@dataclass(frozen=True)
class Entry:
    """One row: the name a user writes, its default in words, and its rule."""

    name: str
    default: str
    rule: str


def annotation_settings() -> list[Entry]:
    return [
        Entry(s.name, "unset" if s.default is None else f"`{s.default}`", s.rule)
        for s in settings.SETTINGS.values()
    ]


def labels() -> list[Entry]:
    """The ``jitckpt.io/*`` keys that are no setting: opt-in, opt-out, the webhook's record."""
    return [
        Entry(settings.INJECTION_LABEL, "absent", f"`{settings.INJECTION_ENABLED}` opts in"),
        Entry(settings.INJECT_KEY, "absent", "true or false"),
        Entry(settings.STATUS_KEY, "written by the webhook", "not for users to set"),
        Entry(settings.REASON_KEY, "written by the webhook", "not for users to set"),
    ]


def _default(info: Any) -> str:
    """A field's default as the YAML file would write it."""
    value = info.default
    if value is PydanticUndefined:
        value = info.default_factory() if info.default_factory is not None else None
    if value is None:
        return "required"
    if isinstance(value, bool):
        value = "true" if value else "false"
    return f"`{value}`"


def _type(info: Any) -> str:
    """A field's type in words, with the bounds pydantic checks (``ge``, ``le``)."""
    annotation = info.annotation
    words = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    words = words.replace("typing.", "")
    for bound in info.metadata:
        for attribute, sign in (("ge", ">="), ("le", "<=")):
            if hasattr(bound, attribute):
                words += f", {sign} {getattr(bound, attribute)}"
    return words


def configmap() -> list[Entry]:
    """The keys of the webhook's config file, from its pydantic model (unknown keys fail there)."""
    fields = WebhookConfig.model_fields
    return [Entry(name, _default(info), _type(info)) for name, info in fields.items()]


def trainer_env() -> list[Entry]:
    """The shim's own env knobs: module-level ``ENV_* = "JITCKPT_..."`` outside the layout."""
    found = []
    for path in python_files("shim"):
        if relative(path) == WEBHOOK_WRITTEN_ENV:
            continue
        for node in parse(path).body:
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)):
                continue
            value = node.value.value
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if any(n.startswith("ENV_") for n in names) and str(value).startswith(ENV_PREFIX):
                found.append(Entry(str(value), "unset", relative(path)))
    return found


SECTIONS: dict[str, Callable[[], list[Entry]]] = {
    "annotations": annotation_settings,
    "labels": labels,
    "configmap": configmap,
    "trainer_env": trainer_env,
}


def missing() -> dict[str, list[str]]:
    """Per section, the names the code defines that ``settings.yaml`` does not explain, and the
    entries it has for names the code no longer defines (prefixed ``stale:``)."""
    explained = explanations("settings")
    out: dict[str, list[str]] = {}
    for section, entries in SECTIONS.items():
        names = {e.name for e in entries()}
        written = set(explained.get(section) or {})
        problems = sorted(names - written) + [f"stale: {n}" for n in sorted(written - names)]
        if problems:
            out[section] = problems
    return out


def _table(section: str, header: str) -> list[str]:
    explained = explanations("settings")[section]
    lines = [header, "|---|---|---|---|"]
    for entry in SECTIONS[section]():
        meaning = cell(explained[entry.name])
        lines.append(f"| `{entry.name}` | {entry.default} | {meaning} | {plain(entry.rule)} |")
    return lines


def render() -> str:
    intro = explanations("settings")["intro"]
    parts = [
        "# Settings reference",
        "",
        "<!-- generated from webhook/settings.py, webhook/config.py and the shim's ENV_* "
        "names by tools/docsgen/settings_page.py; explanations in tools/docsgen/settings.yaml -->",
        "",
        intro,
        "",
        "## Annotations (`jitckpt.io/<key>`)",
        "",
        "On the namespace (the namespace's default), on the pod template (PyTorchJob replica "
        "template, TrainJob `runtimePatches` pod metadata), or under `defaults:` of the "
        "webhook's ConfigMap without the prefix. Every value also follows one rule of its "
        f"own: it {plain(settings.NO_ENV_EXPANSION_RULE)}.",
        "",
        *_table("annotations", "| key | default | meaning | rule |"),
        "",
        "## Labels and keys that are no setting",
        "",
        *_table("labels", "| key | default | meaning | values |"),
        "",
        "## The webhook's ConfigMap (`jitckpt-webhook-config`, `config.yaml`)",
        "",
        "Checked completely when the server starts: an unknown key or an invalid value "
        "stops it there, naming the key.",
        "",
        *_table("configmap", "| key | default | meaning | type |"),
        "",
        "## Trainer environment variables",
        "",
        "Set in the trainer container's `env` by you, not by the webhook; read by the shim "
        "(a malformed value is said once and ignored).",
        "",
        *_table("trainer_env", "| variable | default | meaning | read in |"),
        "",
    ]
    return "\n".join(parts)
