"""``jitckpt audit``: which pods are injected, by what, and which have drifted.

For security teams: feed it ``kubectl get pods -A -o yaml`` (add ``kubectl
get namespaces -o yaml`` to the input so namespace settings are known). One
row per pod: injected?, jitckpt version, mode, job root, Secret, grace
period, drift (see ``webhook/drift.py``) and the reason a pod is not protected (its
``jitckpt.io/reason`` mark: a skip reason as the metrics spell it, or ``no-credentials``;
the sidecar's own word once it ended unprotected); ``--json`` gives the whole sentence.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jitckpt.text import escape

EXIT_BAD_INPUT = 2
COLUMNS = (
    "NAMESPACE",
    "POD",
    "INJECTED",
    "VERSION",
    "MODE",
    "DESTINATION",
    "SECRET",
    "GRACE",
    "DRIFT",
    "REASON",
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", required=True, help="YAML with pods ('-': stdin)")
    parser.add_argument("--config", type=Path, help="the webhook's current config file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def _table(rows: list[list[str]]) -> str:
    """The rows aligned; every cell escaped (a pod's annotations are its owner's text)."""
    rows = [[escape(cell) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from webhook.documents import WITHOUT_CONFIG, InputError, read_command_input, walk
    from webhook.drift import audit_pod

    try:
        given = read_command_input(args.filename, args.config)
    except InputError as exc:
        print(f"jitckpt audit: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    config, docs, known = given.config, given.docs, given.namespaces
    if args.config is None:
        print(f"jitckpt audit: {WITHOUT_CONFIG}", file=sys.stderr)
    audits = []
    for obj in walk(docs):
        if obj.get("kind") != "Pod":
            continue
        ns = (obj.get("metadata") or {}).get("namespace") or "default"
        audits.append(audit_pod(obj, known.get(ns), config))
    if args.json:
        print(json.dumps([asdict(a) for a in audits], indent=2))
        return 0
    rows = [list(COLUMNS)]
    for a in audits:
        drift = ",".join(a.drift) or ("no" if a.injected else "-")
        grace = "-" if a.grace_period_seconds is None else str(a.grace_period_seconds)
        rows.append(
            [
                a.namespace,
                a.pod,
                "yes" if a.injected else "no",
                a.version or "-",
                a.mode or "-",
                a.destination or "-",
                a.secret or "-",
                grace,
                drift,
                a.reason.split(":", 1)[0] if a.reason else "-",
            ]
        )
    sys.stdout.write(_table(rows))
    return 0
