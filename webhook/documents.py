"""Reading Kubernetes YAML the way ``kubectl`` users hand it over.

One document or many, ``kind: List`` wrappers (``kubectl get -o yaml``), and
``Namespace`` documents whose labels and annotations stand in for the
namespace watch the admission server has: ``jitckpt inject`` and ``jitckpt
audit`` both read their input through here.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from webhook import safeyaml
from webhook.config import ConfigError, WebhookConfig, load_config
from webhook.mutate import NamespaceInfo


class InputError(ValueError):
    """Input that is not Kubernetes YAML."""


_TOP_LEVEL_KEY = re.compile(r"^([A-Za-z][\w.-]*)\s*:")


def split_concatenated(text: str) -> str:
    """Insert ``---`` where ``cat a.yaml b.yaml`` glued two objects into one document.

    Files written without a leading ``---`` run together; a top-level key seen
    twice in one document (``apiVersion`` again) is where the next file began.
    A real document cannot repeat a key, so nothing valid is split.
    """
    out: list[str] = []
    seen: set[str] = set()
    for line in text.splitlines(keepends=True):
        if line.startswith("---") or line.startswith("..."):
            seen.clear()
        else:
            match = _TOP_LEVEL_KEY.match(line)
            if match:
                if match.group(1) in seen:
                    out.append("---\n")
                    seen.clear()
                seen.add(match.group(1))
        out.append(line)
    return "".join(out)


def load_documents(text: str, source: str) -> list[Any]:
    """Every non-empty YAML document of ``text``, in order."""
    try:
        return [d for d in safeyaml.load_all(split_concatenated(text)) if d is not None]
    except yaml.YAMLError as exc:
        raise InputError(f"{source}: not valid YAML: {exc}") from None


def dump_documents(docs: list[Any]) -> str:
    """``docs`` as a multi-document YAML stream (``---`` between documents)."""
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False, explicit_start=True)


def walk(docs: list[Any]) -> Iterator[dict[str, Any]]:
    """Every object, with the items of ``List`` documents in place of the List."""
    for doc in docs:
        if not isinstance(doc, dict):
            continue
        if doc.get("kind") == "List" or str(doc.get("kind", "")).endswith("List"):
            yield from walk(doc.get("items") or [])
        else:
            yield doc


def _strings(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {str(k): str(v) for k, v in value.items()}


def namespaces(docs: list[Any]) -> dict[str, NamespaceInfo]:
    """NamespaceInfo for each ``Namespace`` document (a later one wins)."""
    found: dict[str, NamespaceInfo] = {}
    for obj in walk(docs):
        if obj.get("kind") != "Namespace":
            continue
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        if isinstance(name, str) and name:
            found[name] = NamespaceInfo(
                name=name,
                labels=_strings(meta.get("labels")),
                annotations=_strings(meta.get("annotations")),
            )
    return found


def describe(obj: dict[str, Any], default_namespace: str) -> str:
    """``kind/namespace/name`` for messages; ``generateName*`` when there is no name."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        meta = {}
    name = meta.get("name") or f"{meta.get('generateName') or ''}*"
    namespace = meta.get("namespace") or default_namespace
    return f"{str(obj.get('kind', '?')).lower()}/{namespace}/{name}"


@dataclass(frozen=True)
class CommandInput:
    """What ``jitckpt inject`` and ``jitckpt audit`` start from."""

    config: WebhookConfig
    docs: list[Any]
    namespaces: dict[str, NamespaceInfo]  # from --namespace-file, then the input itself


WITHOUT_CONFIG = (
    "no --config: the built-in defaults stand in for the cluster's ConfigMap (pass its "
    "config.yaml: kubectl -n jitckpt-system get configmap jitckpt-webhook-config "
    "-o jsonpath='{.data.config\\.yaml}')"
)


def read_command_input(
    filename: str, config_path: Path | None, namespace_files: Sequence[Path] = ()
) -> CommandInput:
    """Load the config, the input (``-``: stdin) and the namespaces it describes.

    Every way this can fail (a bad config, YAML that is not Kubernetes, a file
    that cannot be read) is an ``InputError`` with a one-line message, so both
    commands report it the same way.
    """
    try:
        config = load_config(config_path)
        text = sys.stdin.read() if filename == "-" else Path(filename).read_text(encoding="utf-8")
        docs = load_documents(text, filename)
        known: dict[str, NamespaceInfo] = {}
        for path in namespace_files:
            known.update(namespaces(load_documents(path.read_text(encoding="utf-8"), str(path))))
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    except OSError as exc:
        raise InputError(f"{exc.filename}: {exc.strerror}") from None
    known.update(namespaces(docs))
    return CommandInput(config, docs, known)
