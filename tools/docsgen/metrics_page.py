"""The Prometheus metrics of the sidecar and the webhook, read from their definitions.

Parsed from the ``Counter``/``Gauge``/``Histogram`` calls in
``sidecar/metrics.py`` and ``webhook/metrics.py``: name, type, help text and
labels are the code's own. ``metrics.yaml`` adds what to watch each one for,
keyed by name; a metric without an entry fails ``tests/docs``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from tools.docsgen.source import ROOT, cell, explanations, parse, plain
from webhook.mutate import SKIP_REASONS

SOURCES = {
    "sidecar": ROOT / "sidecar" / "metrics.py",
    "webhook": ROOT / "webhook" / "metrics.py",
}
KINDS = ("Counter", "Gauge", "Histogram")
# What the exposition adds to a counter's name (prometheus_client 0.20+).
COUNTER_SUFFIX = "_total"


@dataclass(frozen=True)
class Metric:
    """One metric as exposed on ``/metrics``."""

    part: str
    name: str
    kind: str
    help: str
    labels: tuple[str, ...]

    @property
    def exposed(self) -> str:
        return self.name + COUNTER_SUFFIX if self.kind == "Counter" else self.name


def _strings(node: ast.expr | None) -> tuple[str, ...]:
    if isinstance(node, ast.List | ast.Tuple):
        return tuple(
            e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
        )
    return ()


def defined(part: str) -> list[Metric]:
    """The metrics ``part``'s module defines, in the order it defines them."""
    found: list[tuple[int, Metric]] = []
    for node in ast.walk(parse(SOURCES[part])):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in KINDS or len(node.args) < 2:
            continue
        name, doc = node.args[0], node.args[1]
        if not (isinstance(name, ast.Constant) and isinstance(doc, ast.Constant)):
            raise ValueError(f"{SOURCES[part]}:{node.lineno}: a metric named at run time")
        keywords = {k.arg: k.value for k in node.keywords}
        labels = node.args[2] if len(node.args) > 2 else keywords.get("labelnames")
        metric = Metric(part, str(name.value), node.func.id, str(doc.value), _strings(labels))
        found.append((node.lineno, metric))
    return [metric for _, metric in sorted(found, key=lambda pair: pair[0])]


def all_metrics() -> list[Metric]:
    return [m for part in SOURCES for m in defined(part)]


def missing() -> list[str]:
    """Metrics without an entry in ``metrics.yaml``, and entries naming no metric (``stale:``)."""
    names = {m.name for m in all_metrics()}
    written = set(explanations("metrics"))
    return sorted(names - written) + [f"stale: {n}" for n in sorted(written - names)]


def render() -> str:
    explained = explanations("metrics")
    parts = [
        "# Metrics reference",
        "",
        "<!-- generated from sidecar/metrics.py and webhook/metrics.py by "
        "tools/docsgen/metrics_page.py; what to watch for in tools/docsgen/metrics.yaml -->",
        "",
        "The sidecar serves its metrics at `/metrics` on the pod IP, port 8471 (with "
        "`/healthz`, `/readyz` and `/status`); the webhook at `/metrics` on its own port. "
        "Counters are exposed with the `_total` suffix.",
    ]
    for part, title in (("sidecar", "Sidecar"), ("webhook", "Webhook")):
        parts += ["", f"## {title}", "", "| metric | type | labels | meaning | watch for |"]
        parts.append("|---|---|---|---|---|")
        for m in defined(part):
            labels = ", ".join(f"`{label}`" for label in m.labels) or "none"
            watch = cell(explained[m.name])
            row = f"| `{m.exposed}` | {m.kind.lower()} | {labels} | {plain(m.help)} | {watch} |"
            parts.append(row)
    reasons = ", ".join(f"`{reason}`" for reason in SKIP_REASONS)
    parts += ["", f"The `reason` of `jitckpt_webhook_skipped_total` is one of {reasons}."]
    return "\n".join(parts) + "\n"
